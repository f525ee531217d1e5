"""PrefetchHooks: the prefetch side of a forward. Before each decoder layer the predictor names, from the layer's
input, the experts likely routed (in this layer or the next); those not resident are submitted to the
prefetcher's threads. With ``--prefetch auto`` the switch decides at each forward's start whether it prefetches."""

from __future__ import annotations

import time
from typing import Optional

from .switch import PrefetchSwitch


class PrefetchHooks:
    def __init__(self, store, switch: Optional[PrefetchSwitch] = None):
        """``store``: an ``ExpertStore`` built with a predictor and a prefetcher; ``switch``: prefetch on or off
        per forward (None: always on)."""
        self.store, self.switch, self.prefetching = store, switch, True
        if switch is not None:
            store.guard.forward_hooks.append(self._forward_starts)

    def _forward_starts(self, tokens: int) -> None:
        self.prefetching = self.switch.forward(tokens)
        self.store.counters.prefetch_off_forwards += not self.prefetching

    def before_layer(self, layer: int, x) -> None:
        """Decoder layer ``layer`` is about to run on ``x``: submit the predicted experts not resident (not in
        a forward that defers its miss check: it expects every expert resident, and predicting would sync)."""
        store = self.store
        if store.guard.deferring:
            return
        if layer == 0:
            store.predictor.start_forward(x.shape[1])
        if not self.prefetching:  # the prefetch switch turned it off for this forward
            return
        plan = store.predictor.predict(layer, x, store.to_host)
        if plan is None:
            return
        target, ranked = plan
        start = time.perf_counter()
        slots = store.pool.slots[target]
        missing = store.predictor.within_budget([e for e in ranked if slots[e] < 0])
        accepted = store.prefetcher.submit(target, missing)
        store.predictor.submitted(target, missing, accepted, time.perf_counter() - start)
