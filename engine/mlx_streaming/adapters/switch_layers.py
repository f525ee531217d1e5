"""Everything the engine assumes about an mlx-lm model tree, for every architecture built on switch_layers.

mlx-lm builds the routed experts of each MoE block as one ``SwitchGLU`` or ``SwitchMLP`` module (under
``switch_mlp``, ``experts``, ``experts.switch_mlp``, ``switch_glu``, ...), whose parameters are stacked over
experts and saved under the module's own path. So an *expert site* is found by walking the built model:
its module path is the checkpoint's tensor prefix, its parameters are the expert tensors, and its layer id
is the first integer in the path (the decoder layer). The block's own routing code runs unchanged; the
engine only replaces the switch module (``install``), and wraps decoder layers for prediction
(``wrap_layers``). Bare ``SwitchLinear`` modules are not experts (deepseek_v41 uses one in attention).

The per-architecture facts the predictor needs are small tables here: where the pre-MoE norm sits, what the
router is called, and the config key of the experts per token. Qwen3-Next's own extras (Gated-DeltaNet state
capture, the MTP head) live in ``qwen3_next.py``.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable, Dict, List, Mapping, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models.cache import ArraysCache, KVCache
from mlx_lm.models.switch_layers import SwitchGLU, SwitchMLP

SWITCH_CLASSES = (SwitchGLU, SwitchMLP)
#: The norm a decoder layer applies before its MoE block, by name, first match wins.
PRE_MOE_NORMS = ("post_attention_layernorm", "pre_mlp_layernorm", "pre_ff_layernorm", "pre_feedforward_layernorm",
                 "pre_feedforward_layernorm_2", "ffn_norm", "norm", "ln")
#: The router of a MoE block (a Linear giving logits, or a module giving (indices, scores)).
ROUTERS = ("gate", "router")
#: Config keys of the routed experts per token, at the top level or under ``text_config``.
EXPERTS_PER_TOKEN_KEYS = ("num_experts_per_tok", "num_experts_per_token", "moe_topk", "moe_top_k", "moe_k",
                          "top_k_experts", "experts_per_token")


@dataclass
class ExpertSite:
    """One MoE block's routed experts in a built model."""

    layer: int  #: the engine's layer id (the decoder layer's index; the MTP layer gets its own)
    prefix: str  #: module path = checkpoint tensor prefix, e.g. "model.layers.3.mlp.switch_mlp"
    parent: nn.Module  #: the module holding the switch as attribute ``attr``
    attr: str
    switch: nn.Module  #: mlx-lm's SwitchGLU / SwitchMLP
    decoder_layer: nn.Module  #: the decoder layer around it
    router_owner: Optional[nn.Module]  #: the module holding the router (the block, or the decoder layer)

    def tensor_names(self) -> List[str]:
        """The switch's parameter names, e.g. ``gate_proj.weight``, ``gate_proj.scales``, ``fc1.bias``."""
        return [name for name, _ in tree_flatten(self.switch.parameters())]


def _child(module, key: str):
    return module[int(key)] if isinstance(module, list) else getattr(module, key)


def expert_sites(model: nn.Module, prefix: str = "", layer_id: Optional[int] = None) -> Dict[int, ExpertSite]:
    """``{layer id: site}`` for every routed-expert switch module in ``model`` (``prefix`` is prepended to
    tensor names; ``layer_id`` overrides the id, for a head that is one layer)."""
    sites = {}
    for path, module in model.named_modules():
        if not isinstance(module, SWITCH_CLASSES):
            continue
        keys = path.split(".")
        numbers = [i for i, key in enumerate(keys) if key.isdigit()]
        if not numbers:
            continue
        chain = [model]
        for key in keys:
            chain.append(_child(chain[-1], key))
        layer_at = numbers[0] + 1  # chain index of the decoder layer
        owner = next((m for m in reversed(chain[layer_at:-1]) if any(_router(m, r) for r in ROUTERS)), None)
        layer = int(keys[numbers[0]]) if layer_id is None else layer_id
        sites[layer] = ExpertSite(layer, prefix + path, chain[-2], keys[-1], module, chain[layer_at], owner)
    return sites


def _router(module, name: str):
    router = getattr(module, name, None) if isinstance(module, nn.Module) else None
    return router if isinstance(router, nn.Module) else None


def experts_per_token(config: Mapping) -> int:
    """Routed experts per token from config.json (the largest, where a list gives one per layer)."""
    for scope in (config, config.get("text_config") or {}):
        for key in EXPERTS_PER_TOKEN_KEYS:
            value = scope.get(key)
            if value:
                return max(value) if isinstance(value, list) else int(value)
    return 1


def install(sites: Mapping[int, ExpertSite], pools: Mapping[int, Mapping[str, mx.array]],
            make: Callable[[ExpertSite], nn.Module]) -> None:
    """Point each site's switch module at its layer's pool arrays (the lazy expert arrays are dropped unread),
    then replace it, on this model instance, by ``make(site)``, which computes with it."""
    for site in sites.values():
        site.switch.update(tree_unflatten(list(pools[site.layer].items())))
        setattr(site.parent, site.attr, make(site))


def pre_moe_norm(site: ExpertSite) -> Callable[[mx.array], mx.array]:
    for name in PRE_MOE_NORMS:
        norm = getattr(site.decoder_layer, name, None)
        if isinstance(norm, nn.Module):
            return norm
    return lambda x: x


def predict_experts(site: ExpertSite, x: mx.array, k: int) -> Optional[mx.array]:
    """Each token's likely experts at ``site`` from a decoder layer input ``x``: the site's own router on the
    pre-MoE norm of ``x``; the top ``k`` of its logits, or the indices a router that selects returns.
    None when the architecture's router is not known here."""
    if site.router_owner is None:
        return None
    router = next(r for r in (_router(site.router_owner, n) for n in ROUTERS) if r is not None)
    out = router(pre_moe_norm(site)(x))
    if isinstance(out, tuple):  # a router that selects: (indices, scores)
        return out[0]
    k = min(k, out.shape[-1])
    return mx.argpartition(-out, kth=k - 1, axis=-1)[..., :k]


def decoder_layer_list(model: nn.Module, sites: Mapping[int, ExpertSite]) -> List[nn.Module]:
    """The list object holding the decoder layers around ``sites`` (edited in place by ``wrap_layers``)."""
    prefix = next(iter(sites.values())).prefix
    keys = prefix.split(".")
    at = next(i for i, key in enumerate(keys) if key.isdigit())
    holder = model
    for key in keys[:at]:
        holder = _child(holder, key)
    return holder


class _StandIn(nn.Module):
    """A module standing in for ``inner`` on the built model: every attribute it lacks is ``inner``'s, so the
    model's own code (``layer.is_linear``, ``self.model.layers``) sees the wrapped module."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if "inner" not in self:  # still in __init__
                raise
            return getattr(self["inner"], name)


class WrappedLayer(_StandIn):
    """A decoder layer that calls ``before(index, x)`` first; every other attribute is the layer's own."""

    def __init__(self, layer: nn.Module, index: int, before: Callable[[int, mx.array], None]):
        super().__init__(layer)
        self.index = index
        self._before = before

    def __call__(self, x: mx.array, *args, **kwargs) -> mx.array:
        self._before(self.index, x)
        return self.inner(x, *args, **kwargs)


def wrap_layers(model: nn.Module, sites: Mapping[int, ExpertSite], before: Callable[[int, mx.array], None]) -> None:
    """Wrap every decoder layer of ``model`` so that ``before(layer index, layer input)`` runs first."""
    layers = decoder_layer_list(model, sites)
    for i, layer in enumerate(layers):
        layers[i] = WrappedLayer(layer, i, before)


def run_forward(store, signature: inspect.Signature, call: Callable, module: nn.Module, args, kwargs):
    """One forward of a streaming model through ``call(module, *args, **kwargs)`` (the model's own call or its
    decoder stack's; ``signature`` is ``call``'s), under the store's miss check (``residency.guard.MissGuard``),
    with what restores its caches should it run again."""
    bound = signature.bind(module, *args, **kwargs).arguments
    inputs, cache = next(iter(list(bound.values())[1:]), None), bound.get("cache")
    tokens = inputs.shape[1] if isinstance(inputs, mx.array) and inputs.ndim > 1 else 1 << 30

    def snapshot():
        saved = snapshot_caches(cache)
        return None if saved is None else lambda: restore_caches(cache, saved)

    return store.guard.run(tokens, lambda: call(module, *args, **kwargs), snapshot)


class DeferredCheckStack(_StandIn):
    """The decoder stack (the module that runs the layers list) of a streaming model, run by ``run_forward``
    (the MTP drafter and verify call the stack directly, for its hidden states)."""

    def __init__(self, stack: nn.Module, store):
        super().__init__(stack)
        self._store = store
        self._signature = inspect.signature(type(stack).__call__)

    def __call__(self, *args, **kwargs):
        return run_forward(self._store, self._signature, type(self.inner).__call__, self.inner, args, kwargs)


_CHECKED_MODEL_CLASSES: Dict[type, type] = {}


def _checked_model_class(cls: type) -> type:
    """``cls`` with its call run by ``run_forward``, so that the deferred check evaluates the logits with the
    routes (one wait for the device per token, not one for the stack's output and one for the logits). A
    subclass, set on the instance, because the built model must stay the mlx-lm model object users hand to
    mlx-lm (its type, attributes and parameter tree), and Python looks ``__call__`` up on the type."""
    if cls not in _CHECKED_MODEL_CLASSES:
        signature = inspect.signature(cls.__call__)

        def __call__(self, *args, **kwargs):
            return run_forward(self.streaming_store, signature, cls.__call__, self, args, kwargs)

        _CHECKED_MODEL_CLASSES[cls] = type(cls.__name__, (cls,), {"__call__": __call__, "__module__": cls.__module__})
    return _CHECKED_MODEL_CLASSES[cls]


def snapshot_caches(cache) -> Optional[list]:
    """What restores ``cache`` (a list of mlx-lm caches) after one more forward: attention caches' offsets,
    recurrent caches' arrays. None when a cache of another kind cannot be restored this way."""
    if not isinstance(cache, list):
        return None
    saved = []
    for c in cache:
        if type(c) is KVCache:
            saved.append(c.offset)
        elif isinstance(c, ArraysCache):
            saved.append(list(c.cache))
        else:
            return None
    return saved


def restore_caches(cache: list, saved: list) -> None:
    for c, state in zip(cache, saved):
        if isinstance(c, ArraysCache):
            c.cache = state
        else:
            c.offset = state


def defer_miss_checks(model: nn.Module, sites: Mapping[int, ExpertSite], store) -> None:
    """Run every forward of ``model`` through ``run_forward``: its own call, and its decoder stack's (the module
    holding its layers list, where that is not the model itself)."""
    keys = next(iter(sites.values())).prefix.split(".")
    at = next(i for i, key in enumerate(keys) if key.isdigit())
    if at >= 2:
        parent = model
        for key in keys[:at - 2]:
            parent = _child(parent, key)
        setattr(parent, keys[at - 2], DeferredCheckStack(_child(parent, keys[at - 2]), store))
    model.streaming_store = store
    model.__class__ = _checked_model_class(type(model))


def unwrap(layer: nn.Module) -> nn.Module:
    """The decoder layer itself, whether or not ``wrap_layers`` wrapped it."""
    return layer.inner if isinstance(layer, WrappedLayer) else layer
