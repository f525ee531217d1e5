"""ExpertStore: makes routed experts resident. It owns the pool (``pool.ExpertPool``), the per-forward miss
check (``guard.MissGuard``) and the counters, and brings in the parts the model was built with: the reader,
the prefetcher and its predictor, the byte verifier.

``acquire`` makes the requested experts resident and says which slot holds each; the missing ones are read and
placed by ``loader.ExpertLoader``.
"""

from __future__ import annotations

import time
from typing import Callable, Iterable, List, Optional, Sequence

import mlx.core as mx
import numpy as np

from ..checkpoint.experts import ExpertIndex
from ..errors import PoolTooSmallError
from ..io.reader import ExpertReader
from .guard import MissGuard
from .loader import ExpertLoader
from .pool import ExpertPool
from .stats import ResidencyStats, RoutedCounts

#: Experts read per batch when ``fill`` makes a whole layer resident (bounds the host buffers of one read).
FILL_BATCH = 64


def _distinct(routed: np.ndarray) -> List[int]:
    """The distinct expert ids of one layer call's routes, ascending (a set beats ``np.unique`` at these sizes)."""
    return sorted(set(routed.ravel().tolist()))


class ExpertStore:
    def __init__(self, index: ExpertIndex, reader: ExpertReader, capacity: int, top_k: int, record: bool = False,
                 verifier=None, prefetcher=None, predictor=None, miss_check: str = "forward",
                 counters: Optional[ResidencyStats] = None, eviction: str = "lfu"):
        """``verifier`` (a ByteVerifier) checks every expert placed; ``prefetcher`` and ``predictor`` (both or
        neither) read predicted experts in the background (``prefetch.hooks``): the store is built with every
        part it uses, and with the one ``counters`` object they all count into."""
        if capacity < top_k:
            raise PoolTooSmallError(
                f"pool_slots={capacity} is below num_experts_per_tok={top_k}: one token needs {top_k} experts resident"
            )
        self.index, self.reader, self.top_k = index, reader, top_k
        self.pool = ExpertPool(index, capacity, eviction)
        self.capacity = self.pool.capacity
        self.counters = counters or ResidencyStats()
        self.guard = MissGuard(self.pool, self.counters, miss_check, self._account, self._only_counted, self._acquire_call)
        self.verifier, self.prefetcher, self.predictor = verifier, prefetcher, predictor
        self.loader = ExpertLoader(index, reader, self.pool, self.counters, prefetcher, verifier)
        #: Count every routed (layer, expert) at acquire, into ``routed``.
        self.record = record
        self.routed = RoutedCounts(index.layers, index.num_experts)
        #: When a list, every MoE layer call appends (layer, tokens in the call, its distinct experts, ascending):
        #: the routing trace (``residency.trace``) and the union-of-experts profile. Off (None) unless asked for.
        self.route_log = None
        #: Called after each of the store's waits for the device (the prefetch hooks submit the predictions
        #: queued before it, evaluated by then).
        self.wait_hooks: List[Callable[[], None]] = []
        self.reset_stats()

    def reset_stats(self) -> None:
        self.guard.bulk.forget()  # forwards before the reset: not counted
        self.counters.reset(self.prefetcher.staging_bytes if self.prefetcher else 0)
        self.reader.reads = 0
        if self.predictor is not None and self.predictor.diagnostics is not None:
            self.predictor.diagnostics.reset_stats()

    def stats(self) -> dict:
        """Every counter (``residency.stats.FIELDS``), and what follows from them: ``demand_loads``,
        ``prefetch_bytes``, ``bytes_read`` (every byte read from disk), ``read_calls`` (the reader's system
        reads), ``hidden_read_share`` (of the seconds spent reading the experts placed, on demand or by the
        prefetcher, the share no acquire waited for: the prefetcher's reads hidden behind compute, and the part of
        a demand read that ran while the experts read before it were placed), and ``verify_from_manifest`` /
        ``prefetch_staging_bytes`` where those parts exist."""
        self.guard.bulk.count()
        c = self.counters
        out = c.as_dict()
        out["demand_loads"] = c.misses - c.prefetched
        out["prefetch_bytes"] = c.prefetch_loads * self.index.expert_bytes
        out["bytes_read"] = c.demand_bytes + out["prefetch_bytes"]
        out["read_calls"] = self.reader.reads
        reading = c.read_s + c.prefetch_read_s
        hidden = c.prefetch_hidden_s + max(0.0, c.read_s - c.read_wait_s)
        out["hidden_read_share"] = hidden / reading if reading else 0.0
        if self.verifier is not None:
            out["verify_from_manifest"] = self.verifier.from_manifest
        if self.prefetcher is not None:
            out["prefetch_staging_bytes"] = self.prefetcher.staging_bytes
        return out

    def to_host(self, array: mx.array) -> np.ndarray:
        """``array`` on the host: one counted, timed wait for the device."""
        start = time.perf_counter()
        host = np.array(array)
        self._waited(start)
        return host

    def sync(self, arrays) -> None:
        """``mx.eval(arrays)``: one counted, timed wait for the device."""
        start = time.perf_counter()
        mx.eval(arrays)
        self._waited(start)

    def _waited(self, start: float) -> None:
        self.counters.host_syncs += 1
        self.counters.sync_s += time.perf_counter() - start
        for hook in self.wait_hooks:
            hook()

    def route(self, layer: int, routed: np.ndarray, experts: Optional[List[int]] = None) -> List[int]:
        """Account one MoE layer call's routing (``routed``: expert ids per token); its distinct experts
        (``experts``, where the caller has them already)."""
        start = time.perf_counter()
        experts = _distinct(routed) if experts is None else experts
        if self.route_log is not None:
            self.route_log.append((layer, routed.size // routed.shape[-1], experts))
        if self.pool.resident(layer, experts):
            self.counters.fastpath += 1
        else:
            self.counters.fallback += 1
            self.guard.note_miss()
        self.counters.route_s += time.perf_counter() - start
        return experts

    def groups(self, layer: int, experts: Sequence[int]) -> List[List[int]]:
        """One call's distinct experts in groups that each fit the pool (one group, unless they do not all fit:
        then the call is counted as grouped)."""
        groups = self.pool.groups(layer, experts)
        self.counters.grouped += len(groups) > 1
        return groups

    def _account(self, routes: List[tuple], hosted: np.ndarray, keys: np.ndarray) -> None:
        """A checked forward's routes (every routed expert resident; ``keys``: ``pool.keys`` of them), accounted
        as the per-layer path accounts them: where only recency and the hit counters watch, every layer at once;
        else layer by layer."""
        if self._only_recency():
            start = time.perf_counter()
            self.counters.fastpath += len(routes)
            self.counters.hits += self.pool.touch(keys)
            self.counters.route_s += time.perf_counter() - start
            return
        sizes = [indices.size for _, indices in routes]
        for (layer, indices), routed in zip(routes, np.split(hosted, np.cumsum(sizes)[:-1])):
            self._acquire_call(layer, routed.reshape(indices.shape))

    def _acquire_call(self, layer: int, routed: np.ndarray) -> None:
        """One MoE layer call's routes (``routed``, on the host) accounted and its experts made resident, as the
        per-layer path does."""
        self.acquire(layer, self.route(layer, routed))
        self.layer_done(layer)

    def _only_recency(self) -> bool:
        """Whether a forward whose routed experts were all resident changes nothing but the LRU order and the
        hit counters: no recorder, route log, predictor or prefetcher."""
        return not self.record and self.route_log is None and self.predictor is None and self.prefetcher is None

    def _only_counted(self) -> bool:
        """``_only_recency`` on a pool holding every expert (no recency to touch): only the hit counters."""
        return self.pool.identity and self._only_recency()

    def acquire(self, layer: int, experts: Sequence[int]) -> List[int]:
        """Make ``experts`` (distinct ids) resident in ``layer``'s pool; return their slots, in order."""
        start = time.perf_counter()
        book = self.pool.book
        pinned = book.pinned(layer)
        loose = sum(e not in pinned for e in experts)
        if loose > self.capacity - len(pinned):
            raise PoolTooSmallError(
                f"layer {layer}: {loose} unpinned experts needed at once, but the pool has "
                f"{self.capacity - len(pinned)} unpinned slots (pool_slots={self.capacity})"
            )
        missing = book.admit(layer, experts)
        if self.record:
            self.routed.add(layer, experts)
        if self.predictor is not None:
            self.predictor.account(layer, experts, {e for e in experts if e not in missing}, self.prefetcher.state)
        self.counters.hits += len(experts) - len(missing)
        self.counters.route_s += time.perf_counter() - start
        if missing:
            self.loader.load(layer, missing, protected=set(experts))
        slots = self.pool.slots[layer]
        return [int(slots[e]) for e in experts]

    def close(self) -> None:
        """Stop the prefetcher's threads and close the reader's files."""
        if self.prefetcher is not None:
            self.prefetcher.close()
        self.reader.close()

    # ------------------------------------------------------------ prefetch

    def layer_done(self, layer: int) -> None:
        """``layer``'s MoE block has its experts: what is still staged for it is stale."""
        if self.prefetcher is not None:
            self.prefetcher.drop_layer(layer)

    # ------------------------------------------------------------ whole-pool operations

    def fill(self) -> None:
        """Make every expert of every layer resident (``StreamingConfig.preload``): the pool must have a slot
        for each. The forwards that follow can miss nothing and are counted in bulk."""
        if not self.pool.identity:
            raise PoolTooSmallError(f"preload needs a pool that holds every expert: pool_slots={self.capacity} of "
                                    f"{self.index.num_experts} experts per MoE layer")
        experts = range(self.index.num_experts)
        for layer in self.index.layers:
            for start in range(0, len(experts), FILL_BATCH):
                self.acquire(layer, experts[start:start + FILL_BATCH])
                mx.eval(list(self.pool.arrays[layer].values()))  # each batch's host copies freed before the next

    def pin(self, layer: int, experts: Iterable[int]) -> None:
        """Load and keep ``experts`` forever; at least ``top_k`` slots must stay unpinned."""
        book = self.pool.book
        experts = [int(e) for e in experts]
        total = len(book.pinned(layer) | set(experts))
        if total > self.capacity - self.top_k:
            raise PoolTooSmallError(
                f"layer {layer}: pinning {total} experts leaves fewer than num_experts_per_tok={self.top_k} "
                f"of pool_slots={self.capacity} free"
            )
        self.acquire(layer, experts)
        for e in experts:
            book.pin(layer, e)
