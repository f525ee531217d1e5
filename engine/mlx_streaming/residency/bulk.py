"""BulkCount: the hits of a complete pool's forwards, counted many forwards at a time.

Where every expert is resident and nothing but the hit counters watches routes, no forward can miss, so none
waits for its check. A forward of one token hits its router's k distinct experts per layer: counted at once,
from the routes' shapes. A longer forward's routes are kept, and every ``COUNT_EVERY`` such forwards the ones
before the newest are counted, their routes brought to the host in one transfer (which waits for the step in
flight), the rest at ``stats()``.
"""

from __future__ import annotations

import time
from typing import List

import numpy as np

from .pool import ExpertPool, flat_routes
from .stats import ResidencyStats

#: A complete pool's forwards are counted in batches of this many.
COUNT_EVERY = 64


class BulkCount:
    def __init__(self, pool: ExpertPool, counters: ResidencyStats):
        self.pool, self.counters = pool, counters
        #: Forwards not yet counted, each its routes by layer.
        self._uncounted: List[List[tuple]] = []

    def keep(self, routes: List[tuple]) -> None:
        """One forward's routes ((layer, indices) pairs, lazy), to be counted later; a forward of one token is
        counted now, with no transfer: a token's routed experts are its router's top k, distinct."""
        self.counters.fastpath += len(routes)
        if all(indices.size == indices.shape[-1] for _, indices in routes):
            self.counters.hits += sum(indices.size for _, indices in routes)
            return
        self._uncounted.append(routes)
        if len(self._uncounted) > COUNT_EVERY:
            self.count(keep_newest=True)

    def count(self, keep_newest: bool = False) -> None:
        """Count the hits of the forwards kept (all, or all but the newest): every layer's distinct experts, per
        forward. Counted as one host sync, whether or not their routes were ready."""
        if not self._uncounted:
            return
        split = len(self._uncounted) - keep_newest
        forwards, self._uncounted = self._uncounted[:split], self._uncounted[split:]
        routes = [route for forward in forwards for route in forward]
        start = time.perf_counter()  # one transfer: an array each costs more than the wait for the step in flight
        hosted = np.array(flat_routes(routes)).reshape(-1)
        self.counters.host_syncs += 1
        self.counters.sync_s += time.perf_counter() - start
        start = time.perf_counter()
        offsets = [n * self.pool.table_size for n, forward in enumerate(forwards) for _ in forward]
        self.counters.hits += len(set(self.pool.keys(routes, hosted, offsets).tolist()))
        self.counters.route_s += time.perf_counter() - start

    def forget(self) -> None:
        """Drop the forwards kept (a statistics reset: they ran before it)."""
        self._uncounted = []
