"""Perf scenarios (pytest-benchmark). Each round is one greedy or speculative decode of ``--streaming-perf-tokens``
tokens from a fresh cache (the pool stays warm), run just after a yardstick round: the same greedy decode on
mlx-lm's in-memory model (in the round's untimed setup). ``extra_info`` holds each round's token costs in the
gate's unit (``perf_gate.cost_unit``: CPU seconds here, wall seconds on a GPU; a greedy round's tokens one by
one, a speculative round's as one cost per token) and its yardstick round's, the wall seconds per token beside
them, and the work counters of the first timed round (so they do not depend on the number of rounds). The
full-pool scenario is compute alone (every forward the engine's decode path, no read) and is the gate's fine check
of it: ``--streaming-perf-rounds`` rounds judged at ``perf_gate.COMPUTE_THRESHOLD``; the scenarios that read from
disk run ``--streaming-perf-disk-rounds`` rounds judged at ``perf_gate.DISK_THRESHOLD``. The plugin's perf gate
compares them with the baseline in ``baselines/`` under ``--benchmark-compare``.

Record a new baseline (single process; it runs ``perf_gate.BASELINE_ROUNDS_FACTOR`` times the rounds):
    pytest -m perf --benchmark-save=baseline
"""

import os

import pytest

from mlx_streaming.harness import perf_gate
from mlx_streaming.generate import greedy_steps
from mlx_streaming.mtp.drafter import MTPDrafter
from mlx_streaming.mtp.speculative import mtp_generate

pytestmark = pytest.mark.perf

#: Counters that are exact for every scenario, and those exact only without prefetch (with prefetch, which
#: reads finish before their acquire, and so what is read on demand, depends on timing).
EXACT = ("routed", "experts_placed", "host_syncs")
EXACT_WITHOUT_PREFETCH = EXACT + ("demand_loads", "bytes_read", "read_calls", "verify_calls")


@pytest.fixture(scope="module")
def perf(request):
    """Tokens per round and rounds per kind of scenario; a run that records a baseline (pytest-benchmark's
    ``--benchmark-save`` or ``--benchmark-autosave``) runs ``perf_gate.BASELINE_ROUNDS_FACTOR`` times the rounds."""
    option = request.config.getoption
    recording = option("benchmark_save") or option("benchmark_autosave")
    factor = perf_gate.BASELINE_ROUNDS_FACTOR if recording else 1
    return {"tokens": option("--streaming-perf-tokens"),
            "compute_rounds": factor * option("--streaming-perf-rounds"),
            "disk_rounds": factor * option("--streaming-perf-disk-rounds")}


@pytest.fixture
def fresh_model(model_dir, mtp_path, streaming_config):
    """A newly built streaming model per call (``"full"``: every expert read in at build, ``--preload``;
    ``"quarter"``: 25% pool, direct mode), so each scenario's counters start from the same pool whatever ran
    before it."""
    from mlx_streaming.model import build_streaming_model

    built = []

    def make(pool: str, **changes):
        # MLX_STREAMING_PLANT_S plants a slowdown (CPU seconds per forward) for the gate's power study and tests.
        plant = float(os.environ.get("MLX_STREAMING_PLANT_S", "0"))
        config = streaming_config.replace(mtp=mtp_path.exists(), mtp_path=str(mtp_path), plant_s=plant,
                                          **changes).with_pool()
        if pool == "quarter":
            config = config.with_pool(pool_fraction=0.25).replace(io_mode="direct")
        else:
            config = config.replace(preload=True)
        built.append(build_streaming_model(model_dir, config))
        return built[-1]

    yield make
    for sm in built:
        sm.close()


@pytest.fixture(scope="module")
def yardstick(reference_model, prompt_ids, perf):
    """The yardstick round: greedy on mlx-lm's in-memory model, the prompt every scenario decodes."""
    return _greedy(reference_model, prompt_ids[0], perf)


def _rounds(benchmark, decode, yardstick, perf, store, exact=(), reads=True):
    """``benchmark.pedantic`` over ``decode(unit)`` (returns its token costs, wall seconds per token and the
    speculative stats or None), each round after a ``yardstick(unit)`` round: each round's token costs and its
    yardstick's in the gate's unit, the wall seconds, the first timed round's work counters, and the slowdown the
    gate tolerates for this scenario. ``reads``: whether the scenario reads experts from disk, which sets its
    number of rounds and its threshold."""
    unit, costs, yard_costs, walls, first = perf_gate.cost_unit(), [], [], [], {}

    def setup():
        yard_costs.append(yardstick(unit)[0])
        store.reset_stats()

    def once():
        spent, wall, spec = decode(unit)
        costs.append(spent)
        walls.append(wall)
        if not first:
            first.update(perf_gate.work_counters(store.stats(), store.reader.reads, perf["tokens"], spec))

    # Warm-up: the yardstick once, the scenario twice. The first fills the pool; the second starts, like every
    # timed round, from a pool this decode has already been through. (The full pool is preloaded: no forward
    # there can miss, and its hits are counted in bulk, one host sync per round when stats() is read.)
    yardstick(unit), decode(unit), decode(unit)
    rounds, threshold = ((perf["disk_rounds"], perf_gate.DISK_THRESHOLD) if reads
                         else (perf["compute_rounds"], perf_gate.COMPUTE_THRESHOLD))
    benchmark.pedantic(once, setup=setup, rounds=rounds, iterations=1)
    benchmark.extra_info.update(unit=unit, costs=costs, yard_costs=yard_costs, wall_s_per_token=walls,
                                tokens=perf["tokens"], counters=first, exact=list(exact), threshold=threshold)


def _greedy(model, prompt, perf):
    def decode(unit):
        return (*perf_gate.token_costs(greedy_steps(model, prompt, perf["tokens"]), unit), None)

    return decode


def test_greedy_full_pool(benchmark, yardstick, fresh_model, prompt_ids, perf):
    sm = fresh_model("full")
    _rounds(benchmark, _greedy(sm.model, prompt_ids[0], perf), yardstick, perf, sm.store, EXACT_WITHOUT_PREFETCH,
            reads=False)


def test_greedy_quarter_pool_direct(benchmark, yardstick, fresh_model, prompt_ids, perf):
    sm = fresh_model("quarter")
    _rounds(benchmark, _greedy(sm.model, prompt_ids[0], perf), yardstick, perf, sm.store, EXACT_WITHOUT_PREFETCH)


def test_greedy_quarter_pool_prefetch(benchmark, yardstick, fresh_model, prompt_ids, perf):
    """LRU + prefetch (ahead 1) at the 25% pool in direct mode."""
    sm = fresh_model("quarter", prefetch=True, prefetch_ahead=1)
    _rounds(benchmark, _greedy(sm.model, prompt_ids[0], perf), yardstick, perf, sm.store, EXACT)


def test_speculative_k3(benchmark, yardstick, fresh_model, prompt_ids, perf):
    """K=3, direct commit, at the 25% pool in direct mode: one cost per token for each round."""
    sm = fresh_model("quarter")
    if sm.mtp is None:
        pytest.skip(f"{sm.path} has no MTP head (mtp.safetensors): nothing to speculate with")
    prompt = prompt_ids[0]

    def decode(unit):
        cost, wall, stats = perf_gate.measured(
            lambda: mtp_generate(sm.model, MTPDrafter(sm.mtp, sm.model), prompt, perf["tokens"], 3, "direct")[1],
            perf["tokens"], unit)
        return [cost], wall, stats

    _rounds(benchmark, decode, yardstick, perf, sm.store, EXACT_WITHOUT_PREFETCH + ("spec_steps", "accepted_drafts"))
