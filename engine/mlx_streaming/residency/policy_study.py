"""Eviction policies compared offline on a routing trace, at equal bytes, against the offline optimum.

``plan --trace`` asks which pool shape and eviction rule a model's routing rewards. Each policy replays the trace's
MoE layer calls in order, as the engine's store sees them: a call's experts must all be resident at once (none of
them is evicted to make room for another), a call with more distinct experts than a pool holds is split as the
engine splits it (``expert_groups``), and every policy gets the same bytes: ``slots`` experts per MoE layer, kept
either as one pool per layer or as one pool of ``slots x layers`` shared by all layers.

- LRU: the least recently used expert goes (per layer it equals the engine's ``--eviction lru``, ``trace.replay``);
- LFU: the expert with the fewest uses since the trace began goes (ties: least recently used; per layer it equals
  the engine's default, ``--eviction lfu``);
- LRU-2: the expert whose second most recent use is oldest goes (used once: first; ties: least recently used),
  a frequency-aware LRU that a single burst does not fool;
- Belady: the expert whose next use is furthest in the future goes (never again: first). It reads the future, so
  no engine can run it: it is the bound on the hit rate any policy of that pool shape could reach.

Hit rates count decode calls only (the trace's calls from ``decode_from`` on), the part that sets the decode rate.
"""

from __future__ import annotations

import heapq
import itertools
from collections import defaultdict
from typing import Callable, Dict, Hashable, List, Sequence

from .policy import expert_groups

#: Each policy's rank of a key touched at call ``t``: the resident of least rank is evicted first.
RANKS = ("LRU", "LFU", "LRU-2", "Belady")
SHAPES = ("per layer", "shared")
#: The pool shares ``plan --trace`` compares at (of each layer's experts).
SHARES = (0.05, 0.10, 0.25, 0.50)


class _Pool:
    """``capacity`` resident keys; a key that must come in when none is free evicts the unprotected resident of
    least rank. Ranks live in a heap with lazy deletion: a key's entries older than its last touch are stale."""

    def __init__(self, capacity: int, rank: Callable[[Hashable, int], tuple]):
        self.capacity, self.rank = capacity, rank
        self.resident: set = set()
        self._heap: list = []
        self._last: Dict[Hashable, int] = {}
        self._seq = itertools.count()

    def call(self, keys: Sequence[Hashable], t: int) -> int:
        """One group of a call at time ``t``: touch every key, bring the missing ones in; returns the misses."""
        missing = [k for k in keys if k not in self.resident]
        for k in [k for k in keys if k in self.resident] + missing:  # the engine's order: hits, then the placed
            seq = next(self._seq)
            self._last[k] = seq
            heapq.heappush(self._heap, (self.rank(k, t), seq, k))
        self.resident.update(missing)
        protected = set(keys)
        while len(self.resident) > self.capacity:
            self._evict(protected)
        return len(missing)

    def _evict(self, protected: set) -> None:
        held = []
        while True:
            entry = heapq.heappop(self._heap)
            key = entry[2]
            if key not in self.resident or self._last[key] != entry[1]:
                continue
            if key in protected:
                held.append(entry)
                continue
            self.resident.discard(key)
            break
        for entry in held:
            heapq.heappush(self._heap, entry)


def _next_uses(calls: list) -> List[Dict[int, float]]:
    """Per call, for each of its experts, the index of the next call of the same layer that routes to it
    (infinity: none)."""
    out: List[Dict[int, float]] = [dict() for _ in calls]
    upcoming: Dict[tuple, float] = {}
    for i in range(len(calls) - 1, -1, -1):
        layer, _, experts = calls[i]
        for e in experts:
            out[i][e] = upcoming.get((layer, e), float("inf"))
            upcoming[(layer, e)] = i
    return out


def _ranker(name: str, next_use: List[Dict[int, float]]) -> Callable[[Hashable, int], tuple]:
    uses: Dict[Hashable, int] = defaultdict(int)
    previous: Dict[Hashable, int] = {}
    last: Dict[Hashable, int] = {}

    def rank(key, t):
        uses[key] += 1
        previous[key], last[key] = last.get(key, -1), t
        if name == "LRU":
            return (t,)
        if name == "LFU":
            return (uses[key], t)
        if name == "LRU-2":
            return (previous[key], t)
        return (-next_use[t][key[1]], t)  # Belady: furthest next use first

    return rank


def replay(trace: dict, slots: int, rank: str, shape: str) -> dict:
    """Decode hits and misses of ``trace`` at ``slots`` experts per layer, under eviction rule ``rank`` in pools
    of ``shape``."""
    layers = trace["layers"]
    next_use = _next_uses(trace["calls"]) if rank == "Belady" else []
    ranker = _ranker(rank, next_use)
    if shape == "shared":
        shared = _Pool(slots * len(layers), ranker)
        pools = {layer: shared for layer in layers}
    else:
        pools = {layer: _Pool(slots, ranker) for layer in layers}
    hits = misses = 0
    for t, (layer, _, experts) in enumerate(trace["calls"]):
        pool = pools[layer]
        for group in expert_groups(experts, (), pool.capacity):
            missed = pool.call([(layer, e) for e in group], t)
            if t >= trace["decode_from"]:
                hits += len(group) - missed
                misses += missed
    return {"policy": f"{rank}, {shape}", "slots": slots, "decode_hits": hits, "decode_misses": misses,
            "decode_hit_rate": hits / max(1, hits + misses)}


def compare(trace: dict, shares: Sequence[float] = SHARES) -> List[dict]:
    """Every policy (rank x shape) at each pool share of the trace's experts per layer (at least ``top_k``)."""
    rows = []
    for share in shares:
        slots = max(trace["top_k"], round(share * trace["num_experts"]))
        for rank, shape in itertools.product(RANKS, SHAPES):
            rows.append({"share": share, **replay(trace, slots, rank, shape)})
    return rows
