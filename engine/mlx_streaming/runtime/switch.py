"""StreamingSwitch: stands in for a MoE block's switch module, computing over the resident pool.

The mlx-lm MoE block keeps its own routing code (gate, softmax or sigmoid, top-k, score normalisation,
shared expert); only its ``SwitchGLU`` / ``SwitchMLP`` is replaced, on the built model instance (by the
adapter). The replacement acquires the routed experts from the store and runs mlx-lm's own switch module
(the original, its expert arrays swapped for the pool's) with expert ids remapped to slot ids, so the
arithmetic is the in-memory model's. A call that routes to more distinct experts than fit (a long prefill with a
small pool) runs in expert groups that fit, each computing only its own routes and evaluated before the next may
evict its experts. A call checked there, layer by layer, queues its output on the device at once
(``mx.async_eval``): the device computes the layer while the host builds the graph up to the next wait. While the
store defers its miss check (a forward expected to find every routed expert resident), the switch reads slots
from the store's device-side table instead, with no host sync; the store checks the routes once the forward is
done. On a complete pool (every expert preloaded) no call can miss: none syncs, and the store counts the routes in
bulk (``MissGuard``).
"""

from __future__ import annotations

from typing import List

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..residency.pool import SLOT_DTYPE
from ..residency.store import ExpertStore


class StreamingSwitch(nn.Module):
    def __init__(self, switch: nn.Module, layer: int, store: ExpertStore):
        """``switch``: mlx-lm's switch module, its expert arrays already the store's pool arrays of ``layer``."""
        super().__init__()
        self.pool_mlp = switch
        self.layer = layer
        self._store = store
        self._slot_of = np.zeros(store.index.num_experts, dtype=SLOT_DTYPE)

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        guard, layer = self._store.guard, self.layer
        if guard.deferring:  # no sync here: slots come from the device-side table, misses are checked per forward
            return self.pool_mlp(x, guard.defer(layer, indices))
        if guard.count_call_later(layer, indices):  # a complete pool: nothing to load, nothing to check
            return self.pool_mlp(x, indices)
        out = self._layer_by_layer(x, indices)
        mx.async_eval(out)  # the device computes this layer while the host builds the graph up to the next wait
        return out

    def _layer_by_layer(self, x: mx.array, indices: mx.array) -> mx.array:
        """The call checked here: its routes brought to the host (one wait), its missing experts loaded."""
        store, guard, layer = self._store, self._store.guard, self.layer
        if layer in guard.loaded:  # loaded and accounted before this forward ran again: resident, no sync
            return self.pool_mlp(x, store.pool.device_slots(layer, indices))
        routed = store.to_host(indices)
        experts = store.route(layer, routed)
        groups = store.groups(layer, experts)
        if len(groups) == 1:
            self._slot_of[experts] = store.acquire(layer, experts)
            store.layer_done(layer)
            return self.pool_mlp(x, indices if store.pool.identity else mx.array(self._slot_of[routed]))
        return self._in_groups(x, routed, groups)

    def _in_groups(self, x: mx.array, routed: np.ndarray, groups: List[List[int]]) -> mx.array:
        """A call whose experts do not all fit, one group at a time: each group computes only the routes to its
        own experts (one route per row: the token's input and the expert's slot), evaluated before the next group
        may evict them; the rows then go back in route order."""
        store, layer = self._store, self.layer
        k = routed.shape[-1]
        experts_of = routed.reshape(-1)  # route r is token r // k's (r % k)-th expert
        tokens = x.reshape(-1, x.shape[-1])
        parts, order = [], []
        for group in groups:
            self._slot_of[group] = store.acquire(layer, group)
            routes = np.flatnonzero(np.isin(experts_of, group))
            part = self.pool_mlp(tokens[mx.array(routes // k)], mx.array(self._slot_of[experts_of[routes]])[:, None])
            store.sync(part)
            parts.append(part[:, 0])
            order.append(routes)
        store.layer_done(layer)
        back = np.argsort(np.concatenate(order))  # each route sits in exactly one group
        return mx.concatenate(parts)[mx.array(back)].reshape(*routed.shape, -1)
