"""The perf gate's power study: how often it catches planted slowdowns, and how often it fails an unchanged
tree, quiet and with two busy-loop processes beside it (``mlx-streaming bench --gate-power``).

Two of the perf suite's scenarios, greedy at the full pool (preloaded: compute alone) and greedy at a 25% pool
with O_DIRECT, are measured as the suite measures them: rounds of ``tokens`` tokens, each scenario round just
after its own yardstick round (greedy on mlx-lm's in-memory model), each token's cost in the gate's unit. A pool
of round pairs is recorded per scenario, as many as the suite runs (``ROUNDS``): a baseline pool on the quiet
machine, then for each condition (quiet, busy) an unchanged pool and one pool per planted slowdown (``fraction``
x the scenario's baseline cost per token, CPU time of the decoding thread burnt at the start of every forward:
one forward per greedy token). Gate runs are then simulated: each draws as many round pairs with replacement from
the baseline pool and from the condition's pool, per scenario, and applies ``perf_gate.slowdown_verdict`` at the
scenario's threshold in the suite (``THRESHOLDS``); a run fails when either scenario fails. The failing share is
the catch rate (for an unchanged pool, the false-alarm rate). ``replay`` simulates recorded pools again (``bench
--gate-power --json FILE`` keeps them) under the current rule, without measuring anew.
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
#: Each scenario's threshold and rounds, as the perf suite runs and judges its twin (``perf/test_perf.py``).
THRESHOLDS = dict(zip(SCENARIOS, (perf_gate.COMPUTE_THRESHOLD, perf_gate.DISK_THRESHOLD)))
ROUNDS = dict(zip(SCENARIOS, (perf_gate.COMPUTE_ROUNDS, perf_gate.DISK_ROUNDS)))


def _say(text: str) -> None:
    print(f"[gate-power] {text}", file=sys.stderr, flush=True)


def _busy_neighbours(n: int) -> list:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def _record(models: Dict, reference, prompt, tokens: int, rounds: Dict[str, int], plants: Dict[str, float],
            unit: str) -> Dict:
    """``rounds[scenario]`` round pairs (the scenario's token costs, its yardstick's) per scenario,
    ``plants[scenario]`` CPU seconds burnt per forward of that scenario's model; the scenarios' rounds
    interleaved while each has rounds left."""

    def costs(model) -> list:
        return perf_gate.token_costs(greedy_steps(model, prompt, tokens), unit)[0]

    pairs = {scenario: ([], []) for scenario in models}
    for scenario, sm in models.items():
        sm.store.plant_s = plants.get(scenario, 0.0)
    for n in range(max(rounds.values())):
        for scenario, sm in models.items():
            if n >= rounds[scenario]:
                continue
            pairs[scenario][1].append(costs(reference))
            pairs[scenario][0].append(costs(sm.model))
    for sm in models.values():
        sm.store.plant_s = 0.0
    return pairs


def simulate(baseline: Dict[str, Tuple], current: Dict[str, Tuple], rounds: Dict[str, int], runs: int,
             thresholds: Dict[str, float], seed: int = 0) -> Tuple[float, Dict[str, float]]:
    """The share of ``runs`` simulated gate runs that fail (any scenario failing), and each scenario's own
    failing share. Each run draws ``rounds[scenario]`` round pairs with replacement from each pool."""
    rng = np.random.default_rng(seed)
    fails, by_check = 0, dict.fromkeys(baseline, 0)
    for run in range(runs):
        verdicts = {}
        for scenario in baseline:
            drawn = []
            for costs, yard in (baseline[scenario], current[scenario]):
                picks = rng.integers(0, len(costs), rounds[scenario])
                drawn.append((perf_gate.as_rounds(costs)[picks], perf_gate.as_rounds(yard)[picks]))
            verdicts[scenario] = perf_gate.slowdown_verdict(*drawn, thresholds[scenario], seed=run)["fail"]
        for check, failed in verdicts.items():
            by_check[check] += failed
        fails += any(verdicts.values())
    return fails / runs, {check: count / runs for check, count in by_check.items()}


def study(model_dir: Path, config: StreamingConfig, tokens: int = 16, runs: int = 300) -> Dict:
    import mlx_lm

    from ..model import build_streaming_model

    unit = perf_gate.cost_unit()
    reference, _ = mlx_lm.load(str(model_dir))
    configs = dict(zip(SCENARIOS, (config.with_pool().replace(preload=True),
                                   config.with_pool(pool_fraction=0.25).replace(io_mode="direct"))))
    models = {scenario: build_streaming_model(model_dir, c) for scenario, c in configs.items()}
    sizes = ", ".join(f"{scenario} {n}" for scenario, n in ROUNDS.items())
    try:
        prompt = next(iter(models.values())).tokenizer.encode(config.prompt)
        for model in [reference] + [sm.model for sm in models.values()]:
            greedy_generate(model, prompt, tokens)  # warm-up
        _say(f"baseline pools, quiet: round pairs {sizes}")
        baseline = _record(models, reference, prompt, tokens, ROUNDS, {}, unit)
        cost = {s: float(np.percentile(c, perf_gate.QUANTILE)) for s, (c, _) in baseline.items()}
        pools = {}
        for condition in ("quiet", "busy"):
            neighbours = _busy_neighbours(2) if condition == "busy" else []
            try:
                for fraction in (0.0,) + FRACTIONS:
                    _say(f"{condition}, planted +{fraction:.0%}: round pairs {sizes}")
                    plants = {s: fraction * c for s, c in cost.items()}
                    pools[f"{condition} +{fraction:.0%}"] = _record(models, reference, prompt, tokens, ROUNDS,
                                                                    plants, unit)
            finally:
                for p in neighbours:
                    p.kill()
    finally:
        for sm in models.values():
            sm.close()
    recorded = {"unit": unit, "cost_per_token": cost, "tokens": tokens, "baseline": baseline, "pools": pools}
    return replay(recorded, runs)


def replay(recorded: Dict, runs: int = 300) -> Dict:
    """Simulated gate runs on recorded pools (a ``study``'s report, or its JSON) under the current rule: each
    run draws as many round pairs per scenario as the suite runs (``ROUNDS``), whatever the pools' size."""
    rows = []
    baseline = recorded["baseline"]
    for name, current in recorded["pools"].items():
        condition, planted = name.split(" +")
        rate, by_check = simulate(baseline, current, ROUNDS, runs, THRESHOLDS)
        measured = {s: float(perf_gate.relative_cost(*map(perf_gate.as_rounds, current[s]))
                             / perf_gate.relative_cost(*map(perf_gate.as_rounds, baseline[s]))) for s in SCENARIOS}
        rows.append({"condition": condition, "planted": float(planted.rstrip("%")) / 100, "fail_rate": rate,
                     "by_check": by_check, "measured_ratio": measured})
    keep = ("unit", "cost_per_token", "tokens", "baseline", "pools")
    return {**{key: recorded[key] for key in keep}, "pool_rounds": {s: len(baseline[s][0]) for s in SCENARIOS},
            "rounds": ROUNDS, "runs": runs, "thresholds": THRESHOLDS, "quantile": perf_gate.QUANTILE, "rows": rows}


def table(report: Dict) -> str:
    from tabulate import tabulate

    body = [[r["condition"], f"+{r['planted']:.0%}"]
            + [f"x{r['measured_ratio'][s]:.3f}" for s in SCENARIOS]
            + [f"{r['by_check'][s]:.1%}" for s in SCENARIOS]
            + [f"{r['fail_rate']:.1%}" + ("" if r["planted"] else " (false alarms)")] for r in report["rows"]]
    headers = (["condition", "planted"] + [f"measured, {s}" for s in SCENARIOS] + [f"fails, {s}" for s in SCENARIOS]
               + ["gate fails"])
    costs = ", ".join(f"{s} {c * 1000:.1f} ms" for s, c in report["cost_per_token"].items())
    per_scenario = "; ".join(f"{s}: {report['rounds'][s]} round pairs drawn from a pool of "
                             f"{report['pool_rounds'][s]}, threshold +{report['thresholds'][s]:.0%}" for s in SCENARIOS)
    return (tabulate(body, headers=headers)
            + f"\nunit {report['unit']}, p{report['quantile']} of token costs quiet: {costs}; {report['runs']} "
              f"simulated gate runs of {report['tokens']}-token rounds; {per_scenario}")
