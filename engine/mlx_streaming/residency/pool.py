"""ExpertPool: per MoE layer, pool arrays with ``capacity`` slots per expert tensor, the slot tables that say
which expert each slot holds, and placement.

The pool arrays are what the streaming switch computes with. How a load's bytes get into them (``WRITES``) is
chosen per backend when the pool is built:

- ``host``: where the device computes in the host's memory (MLX's CPU backend, Apple silicon's unified memory),
  each tensor's bytes go into the pool array's own memory through a NumPy view of it, no array operation: a load's
  reads land there (``landings``), the prefetcher's staged bytes are copied in. Chosen only when a probe at build
  finds that a write through the view reaches the array;
- ``staged``: a GPU with memory of its own whose arrays are managed memory the host can view (MLX's CUDA
  backend), for large experts: each tensor's bytes go through a NumPy view into a row of a persistent staging
  array that the GPU is advised to read where it lies (``cuda_advice``; a load's reads land in the rows), then one
  slot write per tensor per expert copies the row into the pool on the device: no array made per buffer, no page
  migrated. Chosen where the driver takes the advice; on an H100, 64 experts of the real geometry were placed at
  4.7-5.8 GB/s this way against 1.8-2.1 GB/s by slot writes of host arrays made per buffer;
- ``scatter``: a GPU with memory of its own, for small experts (below ``SCATTER_BELOW``, where MLX's cost per
  operation outweighs the bytes): one host array of the whole load and one scatter per expert tensor;
- ``slots``: elsewhere, one slot write (``arrays[slot] = x``, in place: nothing else holds the buffer) per tensor
  per expert; on such a GPU a slot write moves large tensors faster than the scatter does.

A host write lands at once, not when a graph runs: it is safe because no computation still pending reads the
slots written (``loader``'s docstring says why). A staging row is written again only after the device has run
the copies that read it. The host's slot table is one array, a row per layer, kept with
every placement and eviction, so that one lookup checks every layer's routes; the device's copy, per layer,
serves forwards that take their slots without a host sync, and is rebuilt after a placement.
"""

from __future__ import annotations

import sys
from typing import Dict, List, Optional, Sequence, Set, Tuple

import mlx.core as mx
import numpy as np

from ..checkpoint.experts import ExpertIndex
from ..io.native import ALIGN
from .cuda_advice import advise_read_in_place
from .policy import SlotBook, expert_groups

_NP_DTYPES = {"U32": np.uint32, "BF16": np.uint16, "F16": np.float16, "F32": np.float32}
_MX_DTYPES = {"U32": mx.uint32, "BF16": mx.bfloat16, "F16": mx.float16, "F32": mx.float32}
#: The ways a load's bytes can be written into the pool arrays (the module's docstring).
WRITES = ("host", "staged", "scatter", "slots")
#: On a GPU with memory of its own, experts smaller than this are written by scatter, larger ones by a write per
#: tensor (``staged``, else ``slots``). An H100 (MLX 0.32.4 CUDA) placed 32 experts at 0.37-0.46 GB/s by scatter
#: against 0.15 by slot writes with 15 KB experts (MLX's cost per operation, about 11 us there, dominates), and at
#: 1.04-1.07 against 1.58 GB/s with 1.97 MB experts (the slot writes' copies move bytes faster): the two cross near
#: 340 KB per expert. Staged writes were measured at real width only.
SCATTER_BELOW = 256 * 1024
#: Byte alignment of each tensor's part in a batched load's host array.
_BLOCK_ALIGN = 16
#: Slot ids in the dtype of the router's expert ids (``argpartition`` gives uint32): given int32 indices,
#: ``gather_qmm`` casts them, one more array operation per expert tensor per MoE layer call (24 per decode step of
#: the default model, which a GPU's host submits one by one).
SLOT_DTYPE = np.uint32
#: Rows of each expert tensor's staging array (``staged`` writes): a load of more experts waits for the device
#: before it reuses a row. Host memory of STAGING_ROWS experts (57 MB of the real geometry's), where the slot
#: writes' host arrays made per buffer took as much of the allowance for temporaries.
STAGING_ROWS = 32
#: Where O_DIRECT needs aligned memory (Linux), the arrays its reads land in start on a page (``_zeros``): the CPU
#: backend's pool arrays and the staging rows.
_O_DIRECT_ALIGNS = sys.platform.startswith("linux")


def _to_mx(buf: np.ndarray, dtype: str, shape: tuple) -> mx.array:
    arr = mx.array(buf.view(_NP_DTYPES[dtype]).reshape(shape))
    return arr.view(mx.bfloat16) if dtype == "BF16" else arr


def _zeros(shape: tuple, dtype: mx.Dtype, page_aligned: bool) -> mx.array:
    """An array of zeros; ``page_aligned``: starting on a 4096-byte boundary, a view into a larger buffer (MLX's
    CPU allocator puts arrays 24 bytes past one on Linux), so that O_DIRECT reads of the packed layout land in its
    rows with no bounce buffer and no copy after."""
    if not page_aligned:
        return mx.zeros(shape, dtype=dtype)
    nbytes = int(np.prod(shape)) * dtype.size
    flat = mx.zeros((nbytes + ALIGN,), dtype=mx.uint8)
    mx.eval(flat)
    skip = -np.asarray(memoryview(flat)).ctypes.data % ALIGN
    return flat[skip:skip + nbytes].view(dtype).reshape(shape)


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
        page_aligned = _O_DIRECT_ALIGNS and mx.default_device().type == mx.DeviceType.cpu
        #: Per layer, per expert tensor name, the pool array (``capacity`` slots).
        self.arrays: Dict[int, Dict[str, mx.array]] = {
            layer: {name: _zeros((self.capacity, *shape), _MX_DTYPES[dtype], page_aligned)
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
        #: Per layer, the device's copy of its slot table, per number of dimensions of the routes it serves.
        self._device: Dict[int, Dict[int, mx.array]] = {layer: {} for layer in layers}
        #: Every expert of every layer resident in a pool with a slot for each: then no forward can miss.
        self.complete = False
        #: Per layer, per expert tensor, a NumPy view of the pool array's memory, one row of bytes per slot
        #: (``host`` writes only).
        self.host_views: Dict[int, Dict[str, np.ndarray]] = {}
        #: Per expert tensor name, its staging rows (``staged`` writes only).
        self.staging: Dict[str, _StagingRows] = {}
        #: How a load's experts are written (``WRITES``; the module's docstring says which backend gets which).
        self.writes = self._choose_writes()

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for arrays in self.arrays.values() for a in arrays.values())

    def resident(self, layer: int, experts: Sequence[int]) -> bool:
        slots = self.slots[layer]
        return all(slots[e] >= 0 for e in experts)

    def device_slots(self, layer: int, indices: mx.array) -> mx.array:
        """Slots for routed ``indices`` from the device-side table, with no host sync (non-resident experts
        point at slot 0: the caller checks residency later); ``indices`` themselves with identity slots. The table
        is shaped to take along the routes' last axis: one gather, where indexing would add a squeeze."""
        if self.identity:
            return indices
        tables = self._device[layer]
        if indices.ndim not in tables:
            shape = (1,) * (indices.ndim - 1) + (-1,)
            tables[indices.ndim] = mx.array(np.maximum(self.slots[layer], 0).astype(SLOT_DTYPE).reshape(shape))
        return mx.take_along_axis(tables[indices.ndim], indices, axis=-1)

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
        placed, evictions = self.assign(layer, experts, protected)
        tensors = len(self.arrays[layer])
        if self.writes == "scatter" and len(placed) > 1:
            self._write_batched(layer, placed, staged)
            return placed, evictions, tensors
        for expert, slot in placed:
            for s, buf in zip(self.index.slices(layer, expert), staged[expert]):
                self.write_tensor(layer, slot, s, buf)
        return placed, evictions, tensors * len(placed)

    def assign(self, layer: int, experts: List[int], protected: set) -> Tuple[List[Tuple[int, int]], int]:
        """Give each of ``experts`` (not resident) a free or evicted slot of ``layer``, never one of
        ``protected``: the (expert, slot) pairs, and the number of experts evicted. Their bytes are written next
        (``write_tensor``); an expert whose bytes do not all arrive is given back (``release``)."""
        placed = self.book.place(layer, experts, protected)
        evictions = sum(evicted is not None for _, _, evicted in placed)
        self._device[layer].clear()
        self.complete = self.identity and bool((self._table >= 0).all())
        return [(expert, slot) for expert, slot, _ in placed], evictions

    def write_tensor(self, layer: int, slot: int, tensor, buf: np.ndarray) -> None:
        """One expert tensor's bytes (``tensor``: its ``index.slices`` entry) into ``slot``: a host copy through the
        pool's view (``host``), a staging row copied into the slot (``staged``), else a host array written into
        the slot."""
        if self.writes == "host":
            self.host_views[layer][tensor.tensor][slot] = buf
        elif self.writes == "staged":
            self.arrays[layer][tensor.tensor][slot] = self.staging[tensor.tensor].put(buf, self.arrays, layer)
        else:
            self.arrays[layer][tensor.tensor][slot] = _to_mx(buf, tensor.dtype, tensor.shape)

    def landings(self, layer: int,
                 placed: List[Tuple[int, int]]) -> Optional[List[Tuple[np.ndarray, Optional[mx.array]]]]:
        """Where the reader can put each tensor of ``placed`` ((expert, slot) pairs, assigned; each expert's tensors
        in ``index.slices`` order) so that no copy follows: per tensor a writable uint8 buffer of its bytes and what
        ``landed`` then copies into the slot (None: the buffer is the slot's own memory, ``host`` writes; else a
        staging row, ``staged``). None where this pool writes loads otherwise (``scatter``, ``slots``, or a load of
        more experts than the staging rows)."""
        if self.writes == "host":
            views = self.host_views[layer]
            return [(views[s.tensor][slot], None) for expert, slot in placed for s in self.index.slices(layer, expert)]
        if self.writes == "staged" and len(placed) <= STAGING_ROWS:
            return [self.staging[s.tensor].claim(self.arrays) for expert, _ in placed
                    for s in self.index.slices(layer, expert)]
        return None

    def landed(self, layer: int, slot: int, tensor, source: Optional[mx.array]) -> None:
        """``tensor``'s bytes have arrived in their landing buffer (``landings``): a staging row (``source``) is
        copied into ``slot``; bytes in the slot's own memory are placed already."""
        if source is not None:
            self.arrays[layer][tensor.tensor][slot] = source
            self.staging[tensor.tensor].written.add(layer)

    def release(self, layer: int, experts: Sequence[int]) -> None:
        """``experts``, assigned slots whose bytes did not all arrive, are not resident after all."""
        self.book.release(layer, experts)
        self._device[layer].clear()
        self.complete = False

    def _choose_writes(self) -> str:
        """``host`` where the device computes in host memory and a probe write through a view of every pool array
        reaches it (then ``host_views`` holds the views); on a GPU with memory of its own ``scatter`` for small
        experts, ``staged`` for large ones where staging arrays can be viewed and advised; else ``slots``."""
        if computes_in_host_memory():
            views = {layer: {name: _host_view(a) for name, a in arrays.items()} for layer, arrays in self.arrays.items()}
            if all(v is not None for per in views.values() for v in per.values()):
                self.host_views = views
                return "host"
        if mx.default_device().type != mx.DeviceType.gpu:
            return "slots"
        if self.index.expert_bytes < SCATTER_BELOW:
            return "scatter"
        return "staged" if self._stage(advise=True) else "slots"

    def _stage(self, advise: bool) -> bool:
        """Make the staging rows of every expert tensor; whether each can be written through a view (and, with
        ``advise``, was advised to be read in place by the GPU). Where not, none is kept."""
        staging = {name: _StagingRows(name, dtype, shape) for name, (dtype, shape) in self.index.tensor_specs.items()}
        if all(rows.view is not None and (not advise or advise_read_in_place(rows.view))
               for rows in staging.values()):
            self.staging = staging
        return bool(self.staging)

    def use_writes(self, writes: str) -> None:
        """Write loads the ``writes`` way from now on (a bench or test comparing the ways on one backend)."""
        if writes not in WRITES:
            raise ValueError(f"writes must be one of {', '.join(WRITES)}, got {writes!r}")
        if writes == "host" and not self.host_views:
            raise ValueError("host writes need a backend whose arrays live in host memory")
        if writes == "staged" and not (self.staging or self._stage(advise=False)):
            raise ValueError("staged writes need arrays the host can write through a view")
        self.writes = writes

    def _write_batched(self, layer: int, placed: List[Tuple[int, int]], staged: Dict[int, list]) -> None:
        """One host array of all of ``placed``'s bytes (one copy to the device), then one scatter per expert
        tensor of its part (a view: no copy): 1 + tensors array operations per load, whatever its size."""
        arrays, n = self.arrays[layer], len(placed)
        slices = self.index.slices(layer, placed[0][0])
        offsets, at = [], 0
        for s in slices:  # each tensor's part starts aligned for its dtype
            offsets.append(at)
            at += -(-n * s.nbytes // _BLOCK_ALIGN) * _BLOCK_ALIGN
        host = np.empty(at, dtype=np.uint8)
        for t, (s, start) in enumerate(zip(slices, offsets)):  # one host copy of every byte
            for i, (expert, _) in enumerate(placed):
                host[start + i * s.nbytes:start + (i + 1) * s.nbytes] = staged[expert][t]
        device = mx.array(host)
        where = mx.array([slot for _, slot in placed])
        for s, start in zip(slices, offsets):
            part = device[start:start + n * s.nbytes].view(_MX_DTYPES[s.dtype]).reshape(n, *s.shape)
            arrays[s.tensor][where] = part


class _StagingRows:
    """One expert tensor's staging array (``staged`` writes): the host writes a row through a view, an array
    operation copies it into a pool slot; rows are taken in turn, and before the first is taken again the device
    runs every copy queued from them."""

    def __init__(self, name: str, dtype: str, shape: tuple):
        self.name = name
        self.array = _zeros((STAGING_ROWS, *shape), _MX_DTYPES[dtype], _O_DIRECT_ALIGNS)
        self.view = _host_view(self.array)
        self.used = 0
        self.written: Set[int] = set()  #: layers whose pool arrays took a copy from these rows since they were free

    def claim(self, arrays: Dict[int, Dict[str, mx.array]]) -> Tuple[np.ndarray, mx.array]:
        """The next row: its host view, to be written, and the row, to be copied into a pool array (one of
        ``arrays``) once written; the copy's layer goes into ``written``."""
        if self.used == STAGING_ROWS:
            mx.eval([arrays[written][self.name] for written in self.written])
            self.used, self.written = 0, set()
        self.used += 1
        return self.view[self.used - 1], self.array[self.used - 1]

    def put(self, buf: np.ndarray, arrays: Dict[int, Dict[str, mx.array]], layer: int) -> mx.array:
        """``buf`` in the next row, and that row (to be copied into ``layer``'s pool array, one of ``arrays``)."""
        view, row = self.claim(arrays)
        view[...] = buf
        self.written.add(layer)
        return row


def computes_in_host_memory() -> bool:
    """Whether MLX's default device computes in the host's memory (the CPU backend, Apple silicon's unified
    memory), so that an array made from host bytes is already where the device reads it; a GPU with memory of
    its own (CUDA) reads such an array from host memory when a kernel first touches it."""
    return mx.default_device().type == mx.DeviceType.cpu or mx.metal.is_available()


def numpy_exportable(array: mx.array) -> mx.array:
    """``array`` as NumPy can take it: bfloat16 (which NumPy lacks) viewed as uint16, the same bytes."""
    return array.view(mx.uint16) if array.dtype == mx.bfloat16 else array


def _host_view(array: mx.array) -> Optional[np.ndarray]:
    """A writable NumPy view of ``array``'s memory (evaluated, contiguous), one row of bytes per slot (its first
    axis), or None where a write through it does not reach the array (the buffer protocol gave a copy, or a
    layout other than the array's own)."""
    exported = numpy_exportable(array)
    mx.eval(exported)
    try:
        view = np.array(exported, copy=False)
    except (TypeError, ValueError, RuntimeError):
        return None
    if view.flags.owndata or not view.flags.c_contiguous or not view.flags.writeable or view.nbytes != array.nbytes:
        return None
    rows = view.reshape(array.shape[0], -1).view(np.uint8)
    probe = np.arange(1, rows.shape[1] + 1, dtype=np.uint8)
    rows[-1] = probe
    seen = np.array(numpy_exportable(array[-1])).reshape(-1).view(np.uint8)  # read back through the array itself
    rows[-1] = 0
    return rows if np.array_equal(seen, probe) else None
