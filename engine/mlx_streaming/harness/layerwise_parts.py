"""The layer-by-layer oracle's parts (``layerwise_oracle``): one part's parameters in mlx-lm's module tree, read
from the checkpoint when the forward calls the part, dropped after it ran; and what the oracle counts."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Tuple

import mlx.core as mx
from mlx.utils import tree_flatten

from ..errors import CheckpointError
from ..runtime.patch import put_arrays


@dataclass
class LayerwiseStats:
    """What the oracle read and held. Byte counts are of parameters (the checkpoint's tensors)."""

    model_bytes: int = 0
    #: bytes of each part's weights, by its path in the model (``model.layers.3``, ``lm_head``, ...)
    part_bytes: Dict[str, int] = field(default_factory=dict)
    #: the most parameter bytes materialized at once (counted as parts are loaded and dropped)
    max_materialized_bytes: int = 0
    #: the most ``mx.get_active_memory()`` seen while a part was loaded (all of the process's MLX arrays)
    max_active_bytes: int = 0
    bytes_read: int = 0
    read_seconds: float = 0.0
    part_loads: int = 0
    forwards: int = 0

    @property
    def largest_part_bytes(self) -> int:
        return max(self.part_bytes.values(), default=0)


class Part:
    """One part: where its parameters sit in mlx-lm's module tree, their placeholders, where they lie on disk."""

    def __init__(self, oracle, name: str):
        """``oracle``: the ``LayerwiseOracle`` whose ``stats`` and materialized bytes the part counts into."""
        self.oracle, self.name = oracle, name
        self.slots: List[Tuple[object, object]] = []  # (container: module dict or list, key)
        self.placeholders: List[mx.array] = []
        self.names: List[str] = []  # each slot's tensor name in the checkpoint
        self.by_file: Dict[Path, List[Tuple[int, str]]] = {}
        self.nbytes = 0
        self.depth = 0

    def add(self, container, key, array: mx.array, info) -> None:
        self.by_file.setdefault(info.path, []).append((len(self.slots), info.name))
        self.slots.append((container, key))
        self.placeholders.append(array)
        self.names.append(info.name)
        self.nbytes += array.nbytes

    def load(self) -> None:
        self.depth += 1
        if self.depth > 1:
            return
        stats, start = self.oracle.stats, time.perf_counter()
        try:
            fresh = []
            for file, entries in self.by_file.items():
                stored = mx.load(str(file))  # lazy: only the tensors evaluated below are read
                fresh.extend((slot, stored[name]) for slot, name in entries)
                del stored
            put_arrays([self.slots[slot] for slot, _ in fresh], [array for _, array in fresh])
            mx.eval([array for _, array in fresh])
        except Exception as exc:
            self._restore()
            self.depth -= 1
            raise CheckpointError(f"{self.oracle.path}: reading the weights of {self.name} failed: {one_line(exc)}") from exc
        stats.read_seconds += time.perf_counter() - start
        stats.bytes_read += self.nbytes
        stats.part_loads += 1
        self.oracle._materialized += self.nbytes
        stats.max_materialized_bytes = max(stats.max_materialized_bytes, self.oracle._materialized)

    def _restore(self) -> None:
        put_arrays(self.slots, self.placeholders)

    def drop(self) -> None:
        self.depth -= 1
        if self.depth > 0:
            return
        self._restore()
        self.oracle._materialized -= self.nbytes

    def run(self, method, module, args, kwargs):
        self.load()
        try:
            out = method(module, *args, **kwargs)
            arrays = [a for _, a in tree_flatten(out) if isinstance(a, mx.array)]
            for value in (*args, *kwargs.values()):
                arrays.extend(_cache_arrays(value))
            mx.eval(arrays)
            stats = self.oracle.stats
            stats.max_active_bytes = max(stats.max_active_bytes, mx.get_active_memory())
        finally:
            self.drop()
        return out


def _is_cache(value) -> bool:
    """Whether ``value`` is an mlx-lm cache: every one has a ``state`` and says whether it is trimmable."""
    return hasattr(value, "state") and callable(getattr(value, "is_trimmable", None))


def _cache_arrays(value) -> List[mx.array]:
    """The arrays an mlx-lm cache object (or a list of them) holds, so that a part leaves its state evaluated."""
    if isinstance(value, (list, tuple)):
        return [a for v in value for a in _cache_arrays(v)]
    if not _is_cache(value):
        return []
    found = []
    for v in vars(value).values():
        if isinstance(v, mx.array):
            found.append(v)
        elif isinstance(v, (list, tuple)):
            found.extend(a for a in v if isinstance(a, mx.array))
            found.extend(_cache_arrays([c for c in v if _is_cache(c)]))
    return found


def one_line(exc: Exception, limit: int = 300) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= limit else text[:limit] + " ..."
