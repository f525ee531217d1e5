"""ExpertLoader: brings missing experts into a layer's pool. Bytes staged by the prefetcher are taken, the rest
read in one batch, all before any slot changes hands (a failed read leaves the pool as it was), then placed and
checked by the byte verifier where there is one.

Placement does not wait for the device: host writes land at once (``ExpertPool.writes``), array writes are
evaluated with the layer that computes over them (queued as soon as that layer is built). Both are safe because
no computation still pending reads the slots written: a layer call that loads has just waited for its routes, which
depend on everything queued before it (earlier forwards included); a call split in groups waits for each group's
output before the next group may evict; and a deferred forward whose check found a miss is loaded for only after
it, and every forward queued behind it, has been evaluated (``MissGuard``)."""

from __future__ import annotations

import time
from typing import Dict, List, Tuple

from ..checkpoint.experts import ExpertIndex
from ..errors import ExpertIOError
from ..io.reader import ExpertReader
from .pool import ExpertPool
from .stats import ResidencyStats


class ExpertLoader:
    def __init__(self, index: ExpertIndex, reader: ExpertReader, pool: ExpertPool, counters: ResidencyStats,
                 prefetcher=None, verifier=None):
        self.index, self.reader, self.pool, self.counters = index, reader, pool, counters
        self.prefetcher, self.verifier = prefetcher, verifier

    def load(self, layer: int, experts: List[int], protected: set) -> None:
        """Place ``experts`` (not resident) into ``layer``'s pool, evicting none of ``protected``."""
        staged, taken = self._read(layer, experts)
        start = time.perf_counter()
        placed, evictions, writes = self.pool.place(layer, experts, staged, protected)
        self.counters.place_s += time.perf_counter() - start
        self.counters.evictions += evictions
        self.counters.pool_writes += writes
        self.counters.misses += len(experts)
        self.counters.prefetched += taken
        if self.verifier is not None:
            for expert, slot in placed:
                self.verifier.check(layer, expert, self.pool.arrays[layer], slot)

    def _read(self, layer: int, experts: List[int]) -> Tuple[Dict[int, list], int]:
        """Each expert's host buffers (taken from the prefetcher's staging, the rest read in one batch), and how
        many were taken from staging."""
        staged = {}
        if self.prefetcher is not None:
            for expert in experts:
                buffers = self.prefetcher.take(layer, expert)
                if buffers is not None:
                    staged[expert] = buffers
        taken = len(staged)
        demand = [e for e in experts if e not in staged]
        if not demand:
            return staged, taken
        start = time.perf_counter()
        slices = [self.index.slices(layer, e) for e in demand]
        try:
            buffers = self.reader.read([(s.path, s.offset, s.nbytes) for per in slices for s in per])
        except ExpertIOError as exc:
            raise ExpertIOError(f"layer {layer} expert {demand[exc.range_index // len(slices[0])]}: {exc}") from None
        self.counters.read_s += time.perf_counter() - start
        per_expert = len(slices[0])
        for i, e in enumerate(demand):
            staged[e] = buffers[i * per_expert:(i + 1) * per_expert]
        self.counters.demand_bytes += sum(s.nbytes for per in slices for s in per)
        return staged, taken
