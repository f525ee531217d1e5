"""ExpertLoader: brings missing experts into a layer's pool. Bytes staged by the prefetcher are taken, the rest
read in one batch. The read experts get their slots first, and where the pool can take a tensor's bytes in place
(its slot's own memory where the device computes in host memory, a staging row on a GPU: ``ExpertPool.landings``)
the reader's threads put them there, with no copy after; each tensor is placed as soon as its bytes have arrived,
while the reader still reads the rest (an expert whose bytes do not all arrive gives its slot back: a failed read
leaves no expert half placed), except where the pool places a load with one scatter per tensor (then every byte
arrives first, into the reader's buffers). The byte verifier, where there is one, checks each expert placed.

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
from ..io.reader import ExpertReader, PendingRead
from .pool import ExpertPool
from .stats import ResidencyStats


#: The fewest bytes of arrived tensors written at once while the rest of a load is read: each batch has a fixed cost
#: (a wait and Python, tens of microseconds); the default model's 15 KB experts are placed after a whole layer
#: call's reads, as before, and the real geometry's 1.77 MB experts tensor by tensor.
PLACE_BATCH_BYTES = 256 * 1024


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
        tensors = [(e, s) for e in demand for s in self.index.slices(layer, e)]  # in the order they are read
        per_expert = len(tensors) // len(demand)
        ranges = [(s.path, s.offset, s.nbytes) for _, s in tensors]
        self.counters.demand_bytes += sum(s.nbytes for _, s in tensors)
        try:
            if self.pool.writes == "scatter":  # one scatter per tensor for the whole load: every byte first
                reading = self.reader.start(ranges)
                buffers = reading.take(len(tensors))
                staged.update((e, buffers[i * per_expert:(i + 1) * per_expert]) for i, e in enumerate(demand))
                self._place(layer, experts, staged, protected)
            else:
                reading = self._place_as_read(layer, demand, tensors, per_expert, ranges, staged, protected)
        except ExpertIOError as exc:
            failed = getattr(exc, "range_index", None)  # None: no read was issued (a shard that will not open)
            if failed is None:
                raise
            raise ExpertIOError(f"layer {layer} expert {demand[failed // per_expert]}: {exc}") from None
        self.counters.read_s += reading.elapsed
        self.counters.demand_reads += reading.reads
        self.counters.reads_in_place += reading.in_place
        self.counters.read_wait_s += reading.waited_s

    def _place_as_read(self, layer: int, demand: List[int], tensors: list, per_expert: int, ranges: list,
                       staged: Dict[int, list], protected: set) -> PendingRead:
        """Give ``demand`` their slots and read their ``tensors`` (expert, slice; ``per_expert`` per expert; at
        ``ranges``) where the pool can take them in place (``ExpertPool.landings``: the slots' own memory, or
        staging rows), else into the reader's buffers, after placing the prefetcher's ``staged`` experts; then
        place each tensor once its bytes have arrived, in batches of at least ``PLACE_BATCH_BYTES`` and
        every tensor that has arrived, while the reader reads the rest. An expert whose bytes do not all arrive
        gets no slot. Returns the reads, finished."""
        if staged:  # first: a staging row the pool copies these from is never one the reads below land in
            self._place(layer, list(staged), staged, protected)
        start = time.perf_counter()
        placed, evictions = self.pool.assign(layer, demand, protected)
        slots = dict(placed)
        landings = self.pool.landings(layer, [(expert, slots[expert]) for expert in demand])
        self.counters.evictions += evictions
        self.counters.place_s += time.perf_counter() - start
        try:
            reading = self.reader.start(ranges, into=None if landings is None else [buf for buf, _ in landings])
        except ExpertIOError:
            self.pool.release(layer, demand)
            raise
        step = max(1, PLACE_BATCH_BYTES * per_expert // self.index.expert_bytes)  # tensors
        written = 0
        try:
            while written < len(tensors):
                ready = min(len(tensors), max(written + step, reading.arrived()))
                buffers = reading.take(ready)
                start = time.perf_counter()
                for i, ((expert, tensor), buf) in enumerate(zip(tensors[written:ready], buffers), written):
                    if landings is None:
                        self.pool.write_tensor(layer, slots[expert], tensor, buf)
                    else:
                        self.pool.landed(layer, slots[expert], tensor, landings[i][1])
                self.counters.place_s += time.perf_counter() - start
                self.counters.pool_writes += ready - written
                if self.verifier is not None:  # the experts whose every tensor is now written
                    for expert in demand[written // per_expert:ready // per_expert]:
                        self.verifier.check(layer, expert, self.pool.arrays[layer], slots[expert])
                written = ready
        except ExpertIOError:
            reading.settle()  # no read still writes into a slot given back
            self.pool.release(layer, demand[written // per_expert:])
            raise
        return reading

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
