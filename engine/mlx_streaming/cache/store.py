"""ExpertStore: per MoE layer, pool arrays with ``capacity`` slots per expert tensor, filled from disk.

The pool arrays are what the streaming switch computes with; ``acquire`` makes the requested experts
resident and says which slot holds each. Bytes are read before any slot changes hands, so a failed read
leaves the pool as it was. Writing a slot (``pool[slot] = x``) updates the array in place because nothing
else holds its buffer between steps.
"""

from __future__ import annotations

import time
from typing import Dict, Iterable, List, Sequence

import mlx.core as mx
import numpy as np

from ..checkpoint.experts import ExpertIndex
from ..errors import ExpertIOError, PoolTooSmallError
from ..io.reader import ExpertReader
from .policy import LRUSlots

_NP_DTYPES = {"U32": np.uint32, "BF16": np.uint16, "F16": np.float16, "F32": np.float32}
_MX_DTYPES = {"U32": mx.uint32, "BF16": mx.bfloat16, "F16": mx.float16, "F32": mx.float32}


def _to_mx(buf: np.ndarray, dtype: str, shape: tuple) -> mx.array:
    arr = mx.array(buf.view(_NP_DTYPES[dtype]).reshape(shape))
    return arr.view(mx.bfloat16) if dtype == "BF16" else arr


class ExpertStore:
    #: fastpath / fallback: layer calls whose routed experts were all resident / were not;
    #: grouped: layer calls that needed more experts than fit and ran in groups.
    #: demand_bytes: bytes of demand reads; read_s: seconds spent in them (demand_bytes / read_s is the
    #: engine's demand-load rate). ``stats()["bytes_read"]`` is every byte read from disk, prefetch included.
    #: host_syncs: the engine's own waits for the device on the forward path (routes brought to the host,
    #: one per MoE layer call, or one per forward when the miss check is deferred); sync_s: seconds in them.
    #: deferred_forwards / deferred_retries: forwards run with the deferred miss check / of those, rerun
    #: layer by layer because a routed expert was not resident.
    #: misses: experts not resident at acquire; prefetched: of those, placed from the prefetcher's staging
    #: (the rest were demand-loaded on the main thread); place_s: seconds placing bytes into the pool.
    COUNTERS = ("hits", "misses", "prefetched", "evictions", "demand_bytes", "read_s", "place_s", "fastpath",
                "fallback", "grouped", "host_syncs", "sync_s", "deferred_forwards", "deferred_retries")

    def __init__(self, index: ExpertIndex, reader: ExpertReader, capacity: int, top_k: int, record: bool = False,
                 verifier=None, prefetcher=None, predictor=None, miss_check: str = "token"):
        """``verifier`` (a ByteVerifier) checks every expert placed; ``prefetcher`` and ``predictor`` (both or
        neither) read predicted experts in the background: the store is built with every part it uses."""
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
        self.policies = {layer: LRUSlots(self.capacity) for layer in index.layers}
        self.record = record
        #: When a list, every layer call appends (layer, tokens in the call, distinct experts routed): the
        #: union-of-experts profile. Off (None) unless asked for.
        self.union_log = None
        self.verifier, self.prefetcher, self.predictor = verifier, prefetcher, predictor
        self.miss_check = miss_check
        #: Per layer, expert id -> slot on the device (non-resident experts point at slot 0); None when stale.
        self._tables: Dict[int, mx.array] = dict.fromkeys(index.layers)
        self.deferring = False
        self._deferred: List[tuple] = []
        self._defer_wait = 0  # forwards to run layer by layer before deferring again
        self._defer_backoff = 1
        self._routed = {layer: np.zeros(index.num_experts, dtype=np.int64) for layer in index.layers}
        self.reset_stats()

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for pool in self.pools.values() for a in pool.values())

    def reset_stats(self) -> None:
        for name in self.COUNTERS:
            setattr(self, name, 0)
        self.reader.reads = 0
        for part in (self.verifier, self.prefetcher, self.predictor and self.predictor.diagnostics):
            if part is not None:
                part.reset_stats()

    def stats(self) -> dict:
        counters = {name: getattr(self, name) for name in self.COUNTERS}
        counters["demand_loads"] = self.misses - self.prefetched
        counters["prefetch_bytes"] = self.prefetcher.prefetch_loads * self.index.expert_bytes if self.prefetcher else 0
        counters["bytes_read"] = self.demand_bytes + counters["prefetch_bytes"]
        if self.verifier is not None:
            counters.update(self.verifier.stats())
        if self.prefetcher is not None:
            counters.update({k if k.startswith("prefetch_") else f"prefetch_{k}": v
                             for k, v in self.prefetcher.stats().items()})
        return counters

    def to_host(self, array: mx.array) -> np.ndarray:
        """``array`` on the host: one counted, timed wait for the device."""
        start = time.perf_counter()
        host = np.array(array)
        self.host_syncs += 1
        self.sync_s += time.perf_counter() - start
        return host

    def _eval(self, arrays) -> None:
        """``mx.eval(arrays)``: one counted, timed wait for the device."""
        start = time.perf_counter()
        mx.eval(arrays)
        self.host_syncs += 1
        self.sync_s += time.perf_counter() - start

    def route(self, layer: int, routed: np.ndarray) -> List[int]:
        """Account one MoE layer call's routing (``routed``: expert ids per token); its distinct experts."""
        experts = [int(e) for e in np.unique(routed)]
        if self.union_log is not None:
            self.union_log.append((layer, routed.size // routed.shape[-1], len(experts)))
        policy = self.policies[layer]
        if all(policy.slot(e) is not None for e in experts):
            self.fastpath += 1
        else:
            self.fallback += 1
        return experts

    # ------------------------------------------------------------ the deferred miss check

    def begin_forward(self, tokens: int) -> bool:
        """Whether the forward about to run on ``tokens`` tokens defers its miss check: ``miss_check`` is
        "token", the call is short, and the last deferred forwards found their experts (after a retry the
        store waits 1, 2, 4 ... forwards, up to 64, before deferring again)."""
        if self.miss_check != "token" or tokens > 16 or self.deferring:
            return False
        if self._defer_wait:
            self._defer_wait -= 1
            return False
        self.deferring, self._deferred = True, []
        self.deferred_forwards += 1
        return True

    def defer(self, layer: int, indices: mx.array) -> mx.array:
        """Slots for ``indices`` from the device-side table; the routes are kept for ``end_forward``."""
        if self._tables[layer] is None:
            policy = self.policies[layer]
            self._tables[layer] = mx.array([policy.slot(e) or 0 for e in range(self.index.num_experts)], dtype=mx.int32)
        self._deferred.append((layer, indices))
        return self._tables[layer][indices]

    def end_forward(self, output: mx.array) -> bool:
        """Evaluate the deferred forward's ``output`` and routes (one sync); when every routed expert was
        resident account them as the layer-by-layer path would and return True; else change nothing and
        return False (the caller restores its caches and runs the forward again, layer by layer)."""
        routes, self._deferred, self.deferring = self._deferred, [], False
        start = time.perf_counter()
        mx.eval(output, [indices for _, indices in routes])
        hosted = [(layer, np.array(indices)) for layer, indices in routes]
        self.host_syncs += 1
        self.sync_s += time.perf_counter() - start
        if any(self.policies[layer].slot(int(e)) is None for layer, routed in hosted for e in np.unique(routed)):
            self.deferred_retries += 1
            self._defer_wait, self._defer_backoff = self._defer_backoff, min(64, 2 * self._defer_backoff)
            return False
        self._defer_backoff = 1
        for layer, routed in hosted:
            self.acquire(layer, self.route(layer, routed))
            self.layer_done(layer)
        return True

    def acquire(self, layer: int, experts: Sequence[int]) -> List[int]:
        """Make ``experts`` (distinct ids) resident in ``layer``'s pool; return their slots, in order."""
        policy = self.policies[layer]
        missing = [e for e in experts if policy.slot(e) is None]
        loose = sum(e not in policy.pinned for e in experts)
        if loose > self.capacity - len(policy.pinned):
            raise PoolTooSmallError(
                f"layer {layer}: {loose} unpinned experts needed at once, but the pool has "
                f"{self.capacity - len(policy.pinned)} unpinned slots (pool_slots={self.capacity})"
            )
        if self.record:
            self._routed[layer][list(experts)] += 1
        if self.predictor is not None:
            self.predictor.account(layer, experts, {e for e in experts if e not in missing}, self.prefetcher.state)
        self.hits += len(experts) - len(missing)
        for e in experts:
            policy.touch(e)
        if missing:
            self._load(layer, missing, protected=set(experts))
        return [policy.slot(e) for e in experts]

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
            self.read_s += time.perf_counter() - start
            for i, e in enumerate(demand):
                staged[e] = buffers[i * per_expert:(i + 1) * per_expert]
            self.demand_bytes += sum(s.nbytes for e in demand for s in slices[e])
        start = time.perf_counter()
        pool, policy = self.pools[layer], self.policies[layer]
        placed = []
        for expert in experts:
            slot, evicted = policy.place(expert, protected)
            self.evictions += evicted is not None
            for s, buf in zip(slices[expert], staged[expert]):
                pool[s.tensor][slot] = _to_mx(buf, s.dtype, s.shape)
            placed.append((expert, slot))
        self._tables[layer] = None
        self._eval(list(pool.values()))
        self.place_s += time.perf_counter() - start
        self.misses += len(experts)
        self.prefetched += len(experts) - len(demand)
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
        pinned = self.policies[layer].pinned
        loose = [e for e in experts if e not in pinned]
        room = self.capacity - len(pinned)
        chunks = [loose[i:i + room] for i in range(0, len(loose), room)] or [[]]
        chunks[0] = [e for e in experts if e in pinned] + chunks[0]
        return chunks

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
