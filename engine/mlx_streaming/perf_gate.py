"""The perf gate: each scenario's ``extra_info`` against its recorded baseline.

pytest-benchmark compares only timing statistics; this compares what matters here:

(a) deterministic counters (disk loads, hits, accepted drafts, steps) must equal the baseline's: they are
    exact on any machine, so any change fails until the baseline is re-recorded;
(b) same-run ratios (speedup, streaming / in-memory) must not fall, and the disk-load ratio must not rise, by
    more than ``ratio_tolerance`` (relative);
(c) absolute tok/s must not fall by more than ``toks_tolerance`` (relative), checked only when the machine
    profile (CPU model, core count, OS, MLX version) equals the baseline's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional

COUNTERS = ("disk_loads", "hits", "accepted_drafts", "steps")
#: Ratios where higher is better, and where lower is better.
RATIOS_UP = ("speedup", "streaming_over_inmemory", "prefetch_over_lru")
RATIOS_DOWN = ("disk_load_ratio",)
TOKS = ("tok_s",)

#: Chosen from the noise floor measured on the 2-core CI machine (README): across 5 fresh processes the
#: greedy tok/s, speculative tok/s and speedup spread 18%, 26% and 34% (max - min over median).
DEFAULT_RATIO_TOLERANCE = 0.35
DEFAULT_TOKS_TOLERANCE = 0.30


@dataclass(frozen=True)
class Violation:
    scenario: str
    metric: str
    baseline: float
    current: float
    rule: str

    def row(self) -> list:
        return [self.scenario, self.metric, self.baseline, self.current, self.rule]


def machine_profile(machine_info: Mapping) -> dict:
    """What must match for absolute tok/s to be comparable."""
    cpu = machine_info.get("cpu", {}) or {}
    return {
        "cpu": cpu.get("brand_raw") or machine_info.get("processor"),
        "cores": cpu.get("count"),
        "os": machine_info.get("system"),
        "mlx": machine_info.get("mlx_version"),
    }


def check(current: Mapping[str, Mapping], baseline: Mapping[str, Mapping], same_machine: bool,
          ratio_tolerance: float = DEFAULT_RATIO_TOLERANCE, toks_tolerance: float = DEFAULT_TOKS_TOLERANCE) -> List[Violation]:
    """``{scenario: extra_info}`` now and recorded; the violations, empty when the gate passes."""
    out = []
    for scenario, now in sorted(current.items()):
        base = baseline.get(scenario)
        if base is None:
            continue
        for key in COUNTERS:
            if key in base and now.get(key) != base[key]:
                out.append(Violation(scenario, key, base[key], now.get(key), "deterministic counter moved"))
        for key in RATIOS_UP:
            if _fell(base.get(key), now.get(key), ratio_tolerance):
                out.append(Violation(scenario, key, base[key], now[key], f"ratio fell by more than {ratio_tolerance:.0%}"))
        for key in RATIOS_DOWN:
            if _rose(base.get(key), now.get(key), ratio_tolerance):
                out.append(Violation(scenario, key, base[key], now[key], f"ratio rose by more than {ratio_tolerance:.0%}"))
        if same_machine:
            for key in TOKS:
                if _fell(base.get(key), now.get(key), toks_tolerance):
                    out.append(Violation(scenario, key, base[key], now[key], f"tok/s fell by more than {toks_tolerance:.0%} (same machine profile)"))
    return out


def _fell(base: Optional[float], now: Optional[float], tolerance: float) -> bool:
    return base is not None and now is not None and now < base * (1 - tolerance)


def _rose(base: Optional[float], now: Optional[float], tolerance: float) -> bool:
    return base is not None and now is not None and now > base * (1 + tolerance)


def report(violations: List[Violation]) -> str:
    from tabulate import tabulate

    return tabulate([v.row() for v in violations], headers=["scenario", "metric", "baseline", "current", "rule"])


def missing(current: Mapping[str, Mapping], baseline: Mapping[str, Mapping]) -> Dict[str, str]:
    """Scenarios run now that the baseline does not hold (they pass unchecked: say so)."""
    return {name: "no baseline" for name in current if name not in baseline}
