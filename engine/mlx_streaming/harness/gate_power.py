"""The perf gate's power study: how often it catches planted slowdowns, and how often it fails an unchanged
tree, quiet and with two busy-loop processes beside it (``mlx-streaming bench --gate-power``).

Two of the perf suite's scenarios, greedy at the full pool and greedy at a 25% pool with O_DIRECT, are
measured as the suite measures them: rounds of ``tokens`` tokens, each scenario round just after its own
yardstick round (greedy on mlx-lm's in-memory model), each token's cost in the gate's unit. Pools of ``pool_rounds``
round pairs are recorded per scenario: a baseline pool on the quiet machine, then for each condition (quiet,
busy) an unchanged pool and one pool per planted slowdown (``fraction`` x the scenario's baseline cost per
token, CPU time of the decoding thread burnt at the start of every forward: one forward per greedy token). Gate
runs are then simulated: each draws ``rounds`` pairs with replacement from the baseline pool and from the
condition's pool, per scenario, and applies the gate's rules: ``perf_gate.slowdown_verdict`` per scenario at its
threshold in the perf suite (``THRESHOLDS``), and ``perf_gate.combined_verdict`` on the suite's ``combined``
scenarios (``COMBINED_SCENARIOS``); a run fails when any of the three fails. The failing share is the catch rate (for an unchanged pool, the false-alarm
rate). ``replay`` simulates recorded pools again (``bench --gate-power --json FILE`` keeps them) under the
current rule, without measuring anew.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Dict, Tuple

import numpy as np

from . import perf_gate
from ..config import StreamingConfig
from ..generate import greedy_generate, greedy_steps

FRACTIONS = (0.05, 0.10, 0.20)
SCENARIOS = ("full pool", "25% pool, O_DIRECT")
COMBINED = "combined"
#: The scenarios the suite's combined row judges (``combined`` in ``perf/test_perf.py``).
COMBINED_SCENARIOS = ("full pool",)
#: Each scenario's threshold, as the perf suite judges its twin (``perf/test_perf.py``).
THRESHOLDS = dict(zip(SCENARIOS, (perf_gate.DEFAULT_THRESHOLD, perf_gate.DISK_THRESHOLD)))


def _say(text: str) -> None:
    print(f"[gate-power] {text}", file=sys.stderr, flush=True)


def _busy_neighbours(n: int) -> list:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def _record(models: Dict, reference, prompt, tokens: int, n: int, plants: Dict[str, float], unit: str) -> Dict:
    """``n`` round pairs (the scenario's token costs, its yardstick's) per scenario, ``plants[scenario]`` CPU
    seconds burnt per forward of that scenario's model."""

    def costs(model) -> list:
        return perf_gate.token_costs(greedy_steps(model, prompt, tokens), unit)[0]

    pairs = {scenario: ([], []) for scenario in models}
    for scenario, sm in models.items():
        sm.store.plant_s = plants.get(scenario, 0.0)
    for _ in range(n):
        for scenario, sm in models.items():
            pairs[scenario][1].append(costs(reference))
            pairs[scenario][0].append(costs(sm.model))
    for sm in models.values():
        sm.store.plant_s = 0.0
    return pairs


def simulate(baseline: Dict[str, Tuple], current: Dict[str, Tuple], rounds: int, runs: int,
             thresholds: Dict[str, float], seed: int = 0,
             combined: Tuple[str, ...] = COMBINED_SCENARIOS) -> Tuple[float, Dict[str, float]]:
    """The share of ``runs`` simulated gate runs that fail (any scenario or the combined row failing), and each
    check's own failing share (per scenario, and ``COMBINED``). Each run draws ``rounds`` round pairs with
    replacement from each pool."""
    rng = np.random.default_rng(seed)
    fails, by_check = 0, dict.fromkeys(list(baseline) + [COMBINED], 0)
    for run in range(runs):
        drawn = {}
        for scenario in baseline:
            drawn[scenario] = []
            for costs, yard in (baseline[scenario], current[scenario]):
                picks = rng.integers(0, len(costs), rounds)
                drawn[scenario].append((perf_gate.as_rounds(costs)[picks], perf_gate.as_rounds(yard)[picks]))
        verdicts = {scenario: perf_gate.slowdown_verdict(*pair, thresholds[scenario], seed=run)["fail"]
                    for scenario, pair in drawn.items()}
        verdicts[COMBINED] = perf_gate.combined_verdict([drawn[s] for s in combined], perf_gate.COMBINED_THRESHOLD,
                                                        seed=run)["fail"]
        for check, failed in verdicts.items():
            by_check[check] += failed
        fails += any(verdicts.values())
    return fails / runs, {check: count / runs for check, count in by_check.items()}


def study(model_dir: Path, config: StreamingConfig, pool_rounds: int = 20, rounds: int = 20, tokens: int = 12,
          runs: int = 300) -> Dict:
    import mlx_lm

    from ..model import build_streaming_model

    unit = perf_gate.cost_unit()
    reference, _ = mlx_lm.load(str(model_dir))
    configs = dict(zip(SCENARIOS, (config.with_pool().replace(preload=True), config.with_pool(pool_fraction=0.25).replace(io_mode="direct"))))
    models = {scenario: build_streaming_model(model_dir, c) for scenario, c in configs.items()}
    try:
        prompt = next(iter(models.values())).tokenizer.encode(config.prompt)
        for model in [reference] + [sm.model for sm in models.values()]:
            greedy_generate(model, prompt, tokens)  # warm-up
        _say(f"baseline pools: {pool_rounds} round pairs per scenario, quiet")
        baseline = _record(models, reference, prompt, tokens, pool_rounds, {}, unit)
        cost = {s: float(np.percentile(c, perf_gate.QUANTILE)) for s, (c, _) in baseline.items()}
        pools = {}
        for condition in ("quiet", "busy"):
            neighbours = _busy_neighbours(2) if condition == "busy" else []
            try:
                for fraction in (0.0,) + FRACTIONS:
                    _say(f"{condition}, planted +{fraction:.0%}: {pool_rounds} round pairs per scenario")
                    plants = {s: fraction * c for s, c in cost.items()}
                    pools[f"{condition} +{fraction:.0%}"] = _record(models, reference, prompt, tokens, pool_rounds,
                                                                    plants, unit)
            finally:
                for p in neighbours:
                    p.kill()
    finally:
        for sm in models.values():
            sm.close()
    recorded = {"unit": unit, "cost_per_token": cost, "pool_rounds": pool_rounds, "tokens": tokens,
                "baseline": baseline, "pools": pools}
    return replay(recorded, rounds, runs)


def replay(recorded: Dict, rounds: int = 20, runs: int = 300) -> Dict:
    """Simulated gate runs on recorded pools (a ``study``'s report, or its JSON) under the current rule."""
    rows = []
    baseline = recorded["baseline"]
    for name, current in recorded["pools"].items():
        condition, planted = name.split(" +")
        rate, by_check = simulate(baseline, current, rounds, runs, THRESHOLDS)
        measured = {s: float(perf_gate.relative_cost(*map(perf_gate.as_rounds, current[s]))
                             / perf_gate.relative_cost(*map(perf_gate.as_rounds, baseline[s]))) for s in SCENARIOS}
        rows.append({"condition": condition, "planted": float(planted.rstrip("%")) / 100, "fail_rate": rate,
                     "by_check": by_check, "measured_ratio": measured})
    keep = ("unit", "cost_per_token", "pool_rounds", "tokens", "baseline", "pools")
    return {**{key: recorded[key] for key in keep}, "rounds": rounds, "runs": runs, "thresholds": {**THRESHOLDS, COMBINED: perf_gate.COMBINED_THRESHOLD},
            "quantile": perf_gate.QUANTILE, "rows": rows}


def table(report: Dict) -> str:
    from tabulate import tabulate

    body = [[r["condition"], f"+{r['planted']:.0%}"]
            + [f"x{r['measured_ratio'][s]:.3f}" for s in SCENARIOS]
            + [f"{r['by_check'][c]:.1%}" for c in SCENARIOS + (COMBINED,)]
            + [f"{r['fail_rate']:.1%}" + ("" if r["planted"] else " (false alarms)")] for r in report["rows"]]
    headers = (["condition", "planted"] + [f"measured, {s}" for s in SCENARIOS] + [f"fails, {c}" for c in SCENARIOS + (COMBINED,)]
               + ["gate fails"])
    costs = ", ".join(f"{s} {c * 1000:.1f} ms" for s, c in report["cost_per_token"].items())
    return (tabulate(body, headers=headers)
            + f"\nunit {report['unit']}, p{report['quantile']} of token costs quiet: {costs}; {report['runs']} simulated "
              f"gate runs of {report['rounds']} round pairs x {report['tokens']} tokens per scenario, drawn from pools "
              f"of {report['pool_rounds']}; thresholds "
              + ", ".join(f"{s} +{t:.0%}" for s, t in report["thresholds"].items()))
