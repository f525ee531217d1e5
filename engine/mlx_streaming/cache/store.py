"""ExpertStore: per MoE layer, pool arrays with ``capacity`` slots per expert tensor, filled from disk.

The pool arrays are what the streaming switch computes with; ``acquire`` makes the requested experts
resident and says which slot holds each. Bytes are read before any slot changes hands, so a failed read
leaves the pool as it was. Writing a slot (``pool[slot] = x``) updates the array in place because nothing
else holds its buffer between steps.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Optional, Sequence

import mlx.core as mx
import numpy as np

from ..checkpoint.experts import ExpertIndex
from ..errors import ExpertIOError, PoolTooSmallError
from ..io.reader import ExpertReader
from .stats import ResidencyStats
from .policy import LRUSlots, expert_groups

#: A complete pool's forwards are counted in batches of this many (``_count_later``).
COUNT_EVERY = 64
#: Experts read per batch when ``fill`` makes a whole layer resident (bounds the host buffers of one read).
FILL_BATCH = 64

_NP_DTYPES = {"U32": np.uint32, "BF16": np.uint16, "F16": np.float16, "F32": np.float32}
_MX_DTYPES = {"U32": mx.uint32, "BF16": mx.bfloat16, "F16": mx.float16, "F32": mx.float32}


def _flat(routes: List[tuple]) -> mx.array:
    """Every route of ``routes`` ((layer, indices) pairs) in one lazy array, in order."""
    return mx.concatenate([indices.reshape(-1) for _, indices in routes]) if routes else mx.zeros((0,), mx.uint32)


def _to_mx(buf: np.ndarray, dtype: str, shape: tuple) -> mx.array:
    arr = mx.array(buf.view(_NP_DTYPES[dtype]).reshape(shape))
    return arr.view(mx.bfloat16) if dtype == "BF16" else arr


@dataclass
class QueuedCheck:
    """A deferred forward whose miss check waits for ``ExpertStore.confirm``: its routes by layer, their
    concatenation (lazy), its output, and what restores the caches to before it."""

    routes: List[tuple]
    flat: mx.array
    output: mx.array
    restore: Callable[[], None]


def _distinct(routed: np.ndarray) -> List[int]:
    """The distinct expert ids of one layer call's routes, ascending (a set beats ``np.unique`` at these sizes)."""
    return sorted(set(routed.ravel().tolist()))


class ExpertStore:
    def __init__(self, index: ExpertIndex, reader: ExpertReader, capacity: int, top_k: int, record: bool = False,
                 verifier=None, prefetcher=None, predictor=None, prefetch_switch=None, miss_check: str = "token",
                 plant_s: float = 0.0, counters: Optional[ResidencyStats] = None):
        """``verifier`` (a ByteVerifier) checks every expert placed; ``prefetcher`` and ``predictor`` (both or
        neither) read predicted experts in the background, every forward or, with ``prefetch_switch`` (a
        ``PrefetchSwitch``), those it turns prefetch on for: the store is built with every part it uses, and
        with the one ``counters`` object they all count into."""
        if capacity < top_k:
            raise PoolTooSmallError(
                f"pool_slots={capacity} is below num_experts_per_tok={top_k}: one token needs {top_k} experts resident"
            )
        self.index, self.reader, self.top_k = index, reader, top_k
        self.capacity = min(capacity, index.num_experts)
        self.pools: Dict[int, Dict[str, mx.array]] = {
            layer: {
                name: mx.zeros((self.capacity, *shape), dtype=_MX_DTYPES[dtype])
                for name, (dtype, shape) in index.tensor_specs.items()
            }
            for layer in index.layers
        }
        mx.eval(self.pools)
        #: A pool with a slot for every expert keeps expert e in slot e: routes index it directly.
        self.identity_slots = self.capacity == index.num_experts
        self.policies = {layer: LRUSlots(self.capacity, self.identity_slots) for layer in index.layers}
        self.record = record
        #: When a list, every MoE layer call appends (layer, tokens in the call, its distinct experts, ascending):
        #: the routing trace (``cache.trace``) and the union-of-experts profile. Off (None) unless asked for.
        self.route_log = None
        self.verifier, self.prefetcher, self.predictor = verifier, prefetcher, predictor
        self.prefetch_switch, self.prefetching = prefetch_switch, prefetcher is not None
        self.counters = counters or ResidencyStats()
        self.miss_check = miss_check
        #: Test-only planted slowdown: CPU seconds burnt at the start of every forward (``plant``).
        self.plant_s = plant_s
        #: Per layer, expert id -> slot on the host (-1: not resident), kept with every placement and eviction:
        #: the rows of one table, so that one lookup checks every layer's routes. A route's key in the table
        #: flattened is ``_key_base[layer] + expert``: one number per (layer, expert), which the check both looks
        #: up and counts distinct.
        self._slot_table = np.full((len(index.layers), index.num_experts), -1, dtype=np.int32)
        self._slots = {layer: self._slot_table[row] for row, layer in enumerate(index.layers)}
        self._key_base = {layer: row * index.num_experts for row, layer in enumerate(index.layers)}
        #: The same on the device (non-resident experts point at slot 0), for deferred forwards; None when stale.
        self._tables: Dict[int, mx.array] = dict.fromkeys(index.layers)
        self.deferring = False
        self.in_forward = False  # a forward of the model is running (``adapters.switch_layers.run_forward``)
        self._deferred: List[tuple] = []
        #: Deferred forwards not yet confirmed, oldest first (``queueing``), and where ``queue`` puts new ones.
        self._queued: List[QueuedCheck] = []
        self._queue_into: Optional[list] = None
        #: Whether every expert of every layer is resident in a pool with a slot for each: then no forward can
        #: miss (``_count_later``). Set when loads fill the last slot; a pool with a slot per expert never evicts.
        self.complete = False
        #: Forwards of a complete pool not yet counted, each its routes by layer (``_count_later``).
        self._uncounted: List[List[tuple]] = []
        #: Whether the forward running (``_missed``) and the one before it found a routed expert not resident.
        self._missed = self._previous_missed = False
        self._routed = {layer: np.zeros(index.num_experts, dtype=np.int64) for layer in index.layers}
        self.reset_stats()

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for pool in self.pools.values() for a in pool.values())

    def reset_stats(self) -> None:
        self._uncounted = []  # forwards before the reset: not counted
        self.counters.reset(self.prefetcher.staging_bytes if self.prefetcher else 0)
        self.reader.reads = 0
        if self.predictor is not None and self.predictor.diagnostics is not None:
            self.predictor.diagnostics.reset_stats()

    def stats(self) -> dict:
        """Every counter (``cache.stats.FIELDS``), and what follows from them: ``demand_loads``,
        ``prefetch_bytes``, ``bytes_read`` (every byte read from disk), ``read_calls`` (the reader's system
        reads), and ``verify_from_manifest`` / ``prefetch_staging_bytes`` where those parts exist."""
        self._count_uncounted()
        c = self.counters
        out = c.as_dict()
        out["demand_loads"] = c.misses - c.prefetched
        out["prefetch_bytes"] = c.prefetch_loads * self.index.expert_bytes
        out["bytes_read"] = c.demand_bytes + out["prefetch_bytes"]
        out["read_calls"] = self.reader.reads
        if self.verifier is not None:
            out["verify_from_manifest"] = self.verifier.from_manifest
        if self.prefetcher is not None:
            out["prefetch_staging_bytes"] = self.prefetcher.staging_bytes
        return out

    def to_host(self, array: mx.array) -> np.ndarray:
        """``array`` on the host: one counted, timed wait for the device."""
        start = time.perf_counter()
        host = np.array(array)
        self.counters.host_syncs += 1
        self.counters.sync_s += time.perf_counter() - start
        return host

    def sync(self, arrays) -> None:
        """``mx.eval(arrays)``: one counted, timed wait for the device."""
        start = time.perf_counter()
        mx.eval(arrays)
        self.counters.host_syncs += 1
        self.counters.sync_s += time.perf_counter() - start

    def route(self, layer: int, routed: np.ndarray, experts: Optional[List[int]] = None) -> List[int]:
        """Account one MoE layer call's routing (``routed``: expert ids per token); its distinct experts
        (``experts``, where the caller has them already)."""
        start = time.perf_counter()
        experts = _distinct(routed) if experts is None else experts
        if self.route_log is not None:
            self.route_log.append((layer, routed.size // routed.shape[-1], experts))
        if self._resident(layer, experts):
            self.counters.fastpath += 1
        else:
            self.counters.fallback += 1
            self._missed |= self.in_forward
        self.counters.route_s += time.perf_counter() - start
        return experts

    def _resident(self, layer: int, experts: Sequence[int]) -> bool:
        slots = self._slots[layer]
        return all(slots[e] >= 0 for e in experts)

    # ------------------------------------------------------------ the deferred miss check

    def forward_starts(self, tokens: int) -> None:
        """A forward of the model on ``tokens`` tokens starts: the prefetch switch decides whether it prefetches,
        and the planted slowdown, if any, burns."""
        self._previous_missed, self._missed = self._missed, False
        if self.prefetch_switch is not None:
            self.prefetching = self.prefetch_switch.forward(tokens)
            self.counters.prefetch_off_forwards += not self.prefetching
        self.plant()

    def plant(self) -> None:
        """Burn ``plant_s`` CPU seconds of this thread (the perf gate's power study plants slowdowns with it; 0
        otherwise). The thread's own clock, not the process's: while MLX's compute thread runs beside it (a
        decode loop one step ahead), the process's clock would count that work too and end the burn early."""
        if self.plant_s:
            end = time.thread_time() + self.plant_s
            while time.thread_time() < end:
                pass

    def begin_forward(self, tokens: int) -> bool:
        """Whether the forward about to run on ``tokens`` tokens defers its miss check: ``miss_check`` is
        "token", the call is short, and the forward before it found every routed expert resident. After a miss
        the forwards run layer by layer (no forward is wasted on a check that fails) until one finds all its
        experts resident; the next defers again. A cold pool, where most tokens miss, so stays on the per-layer
        path, and a warm one goes back to deferring one forward after a rare miss."""
        if self.miss_check != "token" or tokens > 16 or self.deferring or self._previous_missed:
            return False
        self.deferring, self._deferred = True, []
        self.counters.deferred_forwards += 1
        return True

    def defer(self, layer: int, indices: mx.array) -> mx.array:
        """Slots for ``indices`` from the device-side table (``indices`` themselves with identity slots); the
        routes are kept for ``end_forward``."""
        self._deferred.append((layer, indices))
        if self.identity_slots:
            return indices
        if self._tables[layer] is None:
            self._tables[layer] = mx.array(np.maximum(self._slots[layer], 0))
        return self._tables[layer][indices]

    def _close_forward(self) -> List[tuple]:
        """End the deferred forward: its routes by layer (lazy, nothing waited for)."""
        routes, self._deferred, self.deferring = self._deferred, [], False
        return routes

    def end_forward(self, output: mx.array) -> bool:
        """Evaluate the deferred forward's ``output`` and routes (one sync, one transfer of every layer's routes);
        when every routed expert was resident account them as the layer-by-layer path would and return True;
        else change nothing and return False (the caller restores its caches and runs the forward again, layer
        by layer). A complete pool's forward is counted later, with no wait (``_count_later``)."""
        routes = self._close_forward()
        return self._count_later(routes) or self._check(routes, _flat(routes), output)

    def _check(self, routes: List[tuple], flat: mx.array, output: mx.array) -> bool:
        start = time.perf_counter()
        mx.eval(output, flat)
        hosted = np.array(flat)
        self.counters.host_syncs += 1
        self.counters.sync_s += time.perf_counter() - start
        start = time.perf_counter()  # the miss check: one lookup of every route in the slot table
        keys = self._route_keys(routes, hosted)
        if not (self._slot_table.reshape(-1)[keys] >= 0).all():
            self.counters.route_s += time.perf_counter() - start
            self.counters.deferred_retries += 1
            self._missed = True
            return False
        if self._only_counted():
            self.counters.fastpath += len(routes)
            self._count_hits(keys)
            self.counters.route_s += time.perf_counter() - start
            return True
        self.counters.route_s += time.perf_counter() - start
        sizes = [indices.size for _, indices in routes]
        for (layer, indices), routed in zip(routes, np.split(hosted, np.cumsum(sizes)[:-1])):
            self.acquire(layer, self.route(layer, routed.reshape(indices.shape)))
            self.layer_done(layer)
        return True

    @property
    def counts_later(self) -> bool:
        """Whether forwards are kept to be counted later (``_count_later``): the pool is complete, the miss check
        is per token and nothing but the hit counters watches routes. Such a forward never runs again."""
        return self.complete and self.miss_check == "token" and self._only_counted()

    def _count_later(self, routes: List[tuple]) -> bool:
        """Where ``counts_later`` (no forward can miss), keep ``routes`` to be counted with others and return
        True; else False. Every ``COUNT_EVERY`` forwards the ones before the newest are
        counted: a decode loop has read their tokens back, so their routes are on the host's side already and
        counting them waits for nothing in flight (one concatenation on the device would queue behind the step
        in flight and wait for it)."""
        if not self.counts_later:
            return False
        self.counters.fastpath += len(routes)
        self._uncounted.append(routes)
        if len(self._uncounted) > COUNT_EVERY:
            self._count_uncounted(keep_newest=True)
        return True

    def count_call_later(self, layer: int, indices: mx.array) -> bool:
        """One MoE layer call outside a deferred forward (a long prefill, the MTP head): where ``_count_later``
        applies, kept for the bulk count as a forward of one layer, with no sync; else False."""
        return self._count_later([(layer, indices)])

    def _count_uncounted(self, keep_newest: bool = False) -> None:
        """Count the hits of the forwards ``_count_later`` kept (all, or all but the newest): every layer's
        distinct experts, per forward. Counted as one host sync, whether or not their routes were ready."""
        if not self._uncounted:
            return
        split = len(self._uncounted) - keep_newest
        forwards, self._uncounted = self._uncounted[:split], self._uncounted[split:]
        routes = [route for forward in forwards for route in forward]
        start = time.perf_counter()
        hosted = np.concatenate([np.array(indices).reshape(-1) for _, indices in routes])
        self.counters.host_syncs += 1
        self.counters.sync_s += time.perf_counter() - start
        start = time.perf_counter()
        offsets = [n * self._slot_table.size for n, forward in enumerate(forwards) for _ in forward]
        self._count_hits(self._route_keys(routes, hosted, offsets))
        self.counters.route_s += time.perf_counter() - start

    def _route_keys(self, routes: List[tuple], hosted: np.ndarray, offsets: Optional[List[int]] = None) -> np.ndarray:
        """One key per routed expert of ``routes`` (``hosted``: their expert ids, concatenated on the host): its
        (layer, expert)'s flat index in the slot table, plus its forward's offset (``offsets``, one per route)
        where several forwards are counted together, so that each forward's experts stay apart."""
        bases = np.array([self._key_base[layer] for layer, _ in routes])
        if offsets is not None:
            bases = bases + np.array(offsets)
        return np.repeat(bases, [indices.size for _, indices in routes]) + hosted

    def _count_hits(self, keys: np.ndarray) -> None:
        """A hit per distinct key: each layer's distinct experts, per forward (as ``acquire`` counts them)."""
        self.counters.hits += len(set(keys.tolist()))

    def _only_counted(self) -> bool:
        """Whether a forward whose routed experts were all resident changes nothing but the hit counters: a pool
        holding every expert (no recency to touch) with no recorder, route log, predictor or prefetcher; then
        its check accounts every layer at once instead of layer by layer."""
        return (self.identity_slots and not self.record and self.route_log is None and self.predictor is None
                and self.prefetcher is None)

    # ------------------------------------------------------------ checks queued by a decode loop one step ahead

    @contextmanager
    def queueing(self):
        """Forwards run inside leave their deferred check queued, to be ``confirm``-ed by the caller after it
        has queued the next step on the device; yields the list that receives each one's ``QueuedCheck``."""
        checks: List[QueuedCheck] = []
        self._queue_into = checks
        try:
            yield checks
        finally:
            self._queue_into = None

    def queue(self, output: mx.array, restore: Callable[[], None]) -> bool:
        """Close the deferred forward that gave ``output`` without waiting, when ``queueing``; False otherwise."""
        if self._queue_into is None:
            return False
        routes = self._close_forward()
        if self._count_later(routes):
            return True
        check = QueuedCheck(routes, _flat(routes), output, restore)
        self._queued.append(check)
        self._queue_into.append(check)
        return True

    def confirm(self, check: QueuedCheck) -> bool:
        """Check the oldest queued forward, as ``end_forward`` would. On a miss, wait for every queued forward
        (none may still read the pool when a slot is written), restore the caches to before ``check``, drop them
        all, and return False: the caller runs that step again, and its rerun goes layer by layer."""
        assert self._queued and self._queued[0] is check, "queued checks are confirmed oldest first"
        self._queued.pop(0)
        if self._check(check.routes, check.flat, check.output):
            return True
        self.drop_queued()
        check.restore()
        return False

    def drop_queued(self) -> None:
        """Wait for the queued forwards and forget them unchecked (a decode loop that stops one step ahead)."""
        if self._queued:
            mx.eval([check.output for check in self._queued])
            self.counters.dropped_forwards += len(self._queued)
            self._queued = []

    def acquire(self, layer: int, experts: Sequence[int]) -> List[int]:
        """Make ``experts`` (distinct ids) resident in ``layer``'s pool; return their slots, in order."""
        start = time.perf_counter()
        policy = self.policies[layer]
        pinned = policy.pinned
        loose = sum(e not in pinned for e in experts)
        if loose > self.capacity - len(pinned):
            raise PoolTooSmallError(
                f"layer {layer}: {loose} unpinned experts needed at once, but the pool has "
                f"{self.capacity - len(pinned)} unpinned slots (pool_slots={self.capacity})"
            )
        missing = policy.admit(experts)
        if self.record:
            self._routed[layer][list(experts)] += 1
        if self.predictor is not None:
            self.predictor.account(layer, experts, {e for e in experts if e not in missing}, self.prefetcher.state)
        self.counters.hits += len(experts) - len(missing)
        self.counters.route_s += time.perf_counter() - start
        if missing:
            self._load(layer, missing, protected=set(experts))
        slots = self._slots[layer]
        return [int(slots[e]) for e in experts]

    def _load(self, layer: int, experts: List[int], protected: set) -> None:
        """Take prefetched bytes from staging and read the rest in one batch, all before any slot changes
        hands (a failed read leaves the pool as it was); then place them."""
        staged = {}
        if self.prefetcher is not None:
            for expert in experts:
                buffers = self.prefetcher.take(layer, expert)
                if buffers is not None:
                    staged[expert] = buffers
        demand = [e for e in experts if e not in staged]
        slices = {e: self.index.slices(layer, e) for e in experts}
        if demand:
            start = time.perf_counter()
            ranges = [(s.path, s.offset, s.nbytes) for e in demand for s in slices[e]]
            per_expert = len(slices[demand[0]])
            try:
                buffers = self.reader.read(ranges)
            except ExpertIOError as exc:
                failed = demand[exc.range_index // per_expert]
                raise ExpertIOError(f"layer {layer} expert {failed}: {exc}") from None
            self.counters.read_s += time.perf_counter() - start
            for i, e in enumerate(demand):
                staged[e] = buffers[i * per_expert:(i + 1) * per_expert]
            self.counters.demand_bytes += sum(s.nbytes for e in demand for s in slices[e])
        start = time.perf_counter()
        pool, policy = self.pools[layer], self.policies[layer]
        placed = []
        slots = self._slots[layer]
        for expert in experts:
            slot, evicted = policy.place(expert, protected)
            if evicted is not None:
                self.counters.evictions += 1
                slots[evicted] = -1
            slots[expert] = slot
            for s, buf in zip(slices[expert], staged[expert]):
                pool[s.tensor][slot] = _to_mx(buf, s.dtype, s.shape)
            placed.append((expert, slot))
        self._tables[layer] = None
        self.complete = self.identity_slots and bool((self._slot_table >= 0).all())
        self.sync(list(pool.values()))
        self.counters.place_s += time.perf_counter() - start
        self.counters.misses += len(experts)
        self.counters.prefetched += len(experts) - len(demand)
        if self.verifier is not None:
            for expert, slot in placed:
                self.verifier.check(layer, expert, pool, slot)

    def close(self) -> None:
        """Stop the prefetcher's threads and close the reader's files."""
        if self.prefetcher is not None:
            self.prefetcher.close()
        self.reader.close()

    def before_layer(self, layer: int, x) -> None:
        """Decoder layer ``layer`` is about to run on ``x``: submit the predicted experts not resident (not in
        a forward that defers its miss check: it expects every expert resident, and predicting would sync)."""
        if self.deferring:
            return
        if layer == 0:
            self.predictor.start_forward(x.shape[1])
        if not self.prefetching:  # the prefetch switch turned it off for this forward
            return
        plan = self.predictor.predict(layer, x, self.to_host)
        if plan is None:
            return
        target, ranked = plan
        start = time.perf_counter()
        policy = self.policies[target]
        missing = self.predictor.within_budget([e for e in ranked if policy.slot(e) is None])
        accepted = self.prefetcher.submit(target, missing)
        self.predictor.submitted(target, missing, accepted, time.perf_counter() - start)

    def layer_done(self, layer: int) -> None:
        """``layer``'s MoE block has its experts: what is still staged for it is stale."""
        if self.prefetcher is not None:
            self.prefetcher.drop_layer(layer)

    def groups(self, layer: int, experts: Sequence[int]) -> List[List[int]]:
        """Split one call's distinct experts into groups that each fit the pool beside the pinned ones."""
        return expert_groups(experts, self.policies[layer].pinned, self.capacity)

    def fill(self) -> None:
        """Make every expert of every layer resident (``StreamingConfig.preload``): the pool must have a slot
        for each. The forwards that follow can miss nothing and are not checked (``_count_later``)."""
        if not self.identity_slots:
            raise PoolTooSmallError(f"preload needs a pool that holds every expert: pool_slots={self.capacity} of "
                                    f"{self.index.num_experts} experts per MoE layer")
        experts = range(self.index.num_experts)
        for layer in self.index.layers:
            for start in range(0, len(experts), FILL_BATCH):
                self.acquire(layer, experts[start:start + FILL_BATCH])

    def pin(self, layer: int, experts: Iterable[int]) -> None:
        """Load and keep ``experts`` forever; at least ``top_k`` slots must stay unpinned."""
        policy = self.policies[layer]
        experts = [int(e) for e in experts]
        total = len(policy.pinned | set(experts))
        if total > self.capacity - self.top_k:
            raise PoolTooSmallError(
                f"layer {layer}: pinning {total} experts leaves fewer than num_experts_per_tok={self.top_k} "
                f"of pool_slots={self.capacity} free"
            )
        self.acquire(layer, experts)
        for e in experts:
            policy.pin(e)

    def recorded_layers(self) -> List[int]:
        return [layer for layer, counts in self._routed.items() if counts.any()]

    def routed_counts(self, layer: int) -> np.ndarray:
        """How often each expert of ``layer`` was acquired while ``record`` was on."""
        return self._routed[layer].copy()

    def hot(self, layer: int, n: int) -> List[int]:
        """The ``n`` experts of ``layer`` most often acquired while ``record`` was on, hottest first."""
        counts = self._routed[layer]
        order = np.argsort(-counts, kind="stable")[:n]
        return [int(e) for e in order if counts[e] > 0]
