"""ExpertLoader: brings missing experts into a layer's pool. Bytes staged by the prefetcher are taken, the rest
read in one batch; each expert is placed once its bytes have arrived (never before: a failed read leaves no
expert half placed), the first while the reader still reads the rest, except where the pool places a load with
one scatter per tensor (then all arrive first). The byte verifier, where there is one, checks each expert placed.

Placement does not wait for the device: host writes land at once (``ExpertPool.writes``), array writes are
evaluated with the layer that computes over them (queued as soon as that layer is built). Both are safe because
no computation still pending reads the slots written: a layer call that loads has just waited for its routes, which
depend on everything queued before it (earlier forwards included); a call split in groups waits for each group's
output before the next group may evict; and a deferred forward whose check found a miss is loaded for only after
it, and every forward queued behind it, has been evaluated (``MissGuard``)."""

from __future__ import annotations

import time
from typing import Dict, List

from ..checkpoint.experts import ExpertIndex
from ..errors import ExpertIOError
from ..io.reader import ExpertReader
from .pool import ExpertPool
from .stats import ResidencyStats


#: The fewest bytes of arrived experts placed at once while the rest of a load is read. Each placement has a fixed
#: cost (slot choice and Python, about 80 us on the 2-core CPU): placing 15 KB experts one by one as they arrived
#: decoded the default model's 25% pool 12% slower there; 1 MiB takes about 0.5 ms to read at 2 GB/s.
PLACE_BATCH_BYTES = 1 << 20


class ExpertLoader:
    def __init__(self, index: ExpertIndex, reader: ExpertReader, pool: ExpertPool, counters: ResidencyStats,
                 prefetcher=None, verifier=None):
        self.index, self.reader, self.pool, self.counters = index, reader, pool, counters
        self.prefetcher, self.verifier = prefetcher, verifier

    def load(self, layer: int, experts: List[int], protected: set) -> None:
        """Place ``experts`` (not resident) into ``layer``'s pool, evicting none of ``protected``."""
        staged = self._staged(layer, experts)
        demand = [e for e in experts if e not in staged]
        self.counters.misses += len(experts)
        self.counters.prefetched += len(staged)
        if not demand:
            self._place(layer, experts, staged, protected)
            return
        slices = [self.index.slices(layer, e) for e in demand]
        per_expert = len(slices[0])
        reading = self.reader.start([(s.path, s.offset, s.nbytes) for per in slices for s in per])
        self.counters.demand_bytes += sum(s.nbytes for per in slices for s in per)
        whole = self.pool.writes == "scatter"  # one scatter per tensor for the whole load: every byte first
        step = len(demand) if whole else max(1, PLACE_BATCH_BYTES // self.index.expert_bytes)
        if staged and not whole:
            self._place(layer, list(staged), staged, protected)
        placed = 0
        try:
            while placed < len(demand):  # the next batch: at least ``step`` experts, and all that have arrived
                ready = min(len(demand), max(placed + step, reading.arrived() // per_expert))
                buffers = reading.take(ready * per_expert)
                batch = {e: buffers[i * per_expert:(i + 1) * per_expert] for i, e in enumerate(demand[placed:ready])}
                if whole:
                    batch.update(staged)
                self._place(layer, [e for e in experts if e in batch], batch, protected)
                placed = ready
        except ExpertIOError as exc:
            raise ExpertIOError(f"layer {layer} expert {demand[exc.range_index // per_expert]}: {exc}") from None
        self.counters.read_s += reading.elapsed
        self.counters.read_wait_s += reading.waited_s

    def _staged(self, layer: int, experts: List[int]) -> Dict[int, list]:
        """The host buffers the prefetcher staged for any of ``experts``, taken from it."""
        staged = {}
        if self.prefetcher is not None:
            for expert in experts:
                buffers = self.prefetcher.take(layer, expert)
                if buffers is not None:
                    staged[expert] = buffers
        return staged

    def _place(self, layer: int, experts: List[int], staged: Dict[int, list], protected: set) -> None:
        """Write ``experts``' ``staged`` buffers into ``layer``'s pool, timed and counted, each checked by the
        byte verifier where there is one."""
        start = time.perf_counter()
        placed, evictions, writes = self.pool.place(layer, experts, staged, protected)
        self.counters.place_s += time.perf_counter() - start
        self.counters.evictions += evictions
        self.counters.pool_writes += writes
        if self.verifier is not None:
            for expert, slot in placed:
                self.verifier.check(layer, expert, self.pool.arrays[layer], slot)
