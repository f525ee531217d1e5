"""The only code that edits a built mlx-lm model, always one instance, never mlx-lm's classes or modules.

Every edit is composition or a per-instance subclass:
- ``install``: each expert site's switch module computes over the pool arrays, through the streaming switch;
- ``wrap_layers``: each decoder layer calls the predictor first (prefetch);
- ``defer_miss_checks``: the model's call and its decoder stack's run under the store's miss check;
- ``install_state_capture``: Qwen3-Next's Gated-DeltaNet mixers keep their state per position (MTP direct commit);
- ``call_through``: an instance's methods run through a callable (also the layer-by-layer oracle's part loading);
- ``direct_arrays`` / ``put_arrays``: a module's own arrays found where they sit, and swapped (the layer-by-layer
  oracle's weights in and out of a part).
"""

from __future__ import annotations

import inspect
from typing import Callable, Dict, List, Mapping, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten
from mlx_lm.models.cache import ArraysCache, KVCache

from .sites import ExpertSite, _child, decoder_layer_list


def install(sites: Mapping[int, ExpertSite], pools: Mapping[int, Mapping[str, mx.array]],
            make: Callable[[ExpertSite], nn.Module]) -> None:
    """Point each site's switch module at its layer's pool arrays (the lazy expert arrays are dropped unread),
    then replace it, on this model instance, by ``make(site)``, which computes with it."""
    for site in sites.values():
        site.switch.update(tree_unflatten(list(pools[site.layer].items())))
        setattr(site.parent, site.attr, make(site))


_THROUGH_CLASSES: Dict[Tuple[type, Tuple[str, ...]], type] = {}


def call_through(module: nn.Module, methods: Tuple[str, ...], around: Callable) -> None:
    """Run ``module``'s ``methods`` (those its class has) as ``around(original, module, args, kwargs)``. A
    subclass of its class, made once per class, set on this instance: the module stays the mlx-lm object users
    hand to mlx-lm (its type, attributes and parameter tree), and Python looks ``__call__`` up on the type."""
    cls = type(module)
    key = (cls, methods)
    if key not in _THROUGH_CLASSES:
        def through(name):
            original = getattr(cls, name)

            def method(self, *args, **kwargs):
                return self._runtime_around(original, self, args, kwargs)

            method.__name__ = name
            return method

        attrs = {name: through(name) for name in methods if hasattr(cls, name)}
        _THROUGH_CLASSES[key] = type(cls.__name__, (cls,), {**attrs, "__module__": cls.__module__})
    object.__setattr__(module, "_runtime_around", around)  # not a child module, not a parameter
    module.__class__ = _THROUGH_CLASSES[key]


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


def unwrap(layer: nn.Module) -> nn.Module:
    """The decoder layer itself, whether or not ``wrap_layers`` wrapped it."""
    return layer.inner if isinstance(layer, WrappedLayer) else layer


# ------------------------------------------------------------ every forward under the store's miss check

def _under_guard(store) -> Callable:
    """``around`` for ``call_through``: one forward (the model's call or its decoder stack's) under the store's
    miss check (``residency.guard.MissGuard``), with what restores its caches should it run again."""
    #: per original method: (its first argument's name, the cache's position among its positional arguments)
    arguments: Dict[Callable, Tuple[Optional[str], Optional[int]]] = {}

    guard = store.guard

    def around(original, module, args, kwargs):
        if guard.in_forward:  # the decoder stack's call inside the model's: one forward, already guarded
            return original(module, *args, **kwargs)
        if original not in arguments:  # read once: a signature costs more than the rest of this call
            names = list(inspect.signature(original).parameters)[1:]
            arguments[original] = (names[0] if names else None, names.index("cache") if "cache" in names else None)
        first, cache_at = arguments[original]
        inputs = args[0] if args else kwargs.get(first)
        cache = kwargs["cache"] if "cache" in kwargs else (
            args[cache_at] if cache_at is not None and cache_at < len(args) else None)
        tokens = inputs.shape[1] if isinstance(inputs, mx.array) and inputs.ndim > 1 else 1 << 30

        def snapshot():
            saved = snapshot_caches(cache)
            return None if saved is None else lambda: restore_caches(cache, saved)

        return guard.run(tokens, lambda: original(module, *args, **kwargs), snapshot)

    return around


def defer_miss_checks(model: nn.Module, sites: Mapping[int, ExpertSite], store) -> None:
    """Run every forward of ``model`` under the store's miss check: its own call (so that the check evaluates
    the logits with the routes: one wait per forward), and its decoder stack's (the module holding its layers
    list, where that is not the model itself: the MTP drafter and verify call it for its hidden states)."""
    around = _under_guard(store)
    keys = next(iter(sites.values())).prefix.split(".")
    at = next(i for i, key in enumerate(keys) if key.isdigit())
    if at >= 2:
        parent = model
        for key in keys[:at - 2]:
            parent = _child(parent, key)
        call_through(_child(parent, keys[at - 2]), ("__call__",), around)
    model.streaming_store = store
    call_through(model, ("__call__",), around)


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


# ------------------------------------------------------------ Qwen3-Next: Gated-DeltaNet state per position

class StateCapture(nn.Module):
    """Wraps one Gated-DeltaNet mixer; while ``capturing``, a multi-token call runs position by position and
    keeps the cache state after each one in ``states``."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.capturing = False
        self.states: List[list] = []

    def __call__(self, x, mask=None, cache=None):
        if not self.capturing or cache is None:
            return self.inner(x, mask, cache)
        outputs, self.states = [], []
        for i in range(x.shape[1]):
            outputs.append(self.inner(x[:, i:i + 1], None if mask is None else mask[:, i:i + 1], cache))
            self.states.append(list(cache.cache))
        return mx.concatenate(outputs, axis=1)


def install_state_capture(model) -> None:
    """Wrap every Gated-DeltaNet mixer of ``model`` (``layer.linear_attn`` of layers with ``is_linear``) in a
    ``StateCapture``."""
    for layer in map(unwrap, model.layers):
        if layer.is_linear and not isinstance(layer.linear_attn, StateCapture):
            layer.linear_attn = StateCapture(layer.linear_attn)


# ------------------------------------------------------------ a module's own arrays, swapped in place

def direct_arrays(module):
    """(dotted key relative to ``module``, the dict or list holding it, its key or index there, the array) for
    each array ``module`` holds itself (directly or in plain lists / dicts), not through a child module."""
    def walk(container, prefix, items):
        for key, value in items:
            dotted = f"{prefix}{key}"
            if isinstance(value, mx.array):
                yield dotted, container, key, value
            elif isinstance(value, nn.Module):
                continue
            elif isinstance(value, dict):
                yield from walk(value, dotted + ".", value.items())
            elif isinstance(value, list):
                yield from walk(value, dotted + ".", enumerate(value))

    yield from walk(module, "", module.items())


def put_arrays(slots: List[Tuple[object, object]], arrays: List[mx.array]) -> None:
    """Put each of ``arrays`` where its slot (container, key) of ``direct_arrays`` says."""
    for (container, key), array in zip(slots, arrays):
        container[key] = array
