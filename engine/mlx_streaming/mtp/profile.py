"""Union-of-experts profile: how many distinct experts one verify routes to, per layer.

A verify of K tokens needs the union of their routed experts resident at once (or runs in groups), so
this is the pool size speculation asks for.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Dict, Iterable, Tuple

import numpy as np


def union_profile(log: Iterable[Tuple[int, int, list]], tokens_per_call: int) -> Dict[str, object]:
    """From ``store.route_log`` entries, the calls of ``tokens_per_call`` tokens: avg, p99 and max distinct
    experts over all layers, and the max by layer."""
    by_layer = defaultdict(list)
    for layer, tokens, experts in log:
        if tokens == tokens_per_call:
            by_layer[layer].append(len(experts))
    if not by_layer:
        return {"calls": 0}
    every = np.concatenate([np.array(v) for v in by_layer.values()])
    return {
        "calls": int(every.size),
        "avg": float(every.mean()),
        "p99": float(np.percentile(every, 99)),
        "max": int(every.max()),
        "max_by_layer": {int(layer): int(max(v)) for layer, v in sorted(by_layer.items())},
    }
