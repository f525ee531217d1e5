"""MissGuard: the per-forward miss check, which lets a forward run with no host sync inside it.

A forward of a few tokens whose forward before it found every routed expert resident runs deferred, while such
checks have been passing (``TRIAL_WINDOW``): each MoE layer takes its slots from the pool's device-side table and
keeps its routes; when the forward is done, one sync brings every layer's routes to the host and one lookup
checks them. If all were resident, they are accounted as the layer-by-layer path would account them; if not, the
caches are restored and the forward runs again (same ids, same counters). Where the check found one MoE layer's
experts missing, the forward runs again deferred, that layer loaded first: its routes are exact (every layer
before it computed over resident experts), so two waits serve a miss that layer by layer would wait at every MoE
layer for; where several layers missed (the routes after the first are only a hint), it runs again layer by
layer, the layers loaded so far taking their slots from the device's table. Inside ``queueing`` (a decode loop
one step ahead) the check is left queued, to be confirmed after the next step is queued on the device. On a
complete pool (every expert resident, nothing watching routes but the hit counters) no forward can miss: routes
are kept and counted in bulk (``bulk.BulkCount``), with no wait for the step in flight.
"""

from __future__ import annotations

import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, List, Optional

import mlx.core as mx
import numpy as np

from .bulk import BulkCount
from .pool import ExpertPool, flat_routes
from .stats import ResidencyStats

#: Forwards of more tokens than this check layer by layer: a rerun of a long prefill chunk would cost more
#: than the syncs it saves.
DEFERRED_TOKENS = 16
#: A deferred check pays only where it usually passes: a failed one throws its forward away (one step ahead, the
#: forward queued behind it too) and reruns it layer by layer, which costs more than a passing one saves. At a 25%
#: pool on the H100, where 12 of 22 such checks passed in 128 greedy tokens, decoding with deferral stopped ran
#: 1.06-1.17x as fast (two processes alternating both ways). The trials are the forwards that follow one whose
#: routed experts were all resident (those a deferral is tried on); while more than ``TRIAL_FAILURES`` of the last
#: ``TRIAL_WINDOW`` found an expert missing, they run layer by layer and still count as trials, so a pool that
#: comes to hold its working set goes back to deferring after a few passing forwards.
TRIAL_WINDOW = 8
TRIAL_FAILURES = 2


@dataclass
class QueuedCheck:
    """A deferred forward whose miss check waits for ``MissGuard.confirm``: its routes by layer, their
    concatenation (lazy), its output, and what restores the caches to before it."""

    routes: List[tuple]
    flat: mx.array
    output: mx.array
    restore: Callable[[], None]
    #: Whether the forward is a trial (not a rerun of one whose check failed).
    trial: bool


class MissGuard:
    def __init__(self, pool: ExpertPool, counters: ResidencyStats, miss_check: str,
                 account: Callable[[List[tuple], np.ndarray, np.ndarray], None], only_counted: Callable[[], bool],
                 load: Callable[[int, np.ndarray], None]):
        """``miss_check``: "forward" (defer where it can) or "layer" (never). ``account(routes, hosted, keys)``
        accounts a checked forward's routes as the per-layer path would (recency, hits, recording, prediction);
        ``only_counted()`` says whether nothing but the hit counters watches routes (then a complete pool's
        forwards are counted in bulk); ``load(layer, routed)`` routes and loads one MoE layer call as the per-layer
        path does."""
        self.pool, self.counters, self.miss_check = pool, counters, miss_check
        self._account, self._only_counted, self._load = account, only_counted, load
        #: Called with the forward's token count when a forward starts (the prefetch switch, or a planted
        #: slowdown a test injects).
        self.forward_hooks: List[Callable[[int], None]] = []
        self.deferring = False
        #: Inside ``run``'s outermost entry (read by the model's wrappers: an inner entry goes straight through).
        self.in_forward = False
        self._deferred: List[tuple] = []
        #: Deferred forwards not yet confirmed, oldest first (``queueing``), and where ``_queue`` puts new ones.
        self._queued: List[QueuedCheck] = []
        self._queue_into: Optional[list] = None
        #: Forwards of a complete pool, kept to be counted in bulk (``counts_later``).
        self.bulk = BulkCount(pool, counters)
        #: Whether the forward running and the one before it found a routed expert not resident.
        self._missed = self._previous_missed = False
        #: The one MoE layer a failed check found missing: (layer, its routes on the host, the forward's tokens),
        #: loaded when that forward runs again; and the layers so loaded in the running forward (accounted).
        self._resume: Optional[tuple] = None
        self.loaded: set = set()
        #: Outcomes of the last trials (True: every routed expert resident), and whether the running forward is
        #: a trial: deferred (checked at its end) or, where deferring does not pay, layer by layer.
        self._trials: deque = deque(maxlen=TRIAL_WINDOW)
        self._trial = self._trial_by_layer = False

    def run(self, tokens: int, call: Callable[[], mx.array],
            snapshot: Callable[[], Optional[Callable[[], None]]]) -> mx.array:
        """One forward of ``tokens`` tokens, ``call()``; ``snapshot()`` returns what restores the caches to now
        (None where they cannot be restored: then the forward checks layer by layer). Only the outermost entry
        counts (a model's call runs its decoder stack's)."""
        if self.in_forward:
            return call()
        self.in_forward = True
        try:
            self._previous_missed, self._missed, self.loaded = self._missed, False, set()
            for hook in self.forward_hooks:
                hook(tokens)
            if self.counts_later:  # no forward can miss: routes counted in bulk (a long forward's layer by layer)
                if not self._begin(tokens):
                    return call()
                out = call()
                self.bulk.keep(self._close())
                return out
            restore = snapshot()
            if restore is None:  # caches that cannot be restored: no rerun, so no deferral either
                return call()
            if not self._begin(tokens):
                return self._by_layer(call)
            while True:
                out = call()
                if self._queue(out, restore) or self._end(out):
                    return out
                restore()
                if not self._begin(tokens):  # deferred again only where one layer was missing
                    return call()
        finally:
            self.in_forward = False

    def _by_layer(self, call: Callable[[], mx.array]) -> mx.array:
        """``call()`` checked layer by layer; the outcome recorded where the forward is a trial."""
        out = call()
        if self._trial_by_layer:
            self._trials.append(not self._missed)
        return out

    def deferring_pays(self) -> bool:
        """Whether at most ``TRIAL_FAILURES`` of the last ``TRIAL_WINDOW`` trials found an expert missing."""
        return self._trials.count(False) <= TRIAL_FAILURES

    def note_miss(self) -> None:
        """A MoE layer call of the running forward routed to an expert not resident."""
        self._missed |= self.in_forward

    def _begin(self, tokens: int) -> bool:
        """Whether this forward defers its check: "forward" checks, a short call, the forward before it found
        every routed expert resident, and deferring pays (``deferring_pays``). After a miss forwards run layer by
        layer (none is wasted on a check that fails) until one finds all its experts resident: a cold pool stays
        on the per-layer path, a warm one goes back to deferring one forward after a rare miss, and one where
        such forwards often miss (a pool below its working set) stays on the per-layer path too."""
        self._trial = self._trial_by_layer = False
        if self.miss_check != "forward" or tokens > DEFERRED_TOKENS or self.deferring:
            return False
        if self._resume is not None:
            if not self._load_missed(tokens):
                return False
        elif self._previous_missed or self._missed:
            return False
        elif not self.deferring_pays():
            self._trial_by_layer = True
            return False
        else:
            self._trial = True
        self.deferring, self._deferred = True, []
        self.counters.deferred_forwards += 1
        return True

    def _load_missed(self, tokens: int) -> bool:
        """Load the layer a failed check found missing, if this forward is the one that check was of."""
        (layer, routed, of_tokens), self._resume = self._resume, None
        if of_tokens != tokens:
            return False
        self._load(layer, routed)
        self.loaded.add(layer)
        self._missed = False  # the forward itself has yet to miss
        self.counters.resumed_forwards += 1
        return True

    def defer(self, layer: int, indices: mx.array) -> mx.array:
        """Slots for ``indices`` in a deferred forward, with no sync; the routes are kept for the check."""
        self._deferred.append((layer, indices))
        return self.pool.device_slots(layer, indices)

    def _close(self) -> List[tuple]:
        routes, self._deferred, self.deferring = self._deferred, [], False
        return routes

    def _end(self, output: mx.array) -> bool:
        routes = self._close()
        return self._check(routes, flat_routes(routes), output, self._trial)

    def _check(self, routes: List[tuple], flat: mx.array, output: mx.array, trial: bool) -> bool:
        """Evaluate a deferred forward's ``output`` and routes (one sync); when every routed expert was resident,
        account them and return True; else change nothing and return False (the caller reruns it). The outcome
        of a ``trial`` is recorded."""
        start = time.perf_counter()
        mx.eval(output, flat)
        hosted = np.array(flat).reshape(-1)
        self.counters.host_syncs += 1
        self.counters.sync_s += time.perf_counter() - start
        start = time.perf_counter()
        keys = self.pool.keys(routes, hosted)
        resident = self.pool.all_resident(keys)
        self.counters.route_s += time.perf_counter() - start
        if trial:
            self._trials.append(resident)
        if not resident:
            self.counters.deferred_retries += 1
            self.counters.rerun_layer_calls += len(routes)
            self._missed = True
            self._resume = self._one_layer_missed(routes, hosted, keys)
        else:
            self._account(*self._unloaded(routes, hosted, keys))
        return resident

    def _one_layer_missed(self, routes: List[tuple], hosted: np.ndarray, keys: np.ndarray) -> Optional[tuple]:
        """(layer, its routes on the host, the forward's tokens) where one route of ``routes`` has experts not
        resident, else None."""
        missed = np.unique(_route_of_keys(routes)[~self.pool.resident_keys(keys)])
        if missed.size != 1:
            return None
        r = int(missed[0])
        sizes = [indices.size for _, indices in routes]
        start = sum(sizes[:r])
        layer, indices = routes[r]
        return layer, hosted[start:start + sizes[r]].reshape(indices.shape), indices.size // indices.shape[-1]

    def _unloaded(self, routes: List[tuple], hosted: np.ndarray, keys: np.ndarray) -> tuple:
        """``routes``, ``hosted`` and ``keys`` without the layers ``loaded`` (accounted when they were loaded)."""
        if not self.loaded:
            return routes, hosted, keys
        keep = np.array([layer not in self.loaded for layer, _ in routes], dtype=bool)[_route_of_keys(routes)]
        return [r for r in routes if r[0] not in self.loaded], hosted[keep], keys[keep]

    # ------------------------------------------------------------ a complete pool: counted later, in bulk

    @property
    def counts_later(self) -> bool:
        """Whether forwards are kept to be counted later: the pool is complete, the check is per forward and
        nothing but the hit counters watches routes. Such a forward never runs again."""
        return self.pool.complete and self.miss_check == "forward" and self._only_counted()

    def count_call_later(self, layer: int, indices: mx.array) -> bool:
        """One MoE layer call outside a deferred forward (a long prefill, the MTP head), counted later as a
        forward of one layer where ``counts_later``; else False."""
        if not self.counts_later:
            return False
        self.bulk.keep([(layer, indices)])
        return True

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

    def _queue(self, output: mx.array, restore: Callable[[], None]) -> bool:
        """Close the deferred forward that gave ``output`` without waiting, when ``queueing``; False otherwise."""
        if self._queue_into is None:
            return False
        routes = self._close()
        check = QueuedCheck(routes, flat_routes(routes), output, restore, self._trial)
        self._queued.append(check)
        self._queue_into.append(check)
        return True

    def confirm(self, check: QueuedCheck) -> bool:
        """Check the oldest queued forward. On a miss, wait for every queued forward (none may still read the
        pool when a slot is written), restore the caches to before ``check``, drop them all, and return False:
        the caller runs that step again, and its rerun goes layer by layer."""
        assert self._queued and self._queued[0] is check, "queued checks are confirmed oldest first"
        self._queued.pop(0)
        if self._check(check.routes, check.flat, check.output, check.trial):
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


def _route_of_keys(routes: List[tuple]) -> np.ndarray:
    """For each key of ``routes``' keys (``ExpertPool.keys``: every routed expert, route by route), its route's
    index in ``routes``."""
    return np.repeat(np.arange(len(routes)), [indices.size for _, indices in routes])
