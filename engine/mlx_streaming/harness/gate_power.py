"""The perf gate's power study: how often it catches planted slowdowns, and how often it fails an unchanged
tree, quiet and with two busy-loop processes beside it (``mlx-streaming bench --gate-power``).

Two of the perf suite's scenarios, greedy at the full pool (preloaded: compute alone) and greedy at a 25% pool
with O_DIRECT, are measured as the suite measures them: rounds of ``tokens`` tokens, each scenario round just
after its own yardstick round (greedy on mlx-lm's in-memory model), each token's cost in the gate's unit. A pool
of round pairs is recorded per scenario, as many as the suite runs (``ROUNDS``; a baseline pool, as many as the
suite records, ``BASELINE_ROUNDS``): the baseline pool on the quiet machine, then for each condition (quiet, busy) an unchanged pool and one pool per planted slowdown (``fraction``
x the scenario's baseline cost per token, CPU time of the decoding thread burnt at the start of every forward:
one forward per greedy token). Gate runs are then simulated: each draws as many round pairs with replacement from
the baseline pool and from the condition's pool as the suite records and compares, per scenario, and applies ``perf_gate.slowdown_verdict`` at the
scenario's threshold in the suite (``THRESHOLDS``); a run fails when either scenario fails. The failing share is
the catch rate (for an unchanged pool, the false-alarm rate). ``replay`` simulates recorded pools again (``bench
--gate-power --json FILE`` keeps them) under the current rule, without measuring anew, against their own baseline
pool or against a baseline the suite recorded (``suite_baseline``): one recorded in another process at another
time, as every real gate run's is.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Dict, Optional, Tuple

import numpy as np

from . import perf_gate, perf_rounds
from ..config import StreamingConfig
from ..checkpoint import MTP_FILE
from ..decode.greedy import greedy_generate, greedy_steps
from ..defaults import default_model
from ..plan import auto_memory_budget

FRACTIONS = (0.05, 0.10, 0.20)
SCENARIOS = ("full pool", "25% pool, O_DIRECT")
#: Each scenario's threshold and rounds, as the perf suite runs and judges its twin (``perf/test_perf.py``).
THRESHOLDS = dict(zip(SCENARIOS, (perf_gate.COMPUTE_THRESHOLD, perf_gate.DISK_THRESHOLD)))
ROUNDS = dict(zip(SCENARIOS, (perf_gate.COMPUTE_ROUNDS, perf_gate.DISK_ROUNDS)))
BASELINE_ROUNDS = {scenario: perf_gate.BASELINE_ROUNDS_FACTOR * n for scenario, n in ROUNDS.items()}
#: Each scenario's twin in the perf suite (``perf_rounds.SCENARIOS``), and its test's name in a baseline.
SUITE_SCENARIOS = dict(zip(SCENARIOS, ("greedy_full_pool", "greedy_quarter_pool_direct")))
SUITE_TESTS = {scenario: f"test_{name}" for scenario, name in SUITE_SCENARIOS.items()}
#: Tokens per round, unless ``--max-tokens`` says otherwise (the suite's ``--streaming-perf-tokens``).
TOKENS = 16


def _say(text: str) -> None:
    print(f"[gate-power] {text}", file=sys.stderr, flush=True)


def _busy_neighbours(n: int) -> list:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def _record(models: Dict, yardsticks: Dict, prompt, tokens: int, rounds: Dict[str, int], plants: Dict[str, float],
            unit: str) -> Dict:
    """``rounds[scenario]`` rounds per scenario, each just after a round of every yardstick (in turn first and
    last, so neither is always the nearer), ``plants[scenario]`` CPU seconds burnt per forward of that scenario's
    model; the scenarios' rounds interleaved while each has rounds left. Per yardstick, per scenario: (the
    scenario's rounds' token costs, that yardstick's rounds' token costs)."""
    pairs = {label: {scenario: ([], []) for scenario in models} for label in yardsticks}
    planted = [perf_rounds.PlantedSlowdown(sm, plants.get(scenario, 0.0)) for scenario, sm in models.items()]
    try:
        for n in range(max(rounds.values())):
            for scenario, sm in models.items():
                if n >= rounds[scenario]:
                    continue
                for label in (list(yardsticks) if n % 2 == 0 else list(yardsticks)[::-1]):
                    pairs[label][scenario][1].append(yardsticks[label](unit)[0])
                costs = perf_rounds.token_costs(greedy_steps(sm.model, prompt, tokens), unit)[0]
                for label in yardsticks:
                    pairs[label][scenario][0].append(costs)
    finally:
        for plant in planted:
            plant.remove()
    return pairs


def simulate(baseline: Dict[str, Tuple], current: Dict[str, Tuple], rounds: Dict[str, Tuple[Optional[int], int]],
             runs: int, thresholds: Dict[str, float], seed: int = 0) -> Tuple[float, Dict[str, float]]:
    """The share of ``runs`` simulated gate runs that fail (any scenario failing), and each scenario's own
    failing share. Each run draws ``rounds[scenario]`` (baseline, current) round pairs with replacement from the
    baseline pool and the current pool; a baseline count of None takes the baseline as it is, as a gate run
    takes the baseline it is given."""
    rng = np.random.default_rng(seed)
    fails, by_check = 0, dict.fromkeys(baseline, 0)
    for run in range(runs):
        verdicts = {}
        for scenario in baseline:
            drawn = []
            for (costs, yard), n in zip((baseline[scenario], current[scenario]), rounds[scenario]):
                picks = rng.integers(0, len(costs), n) if n else slice(None)
                drawn.append((perf_gate.as_rounds(costs)[picks], perf_gate.as_rounds(yard)[picks]))
            verdicts[scenario] = perf_gate.slowdown_verdict(*drawn, thresholds[scenario], seed=run)["fail"]
        for check, failed in verdicts.items():
            by_check[check] += failed
        fails += any(verdicts.values())
    return fails / runs, {check: count / runs for check, count in by_check.items()}


def study(model_dir: Path, config: StreamingConfig, prompt_text: str, tokens: int = TOKENS, runs: int = 300) -> Dict:
    """Where mlx-lm's in-memory model and a full pool fit beside each other, both scenarios, each round after a
    round of each yardstick the gate can take: mlx-lm's in-memory decode of this model (the gate's where the model
    fits) and of the embedded default model (the gate's where it does not), so that one recording says whether the
    second cancels the machine's drift as well as the first. Where they do not fit, the 25% scenario alone, in
    the pool the memory budget leaves, against the embedded model."""
    import mlx_lm

    from .reference import InMemoryPlan

    unit = perf_rounds.cost_unit()
    prompt = _prompt(model_dir, prompt_text)
    fits = InMemoryPlan(model_dir, workers=2).fits  # two shares: the in-memory model, and the full pool's experts
    chosen = [perf_rounds.Yardstick.choose(model_dir, prompt, fits)]
    if fits and Path(model_dir).resolve() != default_model().resolve():
        chosen.append(perf_rounds.Yardstick.embedded())
    yardsticks = {y.label: perf_rounds.greedy_round(mlx_lm.load(y.model)[0], y.prompt, tokens) for y in chosen}
    scenarios = SCENARIOS if fits else SCENARIOS[1:]
    if not fits and config.memory_budget is None and config.pool_slots is None:
        config = config.replace(memory_budget=auto_memory_budget())
    mtp_path = Path(model_dir) / MTP_FILE
    models = {s: perf_rounds.build(model_dir, mtp_path, config, perf_rounds.SCENARIOS[SUITE_SCENARIOS[s]])
              for s in scenarios}
    rounds = {s: ROUNDS[s] for s in scenarios}
    baseline_rounds = {s: BASELINE_ROUNDS[s] for s in scenarios}
    sizes = ", ".join(f"{scenario} {n}" for scenario, n in rounds.items())
    _say("yardsticks: " + "; ".join(yardsticks))
    try:
        for sm in models.values():
            greedy_generate(sm.model, prompt, tokens)  # warm-up
        for yardstick in yardsticks.values():
            yardstick(unit)
        _say("baseline pools, quiet: round pairs " + ", ".join(f"{s} {n}" for s, n in baseline_rounds.items()))
        baseline = _record(models, yardsticks, prompt, tokens, baseline_rounds, {}, unit)
        first = next(iter(baseline.values()))
        cost = {s: float(np.percentile(c, perf_gate.QUANTILE)) for s, (c, _) in first.items()}
        pools = {label: {} for label in yardsticks}
        for condition in ("quiet", "busy"):
            neighbours = _busy_neighbours(2) if condition == "busy" else []
            try:
                for fraction in (0.0,) + FRACTIONS:
                    _say(f"{condition}, planted +{fraction:.0%}: round pairs {sizes}")
                    plants = {s: fraction * c for s, c in cost.items()}
                    recorded = _record(models, yardsticks, prompt, tokens, rounds, plants, unit)
                    for label, pairs in recorded.items():
                        pools[label][f"{condition} +{fraction:.0%}"] = pairs
            finally:
                for p in neighbours:
                    p.kill()
    finally:
        for sm in models.values():
            sm.close()
    common = {"unit": unit, "cost_per_token": cost, "tokens": tokens}
    return replay({**common, "yardsticks": {label: {"yardstick": label, "baseline": baseline[label],
                                                    "pools": pools[label]} for label in yardsticks}}, runs)


#: The side-by-side study's planted slowdowns (what its verdict needs: no false alarm, 10% and 20% caught).
SIDE_BY_SIDE_FRACTIONS = (0.10, 0.20)


def side_by_side_study(repo: Path, rev: str, model_dir: Path, config: StreamingConfig, prompt_text: str,
                       tokens: int = 16, runs: int = 300) -> Dict:
    """The power study of the side-by-side gate, measured as the gate measures: base revision ``rev``'s engine in
    its worker (``side_by_side.BaseEngine``), the current tree's in this process, each round after its own
    yardstick round, base and current alternating round by round. Per condition (quiet, busy) and per planted
    fraction (0 and ``SIDE_BY_SIDE_FRACTIONS`` of the scenario's cost per token, burnt only in the current tree's
    engine), a pool of ``ROUNDS`` base rounds and as many current rounds, recorded interleaved; the simulated gate
    runs then draw ``ROUNDS`` of each from them (``replay``)."""
    import mlx_lm

    from .reference import InMemoryPlan
    from .side_by_side import BaseEngine

    unit = perf_rounds.cost_unit()
    mtp_path = Path(model_dir) / MTP_FILE
    engine_config = {"io_mode": config.io_mode, "pool_slots": config.pool_slots}
    fractions = (0.0,) + SIDE_BY_SIDE_FRACTIONS
    pools = {f"{c} +{f:.0%}": {} for c in ("quiet", "busy") for f in fractions}
    bases = {name: {} for name in pools}
    cost = {}
    prompt = _prompt(model_dir, prompt_text)
    chosen = perf_rounds.Yardstick.choose(model_dir, prompt, InMemoryPlan(model_dir).fits)
    reference, _ = mlx_lm.load(chosen.model)
    with BaseEngine(repo, rev, model_dir, mtp_path, prompt, tokens, engine_config, chosen.as_dict()) as base:
        yardstick = perf_rounds.greedy_round(reference, chosen.prompt, tokens)
        for scenario, name in SUITE_SCENARIOS.items():
            definition = perf_rounds.SCENARIOS[name]
            sm = perf_rounds.build(model_dir, mtp_path, config, definition)
            planted = perf_rounds.PlantedSlowdown(sm)
            try:
                rounds = perf_rounds.Rounds(sm, perf_rounds.scenario_round(sm, definition, prompt, tokens),
                                            yardstick, tokens)
                base.scenario(name)
                rounds.warm_up()
                cost[scenario] = float(np.percentile([rounds.timed(False)["costs"] for _ in range(3)],
                                                     perf_gate.QUANTILE))
                for condition in ("quiet", "busy"):
                    neighbours = _busy_neighbours(2) if condition == "busy" else []
                    try:
                        _say(f"{scenario}, {condition}: {ROUNDS[scenario]} rounds of base and current per "
                             f"planted fraction {', '.join(f'+{f:.0%}' for f in fractions)}, alternating")
                        for _ in range(ROUNDS[scenario]):
                            for fraction in fractions:
                                key = f"{condition} +{fraction:.0%}"
                                b = base.round()
                                planted.seconds = fraction * cost[scenario]
                                yard = rounds.yard()
                                now = rounds.timed(False)["costs"]
                                planted.seconds = 0.0
                                for into, pair in ((bases, (b["costs"], b["yard_costs"])), (pools, (now, yard))):
                                    costs, yards = into[key].setdefault(scenario, ([], []))
                                    costs.append(pair[0])
                                    yards.append(pair[1])
                    finally:
                        for p in neighbours:
                            p.kill()
            finally:
                sm.close()
        commit = base.commit
    recorded = {"unit": unit, "cost_per_token": cost, "tokens": tokens, "pools": pools, "bases": bases,
                "base_revision": commit, "yardstick": chosen.label}
    return replay(recorded, runs)


def _prompt(model_dir: Path, text: str) -> list:
    from mlx_lm.utils import load_tokenizer

    return load_tokenizer(Path(model_dir)).encode(text)


def suite_baseline(saved: Dict) -> Dict:
    """Each scenario's (costs, yardstick costs) rounds from a baseline the perf suite saved (pytest-benchmark's
    JSON, ``baselines/<machine>/NNNN_baseline.json``), with their unit and yardstick; the scenarios the suite ran
    (on a model that does not fit, the full pool's is skipped). Raises ``ValueError`` naming what is missing."""
    infos = {bench.get("name"): bench.get("extra_info", {}) for bench in saved.get("benchmarks", [])}
    infos = {scenario: infos.get(test, {}) for scenario, test in SUITE_TESTS.items()}
    pools = {scenario: (info["costs"], info["yard_costs"]) for scenario, info in infos.items()
             if info.get("costs") and info.get("yard_costs")}
    if not pools:
        raise ValueError(f"no {' or '.join(SUITE_TESTS.values())} rounds with their yardstick rounds")
    units = {infos[s].get("unit") for s in pools}
    yardsticks = {infos[s].get("yardstick", perf_rounds.OWN_YARDSTICK) for s in pools}
    return {"unit": units.pop() if len(units) == 1 else None, "pools": pools,
            "yardstick": yardsticks.pop() if len(yardsticks) == 1 else None}


def replay(recorded: Dict, runs: int = 300, baseline: Dict = None) -> Dict:
    """Simulated gate runs on recorded pools (a study's report, or its JSON) under the current rule, per
    yardstick where the study measured several (``_replay_one``); against a baseline the suite recorded, only
    the yardstick that baseline was measured against."""
    if "yardsticks" not in recorded:
        return _replay_one(recorded, runs, baseline and baseline["pools"])
    common = {key: recorded[key] for key in ("unit", "cost_per_token", "tokens")}
    kind = perf_rounds.Yardstick.kind
    replays = {label: _replay_one({**common, **one}, runs, baseline and baseline["pools"])
               for label, one in recorded["yardsticks"].items()
               if baseline is None or kind(label) == kind(baseline["yardstick"] or "")}
    if not replays:
        raise ValueError(f"the suite's baseline was measured against the yardstick \"{baseline['yardstick']}\", "
                         f"the study's against {', '.join(repr(y) for y in recorded['yardsticks'])}")
    return {**common, "yardsticks": replays}


def _replay_one(recorded: Dict, runs: int, baseline: Optional[Dict]) -> Dict:
    """Each run draws as many round pairs per scenario as the suite compares (``ROUNDS``) from the condition's
    pool, and from the baseline pool as many as the suite records for a baseline (``BASELINE_ROUNDS``, at most the
    pool's size: drawing more than a pool holds would shrink its noise). A side-by-side study's pools each come
    with the base pool recorded beside them (``recorded["bases"]``), from which a run draws as many rounds as it
    compares, as the side-by-side gate measures. ``baseline``: a baseline the suite recorded
    (``suite_baseline``), taken as it is, as a gate run takes it, instead of the recorded baseline pool."""
    rows = []
    beside = "bases" in recorded
    for name, current in recorded["pools"].items():
        base = recorded["bases"][name] if beside else recorded["baseline"] if baseline is None else baseline
        scenarios = [s for s in SCENARIOS if s in current and s in base]
        if beside:
            drawn = {s: (ROUNDS[s], ROUNDS[s]) for s in scenarios}
        else:
            drawn = {s: (None if baseline is not None else min(BASELINE_ROUNDS[s], len(base[s][0])), ROUNDS[s])
                     for s in scenarios}
        condition, planted = name.split(" +")
        rate, by_check = simulate({s: base[s] for s in scenarios}, current, drawn, runs, THRESHOLDS)
        measured = {s: float(perf_gate.relative_cost(*map(perf_gate.as_rounds, current[s]))
                             / perf_gate.relative_cost(*map(perf_gate.as_rounds, base[s]))) for s in scenarios}
        rows.append({"condition": condition, "planted": float(planted.rstrip("%")) / 100, "fail_rate": rate,
                     "by_check": by_check, "measured_ratio": measured})
    keep = ("unit", "cost_per_token", "tokens", "baseline", "pools", "bases", "base_revision", "yardstick")
    if beside:
        against = f"base revision {recorded['base_revision'][:10]} measured beside each pool (side by side)"
    else:
        against = "the study's baseline pool" if baseline is None else "a baseline the suite recorded"
    return {**{key: recorded[key] for key in keep if key in recorded},
            "pool_rounds": {s: len(base[s][0]) for s in scenarios},
            "rounds": drawn, "runs": runs, "thresholds": THRESHOLDS, "quantile": perf_gate.QUANTILE,
            "against": against, "rows": rows}


def table(report: Dict) -> str:
    """The report's table, one per yardstick where the study measured several."""
    if "yardsticks" in report:
        return "\n\n".join(f"yardstick: {label}\n{_table_one(one)}" for label, one in report["yardsticks"].items())
    return _table_one(report)


def _table_one(report: Dict) -> str:
    from tabulate import tabulate

    scenarios = list(report["pool_rounds"])
    body = [[r["condition"], f"+{r['planted']:.0%}"]
            + [f"x{r['measured_ratio'][s]:.3f}" for s in scenarios]
            + [f"{r['by_check'][s]:.1%}" for s in scenarios]
            + [f"{r['fail_rate']:.1%}" + ("" if r["planted"] else " (false alarms)")] for r in report["rows"]]
    headers = (["condition", "planted"] + [f"measured, {s}" for s in scenarios] + [f"fails, {s}" for s in scenarios]
               + ["gate fails"])
    costs = ", ".join(f"{s} {c * 1000:.1f} ms" for s, c in report["cost_per_token"].items())
    def against(s):
        drawn, pool = report["rounds"][s][0], report["pool_rounds"][s]
        return f"all {pool} baseline rounds" if drawn is None else f"{drawn} drawn from a baseline pool of {pool}"

    per_scenario = "; ".join(f"{s}: {report['rounds'][s][1]} round pairs against {against(s)}, threshold "
                             f"+{report['thresholds'][s]:.0%}" for s in scenarios)
    return (tabulate(body, headers=headers)
            + f"\nunit {report['unit']}, p{report['quantile']} of token costs quiet: {costs}; {report['runs']} "
              f"simulated gate runs of {report['tokens']}-token rounds against {report['against']}; {per_scenario}")
