"""The perf gate: each rule, each work counter's definition, and the gate biting end to end on a real scenario.

Rounds here are synthetic where the rule is the point (seeded normal noise around a cost per token), real
where the engine is: the counters come from a real store, and the end-to-end test runs a perf scenario under
pytest (a subprocess, single process as pytest-benchmark needs) with a slowdown planted in the decode path.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from mlx_streaming.harness import perf_gate, perf_rounds
from mlx_streaming.config import StreamingConfig
from mlx_streaming.decode.greedy import greedy_generate
from mlx_streaming.model import build_streaming_model


def _rounds(median, cv, n=20, seed=0):
    return list(median * (1 + cv * np.random.default_rng(seed).standard_normal(n)))


def _info(costs, yard_costs=None, unit="cpu_s_per_token", **counters):
    yard_costs = _rounds(0.1, 0.03, n=len(costs), seed=99) if yard_costs is None else yard_costs
    return {"unit": unit, "costs": costs, "yard_costs": yard_costs,
            "counters": {"routed": 100.0, "host_syncs": 9.0, **counters}, "exact": ["routed", "host_syncs"]}


BASE = {"greedy": _info(_rounds(0.1, 0.03, seed=1), _rounds(0.1, 0.03, seed=51))}


def _failed(current, baseline=BASE, same=True, threshold=0.05):
    why_not = None if same else "another machine profile"
    return [(r.check, r.detail) for r in perf_gate.check(current, baseline, why_not, threshold) if r.fail]


def test_an_unchanged_run_passes():
    assert _failed({"greedy": _info(_rounds(0.1, 0.03, seed=2), _rounds(0.1, 0.03, seed=52))}) == []


def test_a_clear_ten_percent_slowdown_fails_and_three_percent_does_not():
    (fail,) = _failed({"greedy": _info(_rounds(0.11, 0.03, seed=3), _rounds(0.1, 0.03, seed=53))})
    assert fail[0] == "cpu_s_per_token (p25)" and fail[1].startswith("stored, relative to the yardstick x1.")
    assert _failed({"greedy": _info(_rounds(0.103, 0.03, seed=4), _rounds(0.1, 0.03, seed=54))}) == []


def test_spikes_above_the_floor_do_not_fail_an_unchanged_run():
    """CPU time here is a floor with spikes above it: a fifth of the rounds 30% slower leaves the p25 alone."""
    spiky = _rounds(0.1, 0.02, seed=5)
    for i in range(0, len(spiky), 5):
        spiky[i] *= 1.3
    assert _failed({"greedy": _info(spiky, _rounds(0.1, 0.03, seed=55))}) == []


def test_a_slowdown_the_noise_cannot_show_passes_and_says_what_it_could_catch():
    noisy_base = {"greedy": _info(_rounds(0.1, 0.4, seed=6), _rounds(0.1, 0.03, seed=56))}
    current = _info(_rounds(0.11, 0.4, seed=7), _rounds(0.1, 0.03, seed=57))
    (cost,) = [r for r in perf_gate.check({"greedy": current}, noisy_base, None, 0.05) if r.check.startswith("cpu")]
    assert not cost.fail and "catches >= " in cost.detail
    verdict = perf_gate.slowdown_verdict((noisy_base["greedy"]["costs"], noisy_base["greedy"]["yard_costs"]),
                                         (current["costs"], current["yard_costs"]), 0.05)
    assert verdict["detectable"] > 0.10


def test_improvements_pass():
    assert _failed({"greedy": _info(_rounds(0.05, 0.03, seed=8))}) == []


def test_any_exact_counter_change_fails_even_a_smaller_one():
    fails = _failed({"greedy": _info(_rounds(0.1, 0.03, seed=2), _rounds(0.1, 0.03, seed=52), host_syncs=10.0,
                                     routed=99.0)})
    assert sorted(check for check, _ in fails) == ["host_syncs/token", "routed/token"]


def test_counters_of_another_pool_are_not_compared_and_the_line_says_how_to_pin_it():
    """A memory budget derived from what is free may give a baseline one pool and a later run another: their
    counters cannot match, so the gate names the pools and the option instead of failing every counter."""
    base = {"greedy": {**BASE["greedy"], "pool_slots": 27}}
    same_pool = _info(_rounds(0.1, 0.03, seed=2), _rounds(0.1, 0.03, seed=52), host_syncs=10.0)
    assert [check for check, _ in _failed({"greedy": {**same_pool, "pool_slots": 27}}, base)] == ["host_syncs/token"]
    fails = _failed({"greedy": {**same_pool, "pool_slots": 28}}, base)
    assert fails == [("pool_slots", "the work counters compare only at the baseline's pool: pin it with "
                                    "--streaming-pool-slots=27")]


def test_costs_are_compared_only_in_one_unit_on_one_machine_profile_and_with_yardstick_rounds():
    slow = {"greedy": _info(_rounds(0.2, 0.03))}
    assert _failed(slow) != [] and _failed(slow, same=False) == []
    wall = {"greedy": _info(_rounds(0.2, 0.03), unit="wall_s_per_token")}
    rows = perf_gate.check(wall, BASE, None, 0.05)
    assert not any(r.fail for r in rows) and any("units differ" in r.detail for r in rows)
    unpaired = {"greedy": {**slow["greedy"], "yard_costs": []}}  # a baseline of the earlier format has none
    rows = perf_gate.check(unpaired, BASE, None, 0.05)
    assert not any(r.fail for r in rows) and any("not compared" in r.detail for r in rows)


def test_a_machine_that_slowed_as_a_whole_passes_and_the_engine_slower_than_it_fails():
    """Measured: an unchanged tree's every scenario, mlx-lm's in-memory one too, cost x1.33 one hour after its
    baseline on this machine. Relative to the yardstick rounds that is x1.0, and the row reports the drift; an
    engine 10% slower than the yardstick's own drift still fails."""
    drifted = {"greedy": _info(_rounds(0.133, 0.03, seed=20), _rounds(0.133, 0.03, seed=60))}
    assert _failed(drifted) == []
    (row,) = [r for r in perf_gate.check(drifted, BASE, None, 0.05) if r.check.startswith("cpu")]
    assert "machine drift x1.3" in row.detail
    slower = {"greedy": _info(_rounds(0.133 * 1.1, 0.03, seed=30), _rounds(0.133, 0.03, seed=70))}
    (fail,) = _failed(slower)
    assert fail[1].startswith("stored, relative to the yardstick x1.")


def _token_rounds(cost, cv, seed, n=20, tokens=10):
    return (cost * (1 + cv * np.random.default_rng(seed).standard_normal((n, tokens)))).tolist()


def _scenario(slowdown, seed, threshold):
    info = _info(_token_rounds(0.1 * slowdown, 0.05, seed), _token_rounds(0.1, 0.05, seed + 1))
    return {**info, "threshold": threshold}


def test_each_scenario_is_judged_at_the_threshold_of_its_kind():
    """+10% fails the compute scenario (+5%) and passes one that reads from disk (+30%); +40% fails both."""
    kinds = {"compute": perf_gate.COMPUTE_THRESHOLD, "disk": perf_gate.DISK_THRESHOLD}
    base = {name: _scenario(1.0, 10 * n, t) for n, (name, t) in enumerate(kinds.items())}

    def failing(slowdown):
        now = {name: _scenario(slowdown, 30 + 10 * n, t) for n, (name, t) in enumerate(kinds.items())}
        return [r.scenario for r in perf_gate.check(now, base) if r.fail]

    assert failing(1.0) == [] and failing(1.1) == ["compute"] and failing(1.4) == ["compute", "disk"]


def test_the_cost_is_a_low_percentile_of_every_token_over_the_yardstick_tokens():
    costs = [[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]]
    yard = [[1.0] * 4, [2.0] * 4]
    assert perf_gate.relative_cost(costs, yard) == np.percentile(range(1, 9), 25) / 1.0
    assert perf_gate.as_rounds([0.1, 0.2]).shape == (2, 1)  # a baseline of one cost per round


def test_token_costs_leave_out_the_prefill_step_and_the_last(monkeypatch):
    ticks = iter([0.0, 5.0, 6.0, 7.5, 8.0])  # start, then after each of 4 tokens
    monkeypatch.setattr(perf_rounds, "clock", lambda unit: lambda: next(ticks))
    costs, wall = perf_rounds.token_costs(iter(range(4)), "cpu_s_per_token")
    assert costs == [1.0, 1.5] and wall > 0


def test_a_planted_slowdown_burns_its_seconds_on_the_decoding_thread(model_dir):
    """Injected from outside the engine, through the miss guard's forward hooks."""
    import time

    with build_streaming_model(model_dir) as sm:
        planted = perf_rounds.PlantedSlowdown(sm, 0.05)
        start = time.thread_time()
        sm.store.guard.run(1, lambda: None, lambda: None)  # a forward that computes nothing: its hooks alone
        assert 0.05 <= time.thread_time() - start < 0.1
        planted.seconds = 0.0
        start = time.thread_time()
        sm.store.guard.run(1, lambda: None, lambda: None)
        assert time.thread_time() - start < 0.01


def test_a_scenario_without_baseline_is_reported_not_failed():
    (row,) = perf_gate.check({"new": _info([0.1] * 5)}, BASE, None, 0.05)
    assert not row.fail and "no baseline" in row.detail


def test_the_power_study_simulation_counts_failing_gate_runs():
    from mlx_streaming.harness import gate_power

    base = {"a": (_rounds(0.1, 0.03, seed=80), _rounds(0.1, 0.03, seed=81))}
    same = {"a": (_rounds(0.1, 0.03, seed=82), _rounds(0.1, 0.03, seed=83))}
    slow = {"a": (_rounds(0.13, 0.03, seed=84), _rounds(0.1, 0.03, seed=85))}
    for drawn in (20, None):  # a baseline drawn as a recording would be, or taken as it is, as a gate run takes it
        assert gate_power.simulate(base, slow, {"a": (drawn, 20)}, 30, {"a": 0.05}) == (1.0, {"a": 1.0})
        rate, _ = gate_power.simulate(base, same, {"a": (drawn, 20)}, 30, {"a": 0.05})
        assert rate < 0.2


def test_the_power_study_replays_against_a_baseline_the_suite_saved():
    from mlx_streaming.harness import gate_power

    def pool(median, seed):
        return ([_rounds(median, 0.03, n=4, seed=seed + i) for i in range(30)],
                [_rounds(0.1, 0.03, n=4, seed=seed + 50 + i) for i in range(30)])

    recorded = {"unit": "cpu_s_per_token", "cost_per_token": {s: 0.1 for s in gate_power.SCENARIOS}, "tokens": 4,
                "baseline": {s: pool(0.1, 0) for s in gate_power.SCENARIOS},
                "pools": {"quiet +0%": {s: pool(0.1, 100) for s in gate_power.SCENARIOS},
                          "quiet +50%": {s: pool(0.15, 200) for s in gate_power.SCENARIOS}}}
    saved = {"benchmarks": [{"name": test, "extra_info": {"unit": "cpu_s_per_token", "costs": pool(0.1, 300)[0],
                                                            "yard_costs": pool(0.1, 300)[1]}}
                            for test in gate_power.SUITE_TESTS.values()]}
    against = gate_power.suite_baseline(saved)
    assert against["unit"] == "cpu_s_per_token" and set(against["pools"]) == set(gate_power.SCENARIOS)
    assert against["yardstick"] == "mlx-lm in memory, this model"  # what a baseline without the label was measured by
    report = gate_power.replay(recorded, runs=20, baseline=against)
    assert [r["fail_rate"] for r in report["rows"]] == [0.0, 1.0]
    assert "all 30 baseline rounds" in gate_power.table(report)
    own = gate_power.replay(recorded, runs=20)  # the study's own pool: drawn as a recording, at most its size
    assert all(own["rounds"][s][0] == min(gate_power.BASELINE_ROUNDS[s], 30) for s in gate_power.SCENARIOS)
    # on a model that does not fit, the suite skips the full pool: the 25% scenario's rounds alone
    assert list(gate_power.suite_baseline({"benchmarks": saved["benchmarks"][1:]})["pools"]) == [gate_power.SCENARIOS[1]]
    with pytest.raises(ValueError, match="test_greedy_full_pool or test_greedy_quarter_pool_direct"):
        gate_power.suite_baseline({"benchmarks": []})


def test_the_power_study_replays_each_yardstick_and_a_suite_baseline_against_its_own():
    from mlx_streaming.harness import gate_power
    from mlx_streaming.harness.perf_rounds import EMBEDDED_YARDSTICK, OWN_YARDSTICK

    def pool(median, seed, yard=0.1):
        return ([_rounds(median, 0.03, n=4, seed=seed + i) for i in range(30)],
                [_rounds(yard, 0.03, n=4, seed=seed + 50 + i) for i in range(30)])

    def study(slow_yardstick):  # the same scenario rounds; a yardstick slowed in the +0% pool would hide nothing
        return {"baseline": {s: pool(0.1, 0) for s in gate_power.SCENARIOS},
                "pools": {"busy +0%": {s: pool(0.2, 100, yard=0.2 if slow_yardstick else 0.1)
                                       for s in gate_power.SCENARIOS}}}

    recorded = {"unit": "cpu_s_per_token", "cost_per_token": {s: 0.1 for s in gate_power.SCENARIOS}, "tokens": 4,
                "yardsticks": {OWN_YARDSTICK: study(True), EMBEDDED_YARDSTICK: study(False)}}
    report = gate_power.replay(recorded, runs=20)
    rates = {label: [r["fail_rate"] for r in one["rows"]] for label, one in report["yardsticks"].items()}
    assert rates == {OWN_YARDSTICK: [0.0], EMBEDDED_YARDSTICK: [1.0]}  # drift cancelled by one, not the other
    table = gate_power.table(report)
    assert f"yardstick: {OWN_YARDSTICK}\n" in table and f"yardstick: {EMBEDDED_YARDSTICK}\n" in table
    saved = {"unit": "cpu_s_per_token", "pools": {s: pool(0.1, 300) for s in gate_power.SCENARIOS},
             "yardstick": f"{EMBEDDED_YARDSTICK} (this model does not fit in memory)"}
    assert list(gate_power.replay(recorded, runs=20, baseline=saved)["yardsticks"]) == [EMBEDDED_YARDSTICK]
    with pytest.raises(ValueError, match="measured against the yardstick"):
        gate_power.replay({**recorded, "yardsticks": {OWN_YARDSTICK: study(True)}}, runs=20, baseline=saved)


def test_the_side_by_side_power_study_draws_each_pool_against_the_base_recorded_beside_it():
    from mlx_streaming.harness import gate_power

    def pool(median, seed, n=30):
        return ([_rounds(median, 0.03, n=4, seed=seed + i) for i in range(n)],
                [_rounds(0.1, 0.03, n=4, seed=seed + 50 + i) for i in range(n)])

    recorded = {"unit": "cpu_s_per_token", "cost_per_token": {s: 0.1 for s in gate_power.SCENARIOS}, "tokens": 4,
                "base_revision": "f" * 40,
                "pools": {"busy +0%": {s: pool(0.2, 100) for s in gate_power.SCENARIOS},
                          "busy +50%": {s: pool(0.15, 200) for s in gate_power.SCENARIOS}},
                # the busy +0% pool's base ran as slow as it did (a slow phase): side by side, no alarm
                "bases": {"busy +0%": {s: pool(0.2, 300) for s in gate_power.SCENARIOS},
                          "busy +50%": {s: pool(0.1, 400) for s in gate_power.SCENARIOS}}}
    report = gate_power.replay(recorded, runs=20)
    assert [r["fail_rate"] for r in report["rows"]] == [0.0, 1.0]
    assert report["rounds"] == {s: (gate_power.ROUNDS[s],) * 2 for s in gate_power.SCENARIOS}
    assert "side by side" in gate_power.table(report)


def test_machine_profile_ignores_what_does_not_matter():
    a = {"cpu": {"brand_raw": "X", "count": 2}, "system": "Linux", "mlx_version": "0.32.4", "node": "host-a"}
    assert perf_gate.machine_profile(a) == perf_gate.machine_profile({**a, "node": "host-b"})
    assert perf_gate.machine_profile(a) != perf_gate.machine_profile({**a, "mlx_version": "0.33.0"})


@pytest.mark.parametrize("prefetch", [False, True])
def test_each_work_counter_has_its_one_definition(model_dir, prompt_ids, prefetch):
    config = StreamingConfig(pool_slots=12, io_mode="direct", prefetch=prefetch, verify=True, miss_check="layer")
    with build_streaming_model(model_dir, config) as sm:
        greedy_generate(sm.model, prompt_ids[0], 8)
        s, reads = sm.store.stats(), sm.store.reader.reads
        c = perf_rounds.work_counters(s, reads, 8)
        moe_layer_calls = s["fastpath"] + s["fallback"]
    size = sm.store.index.expert_bytes
    assert set(c) == set(perf_rounds.WORK_COUNTERS)
    assert c["routed"] * 8 == s["hits"] + s["misses"] and c["experts_placed"] * 8 == s["misses"] > 0
    assert c["bytes_read"] * 8 == (s["demand_loads"] + s.get("prefetch_loads", 0)) * size
    assert c["verify_calls"] == c["experts_placed"]
    assert c["read_calls"] * 8 >= s["demand_loads"] + s.get("prefetch_loads", 0)  # one read per tensor or more
    # per MoE layer call one sync for its routes, plus one per load's pool writes (and per prediction)
    assert c["host_syncs"] * 8 > moe_layer_calls


def _run_perf(root, storage, *extra, plant=0.0, rounds=5):
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-m", "perf", "-p", "no:xdist", "-q",
         "perf/test_perf.py::test_greedy_quarter_pool_direct",
         "--streaming-perf-tokens", "4", "--streaming-perf-disk-rounds", str(rounds),
         f"--benchmark-storage=file://{storage}", *extra],
        capture_output=True, text=True, timeout=600, cwd=root,
        # inside an xdist worker: pytest-benchmark would see the worker's variables and disable itself
        env={**{k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")},
             "MLX_STREAMING_PLANT_S": str(plant)},
    )


def test_gate_fails_a_planted_slowdown_and_a_moved_counter_and_passes_otherwise(tmp_path, pytestconfig):
    root = pytestconfig.rootpath
    recorded = _run_perf(root, tmp_path, "--benchmark-save=base")
    assert recorded.returncode == 0, recorded.stdout + recorded.stderr
    (saved,) = tmp_path.rglob("*_base.json")

    def engine_info(data):
        (bench,) = [b for b in data["benchmarks"] if b["name"] == "test_greedy_quarter_pool_direct"]
        return bench["extra_info"]

    # a recorded baseline runs more rounds than a compared run: its noise is in every verdict
    assert len(engine_info(json.loads(saved.read_text()))["costs"]) == perf_gate.BASELINE_ROUNDS_FACTOR * 5

    cost = float(np.median(engine_info(json.loads(saved.read_text()))["costs"]))
    # about +200% per token in the engine's decode path (the yardstick rounds, mlx-lm's own model, are not slowed)
    slowed = _run_perf(root, tmp_path, "--benchmark-compare=0001", plant=2 * cost)
    assert slowed.returncode == 1, slowed.stdout
    assert "PERF GATE FAILED" in slowed.stdout and "relative to the yardstick" in slowed.stdout

    # side by side: the base revision's engine (HEAD, exported and built apart) measured round for round beside
    # the current tree; the plant slows only the current tree's engine
    beside = _run_perf(root, tmp_path, "--benchmark-compare=0001", "--streaming-perf-base", "HEAD", plant=2 * cost,
                       rounds=3)
    assert beside.returncode == 1, beside.stdout
    assert "mode: side by side: base revision HEAD" in beside.stdout and "side by side, relative to" in beside.stdout
    # a base that cannot be measured: one line, and the counters judged alone
    absent = _run_perf(root, tmp_path, "--benchmark-compare=0001", "--streaming-perf-base", "0" * 12, rounds=2)
    assert absent.returncode == 0, absent.stdout
    assert f"mode: counters only: base revision {'0' * 12} is not in the history" in absent.stdout
    assert "host_syncs/token" in absent.stdout and "no base revision measured beside it: not compared" in absent.stdout

    data = json.loads(saved.read_text())
    engine_info(data)["counters"]["host_syncs"] -= 1.0  # the baseline synced less
    saved.write_text(json.dumps(data))
    moved = _run_perf(root, tmp_path, "--benchmark-compare=0001")
    assert moved.returncode == 1 and "host_syncs/token" in moved.stdout, moved.stdout


def test_perf_run_under_xdist_says_so_instead_of_recording_nothing(pytestconfig):
    done = subprocess.run([sys.executable, "-m", "pytest", "-m", "perf", "-n", "2", "-q", "perf"], capture_output=True,
                          text=True, timeout=300, cwd=pytestconfig.rootpath,
                          env={k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")})
    assert done.returncode == pytest.ExitCode.USAGE_ERROR
    assert "perf tests need a single process" in done.stderr
