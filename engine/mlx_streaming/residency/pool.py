"""ExpertPool: per MoE layer, pool arrays with ``capacity`` slots per expert tensor, the slot tables that say
which expert each slot holds, and placement.

The pool arrays are what the streaming switch computes with. Writing a slot (``arrays[slot] = x``) updates the
array in place because nothing else holds its buffer between steps. The host's slot table is one array, a row
per layer, kept with every placement and eviction, so that one lookup checks every layer's routes; the device's
copy, per layer, serves forwards that take their slots without a host sync, and is rebuilt after a placement.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np

from ..checkpoint.experts import ExpertIndex
from .policy import SlotBook, expert_groups

_NP_DTYPES = {"U32": np.uint32, "BF16": np.uint16, "F16": np.float16, "F32": np.float32}
_MX_DTYPES = {"U32": mx.uint32, "BF16": mx.bfloat16, "F16": mx.float16, "F32": mx.float32}


def _to_mx(buf: np.ndarray, dtype: str, shape: tuple) -> mx.array:
    arr = mx.array(buf.view(_NP_DTYPES[dtype]).reshape(shape))
    return arr.view(mx.bfloat16) if dtype == "BF16" else arr


def flat_routes(routes: List[tuple]) -> mx.array:
    """Every route of ``routes`` ((layer, indices) pairs) in one lazy array whose row-major order is theirs, in
    order (``ExpertPool.keys`` reads it flattened): one concatenation along the first axis where their other
    axes agree (each route stays contiguous), else of each flattened."""
    arrays = [indices for _, indices in routes]
    if not arrays:
        return mx.zeros((0,), mx.uint32)
    if arrays[0].ndim and len({a.shape[1:] for a in arrays}) == 1:
        return mx.concatenate(arrays, axis=0)
    return mx.concatenate([a.reshape(-1) for a in arrays])


class ExpertPool:
    def __init__(self, index: ExpertIndex, capacity: int, eviction: str = "lfu", layers: Optional[Sequence[int]] = None):
        """A pool for every MoE layer of ``index``, or for ``layers`` alone (a probe's)."""
        self.index = index
        layers = list(index.layers if layers is None else layers)
        #: Which expert sits in which slot, and which goes when a slot is needed (``policy.SlotBook``).
        self.book = SlotBook(layers, index.num_experts, capacity, eviction)
        self.capacity = self.book.capacity
        #: Per layer, per expert tensor name, the pool array (``capacity`` slots).
        self.arrays: Dict[int, Dict[str, mx.array]] = {
            layer: {name: mx.zeros((self.capacity, *shape), dtype=_MX_DTYPES[dtype])
                    for name, (dtype, shape) in index.tensor_specs.items()}
            for layer in layers
        }
        mx.eval(self.arrays)
        #: A pool with a slot for every expert keeps expert e in slot e: routes index it directly.
        self.identity = self.book.identity
        #: Per layer, expert id -> slot (-1: not resident): the book's table, a row per layer. A route's key in
        #: the table flattened is ``book.key_base[layer] + expert``: one number per (layer, expert), which a check
        #: both looks up and counts.
        self._table = self.book.table
        self.slots = {layer: self._table[row] for layer, row in self.book.row.items()}
        self._device: Dict[int, Optional[mx.array]] = dict.fromkeys(layers)
        #: Every expert of every layer resident in a pool with a slot for each: then no forward can miss.
        self.complete = False
        #: Whether a load's experts are written with one scatter per tensor (``_write_batched``) rather than one
        #: slot write per tensor per expert. Each MLX operation costs about 0.1-0.2 ms on a GPU backend whatever
        #: its size, so there batching wins; on the CPU backend a scatter runs slower than slot writes.
        self.batched = mx.default_device().type == mx.DeviceType.gpu

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for arrays in self.arrays.values() for a in arrays.values())

    def resident(self, layer: int, experts: Sequence[int]) -> bool:
        slots = self.slots[layer]
        return all(slots[e] >= 0 for e in experts)

    def device_slots(self, layer: int, indices: mx.array) -> mx.array:
        """Slots for routed ``indices`` from the device-side table, with no host sync (non-resident experts
        point at slot 0: the caller checks residency later); ``indices`` themselves with identity slots."""
        if self.identity:
            return indices
        if self._device[layer] is None:
            self._device[layer] = mx.array(np.maximum(self.slots[layer], 0))
        return self._device[layer][indices]

    def keys(self, routes: List[tuple], hosted: np.ndarray, offsets: Optional[List[int]] = None) -> np.ndarray:
        """One key per routed expert of ``routes`` ((layer, indices) pairs; ``hosted``: their expert ids,
        concatenated on the host): its (layer, expert)'s flat index in the slot table, plus its forward's offset
        (``offsets``, one per route) where several forwards are counted together, so each forward's stay apart."""
        bases = np.array([self.book.key_base[layer] for layer, _ in routes])
        if offsets is not None:
            bases = bases + np.array(offsets)
        return np.repeat(bases, [indices.size for _, indices in routes]) + hosted

    def resident_keys(self, keys: np.ndarray) -> np.ndarray:
        """Whether each of ``keys`` is resident."""
        return self._table.reshape(-1)[keys] >= 0

    def all_resident(self, keys: np.ndarray) -> bool:
        return bool(self.resident_keys(keys).all())

    def touch(self, keys: np.ndarray) -> int:
        """A resident forward's routes (``keys``), touched in every layer at once (``SlotBook.touch``). Returns
        how many distinct (layer, expert) were routed."""
        return self.book.touch(keys)

    @property
    def table_size(self) -> int:
        """Keys per forward (``keys``'s offsets step by this)."""
        return self._table.size

    def groups(self, layer: int, experts: Sequence[int]) -> List[List[int]]:
        """Split one call's distinct experts into groups that each fit the pool beside the pinned ones."""
        return expert_groups(experts, self.book.pinned(layer), self.capacity)

    def place(self, layer: int, experts: List[int], staged: Dict[int, list], protected: set) -> Tuple[list, int, int]:
        """Write each expert's ``staged`` host buffers (one per tensor, in ``index.slices`` order) into a free or
        evicted slot of ``layer`` (never one of ``protected``); the arrays are left to evaluate. Returns the
        (expert, slot) pairs placed, the number of experts evicted and the writes into the pool's arrays."""
        placed = self.book.place(layer, experts, protected)
        evictions = sum(evicted is not None for _, _, evicted in placed)
        placed = [(expert, slot) for expert, slot, _ in placed]
        tensors = len(self.arrays[layer])
        if self.batched and len(placed) > 1:
            self._write_batched(layer, placed, staged)
            writes = tensors
        else:
            arrays = self.arrays[layer]
            for expert, slot in placed:
                for s, buf in zip(self.index.slices(layer, expert), staged[expert]):
                    arrays[s.tensor][slot] = _to_mx(buf, s.dtype, s.shape)
            writes = tensors * len(placed)
        self._device[layer] = None
        self.complete = self.identity and bool((self._table >= 0).all())
        return placed, evictions, writes

    def _write_batched(self, layer: int, placed: List[Tuple[int, int]], staged: Dict[int, list]) -> None:
        """One host array and one scatter per expert tensor for all of ``placed``: two array operations per
        tensor, not two per tensor per expert."""
        arrays = self.arrays[layer]
        where = mx.array([slot for _, slot in placed])
        for t, s in enumerate(self.index.slices(layer, placed[0][0])):
            host = np.stack([staged[expert][t].view(_NP_DTYPES[s.dtype]).reshape(s.shape) for expert, _ in placed])
            arrays[s.tensor][where] = _to_mx(host, s.dtype, host.shape)
