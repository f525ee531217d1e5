"""StreamingSwitchGLU: stands in for a MoE block's ``switch_mlp``, computing over the resident pool.

The mlx-lm MoE block keeps its own routing code (gate, softmax, top-k, score normalisation, shared
expert); only its ``switch_mlp`` is replaced, on the built model instance. The replacement acquires the
routed experts from the store and runs mlx-lm's own quantized ``SwitchGLU`` (the original module, its
arrays swapped for the pool's) with expert ids remapped to slot ids, so the arithmetic is the in-memory
model's. A call that routes to more distinct experts than fit (a long prefill with a small pool) runs in
expert groups that fit, each evaluated before the next may evict its experts.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.switch_layers import SwitchGLU

from ..cache.store import ExpertStore
from ..checkpoint.experts import PARTS, PROJS


class StreamingSwitchGLU(nn.Module):
    def __init__(self, switch_mlp: SwitchGLU, layer: int, store: ExpertStore):
        super().__init__()
        pool = store.pools[layer]
        for proj in PROJS:
            linear = getattr(switch_mlp, proj)
            for part in PARTS:
                setattr(linear, part, pool[f"{proj}.{part}"])
        self.pool_mlp = switch_mlp
        self.layer = layer
        self._store = store
        self._slot_of = np.zeros(store.index.num_experts, dtype=np.int32)

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        store, layer = self._store, self.layer
        routed = np.array(indices)
        experts = [int(e) for e in np.unique(routed)]
        if store.union_log is not None:
            store.union_log.append((layer, routed.size // routed.shape[-1], len(experts)))
        policy = store.policies[layer]
        if all(policy.slot(e) is not None for e in experts):
            store.fastpath += 1
        else:
            store.fallback += 1
        groups = store.groups(layer, experts)
        if len(groups) == 1:
            self._slot_of[experts] = store.acquire(layer, experts)
            store.layer_done(layer)
            return self.pool_mlp(x, mx.array(self._slot_of[routed]))
        store.grouped += 1
        y = None
        for group in groups:
            slots = store.acquire(layer, group)
            self._slot_of[:] = slots[0]  # routes outside the group compute something; masked out below
            self._slot_of[group] = slots
            y_group = self.pool_mlp(x, mx.array(self._slot_of[routed]))
            in_group = mx.array(np.isin(routed, group))[..., None]
            y = y_group if y is None else mx.where(in_group, y_group, y)
            mx.eval(y)
        store.layer_done(layer)
        return y
