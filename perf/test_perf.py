"""Perf scenarios (pytest-benchmark), as ``mlx_streaming.harness.perf_rounds`` defines and measures them: each
round is one greedy or speculative decode of ``--streaming-perf-tokens`` tokens from a fresh cache (the pool stays
warm), run just after a yardstick round, the same greedy decode on mlx-lm's in-memory model (in the round's
untimed setup). ``extra_info`` holds each round's token costs in the gate's unit (``perf_rounds.cost_unit``: CPU
seconds here, wall seconds on a GPU) and its yardstick round's, the wall seconds per token beside them, and the
work counters of the first timed round (so they do not depend on the number of rounds). The full-pool scenario is
compute alone and is the gate's fine check of the decode path: ``--streaming-perf-rounds`` rounds judged at
``perf_gate.COMPUTE_THRESHOLD``; the scenarios that read from disk run ``--streaming-perf-disk-rounds`` rounds
judged at ``perf_gate.DISK_THRESHOLD``. Side by side (``side_by_side``), each round's setup first runs a round of
the base revision's engine in its worker, so the two revisions alternate; ``extra_info["base"]`` holds its rounds.
The plugin's perf gate compares them under ``--benchmark-compare``.

Record a new baseline (single process; it runs ``perf_gate.BASELINE_ROUNDS_FACTOR`` times the rounds):
    pytest -m perf --benchmark-save=baseline
"""

import os
import sys

import pytest

from mlx_streaming.harness import perf_gate, perf_rounds
from mlx_streaming.harness.side_by_side import BaseUnavailable

pytestmark = pytest.mark.perf

#: A planted slowdown (CPU seconds per forward) for the gate's power study and tests: never the base revision's.
PLANT_ENV = "MLX_STREAMING_PLANT_S"


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


@pytest.fixture(scope="module")
def plant_s():
    value = os.environ.get(PLANT_ENV, "")
    if value:
        print(f"mlx-streaming: {PLANT_ENV}={value} from the environment (a planted slowdown)", file=sys.stderr)
    return float(value or 0)


@pytest.fixture(scope="module")
def yardstick(perf_yardstick, perf):
    """The yardstick round: greedy on mlx-lm's in-memory model, of this model where it fits (the prompt every
    scenario decodes), else of the embedded default model (``perf_rounds.Yardstick``)."""
    import mlx_lm

    model, _ = mlx_lm.load(perf_yardstick.model)
    return perf_rounds.greedy_round(model, perf_yardstick.prompt, perf["tokens"])


@pytest.fixture
def run_scenario(benchmark, yardstick, perf_yardstick, model_dir, mtp_path, streaming_config, memory_plan, prompt_ids,
                 perf, plant_s, perf_base):
    """``run_scenario(name)``: ``benchmark.pedantic`` over the scenario's rounds on a newly built model, each after
    its yardstick round (and, side by side, after a round of the base revision's engine). Records each round's
    token costs and its yardstick's in the gate's unit, the wall seconds, the first timed round's work counters,
    and the slowdown the gate tolerates for this scenario."""
    built = []

    def run(name: str) -> None:
        scenario = perf_rounds.SCENARIOS[name]
        if scenario.pool == "full" and not memory_plan.fits:
            pytest.skip(f"{model_dir} does not fit in memory: the full-pool scenario (compute alone) needs every "
                        "expert resident")
        sm = perf_rounds.build(model_dir, mtp_path, streaming_config, scenario, plant_s)
        built.append(sm)
        if scenario.k > 1 and sm.mtp is None:
            pytest.skip(f"{sm.path} has no MTP head (mtp.safetensors): nothing to speculate with")
        rounds = perf_rounds.Rounds(sm, perf_rounds.scenario_round(sm, scenario, prompt_ids[0], perf["tokens"]),
                                    yardstick, perf["tokens"])
        timed, yard_costs, base = [], [], []

        def beside(call):
            try:
                return call()
            except BaseUnavailable as exc:
                perf_base.unavailable(str(exc))

        if perf_base.engine is not None:
            beside(lambda: perf_base.engine.scenario(name))
        rounds.warm_up()

        def setup():
            if perf_base.engine is not None:
                base.append(beside(perf_base.engine.round))
            yard_costs.append(rounds.yard())

        count, threshold = ((perf["disk_rounds"], perf_gate.DISK_THRESHOLD) if scenario.reads
                            else (perf["compute_rounds"], perf_gate.COMPUTE_THRESHOLD))
        benchmark.pedantic(lambda: timed.append(rounds.timed(counted=not timed)), setup=setup, rounds=count, iterations=1)
        benchmark.extra_info.update(
            unit=rounds.unit, costs=[r["costs"] for r in timed], yard_costs=yard_costs,
            wall_s_per_token=[r["wall"] for r in timed], tokens=perf["tokens"], counters=timed[0]["counters"],
            exact=list(scenario.exact), threshold=threshold, yardstick=perf_yardstick.label,
            pool_slots=sm.store.capacity)
        if perf_base.engine is not None and all(base):
            benchmark.extra_info["base"] = {"costs": [r["costs"] for r in base],
                                            "yard_costs": [r["yard_costs"] for r in base],
                                            "counters": base[0]["counters"]}

    yield run
    for sm in built:
        sm.close()


def test_greedy_full_pool(run_scenario):
    run_scenario("greedy_full_pool")


def test_greedy_quarter_pool_direct(run_scenario):
    run_scenario("greedy_quarter_pool_direct")


def test_greedy_quarter_pool_prefetch(run_scenario):
    """Prefetch (ahead 1) at the 25% pool in direct mode."""
    run_scenario("greedy_quarter_pool_prefetch")


def test_speculative_k3(run_scenario):
    """K=3, direct commit, at the 25% pool in direct mode: one cost per token for each round."""
    run_scenario("speculative_k3")
