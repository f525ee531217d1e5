"""PrefetchHooks: the prefetch side of a forward. Before each decoder layer the predictor names, from the layer's
input, the experts likely routed (in this layer or the next); those not resident are submitted to the
prefetcher's threads. With ``--prefetch auto`` the switch decides at each forward's start whether it prefetches.

A prediction of the next layer's experts is queued on the device with the layer and brought to the host at the
store's next wait (this layer's routes), not by a wait of its own: the host goes on building the layer while the
device computes what came before, and the reads still run while this layer's experts and the next layer's
attention compute. A prediction of the layer's own experts (``--ahead 0``) is needed before that wait, so it
waits for itself."""

from __future__ import annotations

import time
from typing import List, Optional, Tuple

import mlx.core as mx
import numpy as np

from .switch import PrefetchSwitch


class PrefetchHooks:
    def __init__(self, store, switch: Optional[PrefetchSwitch] = None):
        """``store``: an ``ExpertStore`` built with a predictor and a prefetcher; ``switch``: prefetch on or off
        per forward (None: always on)."""
        self.store, self.switch, self.prefetching = store, switch, True
        #: Predictions queued on the device, (target MoE layer, lazy experts), submitted after the store's next wait.
        self._queued: List[Tuple[int, mx.array]] = []
        store.wait_hooks.append(self._after_wait)
        store.guard.forward_hooks.append(self._forward_starts)

    def _forward_starts(self, tokens: int) -> None:
        self._queued = []  # a forward that ended without waiting again leaves nothing to the next
        if self.switch is not None:
            self.prefetching = self.switch.forward(tokens)
            self.store.counters.prefetch_off_forwards += not self.prefetching

    def before_layer(self, layer: int, x) -> None:
        """Decoder layer ``layer`` is about to run on ``x``: predict the experts it or the next MoE layer will
        route to (not in a forward that defers its miss check: it expects every expert resident)."""
        store = self.store
        if store.guard.deferring:
            return
        if layer == 0:
            store.predictor.start_forward(x.shape[1])
        if not self.prefetching:  # the prefetch switch turned it off for this forward
            return
        prediction = store.predictor.predict(layer, x)
        if prediction is None:
            return
        target, top = prediction
        if target == layer:
            self._submit(target, store.to_host(top))
        else:
            mx.async_eval(top)
            self._queued.append(prediction)

    def _after_wait(self) -> None:
        """The store has waited for the device, so every prediction queued before is evaluated: submit them."""
        queued, self._queued = self._queued, []
        for target, top in queued:
            self._submit(target, np.array(top))

    def _submit(self, target: int, top: np.ndarray) -> None:
        """Submit ``target``'s predicted experts (``top``, on the host) that are not resident."""
        store = self.store
        ranked = store.predictor.rank(target, top)
        start = time.perf_counter()
        slots = store.pool.slots[target]
        missing = store.predictor.within_budget([e for e in ranked if slots[e] < 0])
        accepted = store.prefetcher.submit(target, missing)
        store.predictor.submitted(target, missing, accepted, time.perf_counter() - start)
