"""Perf scenarios (pytest-benchmark): each round is one greedy or speculative decode of
``--perf-max-tokens`` tokens; ``extra_info`` carries decode tok/s, the deterministic counters of the last
round, and ratios measured side by side in this process. The plugin's perf gate compares them with the
baseline in ``baselines/`` under ``--benchmark-compare``.

Record a new baseline (single process, on an otherwise idle machine):
    pytest -m perf --benchmark-save=baseline
"""

import statistics

import pytest

from mlx_streaming.bench import timed_greedy
from mlx_streaming.mtp.drafter import MTPDrafter
from mlx_streaming.mtp.speculative import mtp_generate

pytestmark = pytest.mark.perf


@pytest.fixture(scope="module")
def perf(request):
    return {"max_tokens": request.config.getoption("--perf-max-tokens"), "repeat": request.config.getoption("--perf-repeat")}


@pytest.fixture
def fresh_model(model_dir, mtp_path, streaming_config):
    """A newly built streaming model with its MTP head per call (``"quarter"``: 25% pool, direct mode), so each
    scenario's counters start from an empty pool whatever ran before it."""
    from mlx_streaming.model import build_streaming_model

    built = []

    def make(pool: str, **changes):
        config = streaming_config.replace(mtp=mtp_path.exists(), mtp_path=str(mtp_path), **changes).with_pool()
        if pool == "quarter":
            config = config.with_pool(pool_fraction=0.25).replace(io_mode="direct")
        built.append(build_streaming_model(model_dir, config))
        return built[-1]

    yield make
    for sm in built:
        sm.close()


def _greedy_rounds(benchmark, model, prompt, perf, store=None):
    """benchmark.pedantic over greedy decodes; returns (median decode tok/s, the last round's counters)."""
    rates = []

    def setup():
        if store is not None:
            store.reset_stats()

    def once():
        rate, _ = timed_greedy(model, prompt, perf["max_tokens"], 256)
        rates.append(rate)

    timed_greedy(model, prompt, 4, 256)  # warm-up
    benchmark.pedantic(once, setup=setup, rounds=perf["repeat"], iterations=1)
    return statistics.median(rates), (store.stats() if store is not None else {})


def _counters(stats):
    return {"disk_loads": stats["misses"], "hits": stats["hits"]}


def test_greedy_full_pool(benchmark, fresh_model, prompt_ids, perf):
    sm = fresh_model("full")
    tok_s, stats = _greedy_rounds(benchmark, sm.model, prompt_ids[0], perf, sm.store)
    benchmark.extra_info.update(tok_s=tok_s, **_counters(stats), pool_slots=sm.store.capacity, io_mode="buffered")


def test_greedy_quarter_pool_direct(benchmark, fresh_model, prompt_ids, perf):
    sm = fresh_model("quarter")
    tok_s, stats = _greedy_rounds(benchmark, sm.model, prompt_ids[0], perf, sm.store)
    benchmark.extra_info.update(tok_s=tok_s, **_counters(stats), pool_slots=sm.store.capacity, io_mode="direct")


def test_greedy_quarter_pool_prefetch(benchmark, fresh_model, prompt_ids, perf):
    """LRU + prefetch (ahead 1) at the 25% pool in direct mode, against the same pool without prefetch measured
    beside it. Which experts the prefetch serves depends on read timing, so only the ratio is gated."""
    sm = fresh_model("quarter", prefetch=True, prefetch_ahead=1)
    tok_s, stats = _greedy_rounds(benchmark, sm.model, prompt_ids[0], perf, sm.store)
    plain = fresh_model("quarter")
    lru_tok_s = _median_greedy(plain.model, prompt_ids[0], perf)
    benchmark.extra_info.update(tok_s=tok_s, lru_tok_s=lru_tok_s, prefetch_over_lru=tok_s / lru_tok_s,
                                prefetch_hits=stats["prefetch_hits"], demand_loads=stats["demand_loads"],
                                pool_slots=sm.store.capacity, io_mode="direct")


def _median_greedy(model, prompt, perf) -> float:
    """Median decode tok/s of ``repeat`` greedy decodes after a warm-up, outside pytest-benchmark's timing."""
    timed_greedy(model, prompt, 4, 256)
    return statistics.median(timed_greedy(model, prompt, perf["max_tokens"], 256)[0] for _ in range(perf["repeat"]))


def test_speculative_k3(benchmark, fresh_model, prompt_ids, perf):
    """K=3, direct commit, at the 25% pool in direct mode: speedup and disk-load ratio against greedy on the
    same model, measured side by side."""
    sm, prompt = fresh_model("quarter"), prompt_ids[0]
    if sm.mtp is None:
        pytest.skip(f"{sm.path} has no MTP head (mtp.safetensors): nothing to speculate with")
    rates, last = [], {}

    def setup():
        sm.store.reset_stats()

    def once():
        _, stats = mtp_generate(sm.model, MTPDrafter(sm.mtp, sm.model), prompt, perf["max_tokens"], 3, "direct")
        rates.append(stats["decode_tok_s"])
        last.update(stats, store=sm.store.stats())

    mtp_generate(sm.model, MTPDrafter(sm.mtp, sm.model), prompt, 4, 3, "direct")  # warm-up
    benchmark.pedantic(once, setup=setup, rounds=perf["repeat"], iterations=1)
    greedy_rates = []
    for _ in range(perf["repeat"]):
        sm.store.reset_stats()
        greedy_rates.append(timed_greedy(sm.model, prompt, perf["max_tokens"], 256)[0])
    greedy_loads = sm.store.stats()["misses"]
    tok_s = statistics.median(rates)
    benchmark.extra_info.update(
        tok_s=tok_s, greedy_tok_s=statistics.median(greedy_rates), speedup=tok_s / statistics.median(greedy_rates),
        **_counters(last["store"]), accepted_drafts=last["accepted_drafts"], steps=last["steps"],
        disk_load_ratio=last["store"]["misses"] / greedy_loads, K=3, verify_mode="direct",
    )


def test_inmemory_mlx_lm(benchmark, reference_model, fresh_model, prompt_ids, perf):
    """mlx-lm's own model, and the full-pool streaming model beside it for the streaming / in-memory ratio."""
    tok_s, _ = _greedy_rounds(benchmark, reference_model, prompt_ids[0], perf)
    streaming = _median_greedy(fresh_model("full").model, prompt_ids[0], perf)  # warmed up as the in-memory side
    benchmark.extra_info.update(tok_s=tok_s, streaming_tok_s=streaming, streaming_over_inmemory=streaming / tok_s)
