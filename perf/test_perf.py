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


@pytest.fixture(scope="module")
def quarter_pool_direct(model_dir, mtp_path, streaming_config):
    from mlx_streaming.model import build_streaming_model

    probe = streaming_config.replace(mtp=True, mtp_path=str(mtp_path))
    with build_streaming_model(model_dir, probe.replace(pool_slots=None)) as full:
        slots = max(full.store.top_k, full.store.index.num_experts // 4)
    with build_streaming_model(model_dir, probe.replace(pool_slots=slots, io_mode="direct")) as sm:
        yield sm


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


def test_greedy_full_pool(benchmark, mtp_model, prompt_ids, perf):
    tok_s, stats = _greedy_rounds(benchmark, mtp_model.model, prompt_ids[0], perf, mtp_model.store)
    benchmark.extra_info.update(tok_s=tok_s, **_counters(stats), pool_slots=mtp_model.store.capacity, io_mode="buffered")


def test_greedy_quarter_pool_direct(benchmark, quarter_pool_direct, prompt_ids, perf):
    sm = quarter_pool_direct
    tok_s, stats = _greedy_rounds(benchmark, sm.model, prompt_ids[0], perf, sm.store)
    benchmark.extra_info.update(tok_s=tok_s, **_counters(stats), pool_slots=sm.store.capacity, io_mode="direct")


def test_speculative_k3(benchmark, quarter_pool_direct, prompt_ids, perf):
    """K=3, direct commit, at the 25% pool in direct mode: speedup and disk-load ratio against greedy on the
    same model, measured side by side."""
    sm, prompt = quarter_pool_direct, prompt_ids[0]
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


def test_inmemory_mlx_lm(benchmark, reference_model, mtp_model, prompt_ids, perf):
    """mlx-lm's own model, and the full-pool streaming model beside it for the streaming / in-memory ratio."""
    tok_s, _ = _greedy_rounds(benchmark, reference_model, prompt_ids[0], perf)
    streaming = statistics.median(timed_greedy(mtp_model.model, prompt_ids[0], perf["max_tokens"], 256)[0] for _ in range(perf["repeat"]))
    benchmark.extra_info.update(tok_s=tok_s, streaming_tok_s=streaming, streaming_over_inmemory=streaming / tok_s)
