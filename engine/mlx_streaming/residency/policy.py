"""Slot bookkeeping and eviction for every MoE layer's pool: which expert sits in which slot, and which one goes
when a slot is needed. No MLX, no I/O.

Eviction rules (``StreamingConfig.eviction``), per layer, among the unpinned residents the current call does
not need:

- ``lfu`` (the default): the expert routed to by the fewest layer calls since the pool was built goes (its count
  survives its evictions); ties: the least recently routed. Replayed on routing traces at equal bytes
  (``plan --trace``, ``policy_study``) it beat LRU by a clear margin on the default model and on the real
  geometry (docs/measurements.md, "Eviction policies against Belady's bound");
- ``lru``: the least recently routed goes.

Per (layer, expert) the book keeps its slot (-1: not resident), its latest touch (a tick of one clock shared by
every layer) and its uses, in arrays of a row per layer: a forward's routes are looked up and touched for every
layer at once by their flat keys (``key_base[layer] + expert``, ``touch``).
"""

from __future__ import annotations

from typing import Collection, Dict, List, Optional, Sequence, Set, Tuple

import numpy as np

from ..errors import PoolTooSmallError

EVICTIONS = ("lfu", "lru")


class SlotBook:
    """``capacity`` slots per layer of ``layers``. With ``identity`` (a slot for every expert: nothing is ever
    evicted) expert e sits in slot e."""

    def __init__(self, layers: Sequence[int], num_experts: int, capacity: int, eviction: str = "lfu"):
        if eviction not in EVICTIONS:
            raise ValueError(f"eviction must be one of {', '.join(EVICTIONS)}, got {eviction!r}")
        self.num_experts, self.eviction = num_experts, eviction
        self.capacity = min(capacity, num_experts)
        self.identity = self.capacity == num_experts
        self.row = {layer: row for row, layer in enumerate(layers)}
        #: Per layer, the flat key of its expert 0: (layer, expert)'s key is ``key_base[layer] + expert``.
        self.key_base = {layer: row * num_experts for layer, row in self.row.items()}
        shape = (len(self.row), num_experts)
        #: Per layer, expert id -> slot (-1: not resident).
        self.table = np.full(shape, -1, dtype=np.int32)
        self._last = np.full(shape, -1, dtype=np.int64)
        self._uses = np.zeros(shape, dtype=np.int64)
        self._clock = 0
        self._pinned: Dict[int, Set[int]] = {layer: set() for layer in self.row}
        self._free: Dict[int, List[int]] = {layer: list(range(self.capacity - 1, -1, -1)) for layer in self.row}

    def slot(self, layer: int, expert: int) -> Optional[int]:
        slot = int(self.table[self.row[layer], expert])
        return None if slot < 0 else slot

    def pinned(self, layer: int) -> Set[int]:
        return self._pinned[layer]

    def resident(self, layer: int) -> List[int]:
        return np.flatnonzero(self.table[self.row[layer]] >= 0).tolist()

    def _stamp(self, keys: np.ndarray) -> None:
        """Touch distinct flat ``keys`` in their order: each is now the newest, and used once more."""
        self._last.reshape(-1)[keys] = self._clock + np.arange(keys.size)
        self._uses.reshape(-1)[keys] += 1
        self._clock += keys.size

    def touch(self, keys: np.ndarray) -> int:
        """A resident forward's routes (flat ``keys``), touched in every layer at once: each layer's distinct
        experts in ascending order, as ``admit`` touches one call's. Returns how many distinct keys there were."""
        distinct = np.unique(keys)
        self._stamp(distinct)
        return distinct.size

    def admit(self, layer: int, experts: Sequence[int]) -> List[int]:
        """One call's distinct ``experts`` are routed: touch the resident ones, in order; return the others, in
        order (the caller places them, protected by ``experts``, and ``place`` touches them)."""
        row = self.table[self.row[layer]]
        missing = [e for e in experts if row[e] < 0]
        hits = [e for e in experts if row[e] >= 0] if missing else list(experts)
        self._stamp(self.key_base[layer] + np.array(hits, dtype=np.int64))
        return missing

    def place(self, layer: int, experts: Sequence[int], protected: Collection[int] = ()) -> List[Tuple[int, int, Optional[int]]]:
        """Give each of ``experts`` (none resident) a slot: a free one, else an evicted expert's, never one of
        ``protected`` (the experts the current call needs) or a pinned one. Returns (expert, slot, evicted expert
        or None) per expert, in order; the placed are touched, in order."""
        r = self.row[layer]
        row = self.table[r]
        if any(row[e] >= 0 for e in experts):
            raise ValueError(f"layer {layer}: experts {[e for e in experts if row[e] >= 0]} are already resident")
        free = self._free[layer]
        if self.identity:
            for e in experts:
                free.remove(e)
            placed = [(e, e, None) for e in experts]
        else:
            taken = min(len(free), len(experts))
            victims = self._victims(layer, len(experts) - taken, protected)
            slots = [free.pop() for _ in range(taken)] + [int(row[v]) for v in victims]
            row[victims] = -1
            placed = list(zip(experts, slots, [None] * taken + victims))
        row[list(experts)] = [slot for _, slot, _ in placed]
        self._stamp(self.key_base[layer] + np.array(experts, dtype=np.int64))
        return placed

    def release(self, layer: int, experts: Sequence[int]) -> None:
        """Take placed ``experts`` out again (their bytes never all arrived): not resident, their slots free."""
        row = self.table[self.row[layer]]
        for e in experts:
            self._free[layer].append(int(row[e]))
            row[e] = -1

    def _victims(self, layer: int, n: int, protected: Collection[int]) -> List[int]:
        """The ``n`` residents to evict, first to go first."""
        if n == 0:
            return []
        r = self.row[layer]
        evictable = self.table[r] >= 0
        evictable[list(self._pinned[layer] | set(protected))] = False
        candidates = np.flatnonzero(evictable)
        if candidates.size < n:
            raise PoolTooSmallError(
                f"pool of {self.capacity} slots: every slot holds a pinned or in-use expert, none can be evicted"
            )
        last = self._last[r, candidates]
        order = np.argsort(last) if self.eviction == "lru" else np.lexsort((last, self._uses[r, candidates]))
        return candidates[order[:n]].tolist()

    def pin(self, layer: int, expert: int) -> None:
        """Keep a resident expert forever."""
        if self.table[self.row[layer], expert] < 0:
            raise ValueError(f"expert {expert} must be resident to be pinned")
        self._pinned[layer].add(expert)


def expert_groups(experts: Sequence[int], pinned: Collection[int], capacity: int) -> List[List[int]]:
    """Split one call's distinct experts into groups that each fit a pool of ``capacity`` slots beside the
    ``pinned`` ones (the pinned experts of the call go with the first group); ``[experts]`` when they fit."""
    loose = [e for e in experts if e not in pinned]
    room = capacity - len(pinned)
    if len(loose) <= room:
        return [list(experts)]
    chunks = [loose[i:i + room] for i in range(0, len(loose), room)] or [[]]
    chunks[0] = [e for e in experts if e in pinned] + chunks[0]
    return chunks
