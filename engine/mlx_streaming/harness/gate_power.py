"""The perf gate's power study: how often it catches planted slowdowns, and how often it fails an unchanged
tree, quiet and with two busy-loop processes beside it (``mlx-streaming bench --gate-power``).

One scenario (greedy at a 25% pool, O_DIRECT: the engine's typical work) is measured in rounds as the perf
suite measures it (cost per token in the gate's unit). Pools of rounds are recorded: a baseline pool on the
quiet machine, then for each condition (quiet, busy) an unchanged pool and one pool per planted slowdown
(``plant_s`` = fraction x the measured cost per token, burnt at the start of every forward). Gate runs are
then simulated by drawing ``rounds`` rounds without replacement from the baseline pool and from the current
pool and applying ``perf_gate.slowdown_verdict``; the rate of failing verdicts is the catch rate (or, for the
unchanged pool, the false-alarm rate).
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List

import numpy as np

from . import perf_gate
from ..config import StreamingConfig
from ..generate import greedy_generate

FRACTIONS = (0.05, 0.10, 0.20)


def _say(text: str) -> None:
    print(f"[gate-power] {text}", file=sys.stderr, flush=True)


def _pool(sm, prompt, tokens: int, n: int, plant_s: float, unit: str) -> List[float]:
    sm.store.plant_s = plant_s
    costs = []
    for _ in range(n):
        c0, w0 = time.process_time(), time.perf_counter()
        greedy_generate(sm.model, prompt, tokens)
        costs.append(((time.process_time() - c0) if unit.startswith("cpu") else (time.perf_counter() - w0)) / tokens)
    sm.store.plant_s = 0.0
    return costs


def _busy_neighbours(n: int) -> list:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def simulate(baseline: List[float], current: List[float], rounds: int, runs: int, threshold: float, seed: int = 0) -> float:
    """The share of ``runs`` simulated gate runs (``rounds`` drawn from each pool) that fail."""
    rng = np.random.default_rng(seed)
    fails = 0
    for _ in range(runs):
        b = rng.choice(baseline, size=min(rounds, len(baseline)), replace=False)
        c = rng.choice(current, size=min(rounds, len(current)), replace=False)
        fails += perf_gate.slowdown_verdict(b, c, threshold)["fail"]
    return fails / runs


def study(model_dir: Path, config: StreamingConfig, pool_rounds: int = 30, rounds: int = 15, tokens: int = 12,
          runs: int = 400, threshold: float = perf_gate.DEFAULT_THRESHOLD) -> Dict:
    from ..model import build_streaming_model

    unit = perf_gate.cost_unit()
    with build_streaming_model(model_dir, config.with_pool(pool_fraction=0.25).replace(io_mode="direct")) as sm:
        prompt = sm.tokenizer.encode(config.prompt)
        greedy_generate(sm.model, prompt, tokens)  # warm-up
        _say(f"baseline pool: {pool_rounds} rounds, quiet")
        baseline = _pool(sm, prompt, tokens, pool_rounds, 0.0, unit)
        cost = float(np.median(baseline))
        pools = {}
        for condition in ("quiet", "busy"):
            neighbours = _busy_neighbours(2) if condition == "busy" else []
            try:
                for fraction in (0.0,) + FRACTIONS:
                    _say(f"{condition}, planted +{fraction:.0%}: {pool_rounds} rounds")
                    # per token: one forward per generated token, so burn fraction x cost at every forward
                    pools[(condition, fraction)] = _pool(sm, prompt, tokens, pool_rounds, fraction * cost, unit)
            finally:
                for p in neighbours:
                    p.kill()
    rows = []
    for (condition, fraction), current in pools.items():
        rate = simulate(baseline, current, rounds, runs, threshold)
        cv = float(np.std(current) / np.mean(current))
        rows.append({"condition": condition, "planted": fraction, "fail_rate": rate, "median_ratio":
                     float(np.median(current) / cost), "cv": cv})
    return {"unit": unit, "cost_per_token": cost, "baseline_cv": float(np.std(baseline) / np.mean(baseline)),
            "pool_rounds": pool_rounds, "rounds": rounds, "tokens": tokens, "runs": runs, "threshold": threshold,
            "rows": rows, "pools": {f"{c} +{f:.0%}": v for (c, f), v in pools.items()}, "baseline": baseline}


def table(report: Dict) -> str:
    from tabulate import tabulate

    body = [[r["condition"], f"+{r['planted']:.0%}", r["median_ratio"], r["cv"],
             f"{r['fail_rate']:.1%}" + ("" if r["planted"] else " (false alarms)")] for r in report["rows"]]
    return (tabulate(body, headers=["condition", "planted slowdown", "measured ratio", "round CV", "gate fails"],
                     floatfmt=".3f")
            + f"\nunit {report['unit']}: {report['cost_per_token'] * 1000:.1f} ms per token quiet (CV "
              f"{report['baseline_cv']:.3f}); {report['runs']} simulated gate runs of {report['rounds']} rounds "
              f"x {report['tokens']} tokens drawn from pools of {report['pool_rounds']}; threshold "
              f"+{report['threshold']:.0%}")
