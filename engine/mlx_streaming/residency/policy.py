"""Slot bookkeeping and LRU eviction for one MoE layer's pool. No MLX, no I/O."""

from __future__ import annotations

from collections import OrderedDict
from typing import Collection, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..errors import PoolTooSmallError


class LRUSlots:
    """Which expert sits in which of ``capacity`` slots; unpinned residents are evicted least recently used first.
    With ``identity`` (a pool with a slot for every expert: nothing is ever evicted) expert e sits in slot e."""

    def __init__(self, capacity: int, identity: bool = False, pending: Optional[np.ndarray] = None):
        """``pending``: this layer's row of touches made in bulk (``ExpertPool.touch``), a tick per expert (-1: not
        touched since), applied to the LRU order, oldest tick first, before the order is next read or changed."""
        self.capacity = capacity
        self.identity = identity
        self._pending = pending
        self._slot_of: Dict[int, int] = {}
        self._recency: "OrderedDict[int, None]" = OrderedDict()  # unpinned residents, oldest first
        self._pinned: set = set()
        self._free: List[int] = list(range(capacity - 1, -1, -1))

    def slot(self, expert: int) -> Optional[int]:
        return self._slot_of.get(expert)

    def touch(self, expert: int) -> None:
        self._apply_pending()
        self._newest(expert)

    def _newest(self, expert: int) -> None:
        if expert in self._recency:
            self._recency.move_to_end(expert)

    def _apply_pending(self) -> None:
        if self._pending is None:
            return
        touched = np.flatnonzero(self._pending >= 0)
        if touched.size:
            for expert in touched[np.argsort(self._pending[touched])].tolist():
                self._newest(expert)
            self._pending[touched] = -1

    def admit(self, experts: Sequence[int]) -> List[int]:
        """One call's ``experts`` are routed: touch each; the ones not resident, in order (the caller places
        them, protected by ``experts``)."""
        missing = [e for e in experts if e not in self._slot_of]
        self._apply_pending()  # once per call, not per expert: it scans the layer's pending row
        for e in experts:
            self._newest(e)
        return missing

    def place(self, expert: int, protected: Collection[int] = ()) -> Tuple[int, Optional[int]]:
        """Give a slot to a non-resident ``expert``: a free one, else the LRU unpinned expert's that is not
        ``protected`` (the experts the current step needs). Returns (slot, evicted expert or None)."""
        if expert in self._slot_of:
            raise ValueError(f"expert {expert} is already resident")
        self._apply_pending()
        evicted = None
        if self.identity:
            slot = expert
            self._free.remove(slot)
        elif self._free:
            slot = self._free.pop()
        else:
            evicted = next((e for e in self._recency if e not in protected), None)
            if evicted is None:
                raise PoolTooSmallError(
                    f"pool of {self.capacity} slots: every slot holds a pinned or in-use expert, none can be evicted"
                )
            slot = self._slot_of.pop(evicted)
            del self._recency[evicted]
        self._slot_of[expert] = slot
        if not self.identity:  # nothing is evicted there: recency is never read, so ``touch`` keeps none
            self._recency[expert] = None
        return slot, evicted

    def pin(self, expert: int) -> None:
        """Keep a resident expert forever."""
        if expert not in self._slot_of:
            raise ValueError(f"expert {expert} must be resident to be pinned")
        self._recency.pop(expert, None)
        self._pinned.add(expert)

    @property
    def pinned(self) -> frozenset:
        return frozenset(self._pinned)

    def resident(self) -> List[int]:
        return list(self._slot_of)


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
