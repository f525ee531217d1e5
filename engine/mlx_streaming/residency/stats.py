"""ResidencyStats: every counter of one streaming model's expert residency, in one object.

The store, the prefetcher and the byte verifier each increment their own fields of the one object they are
built with; ``reset`` clears them all at once (``staging_peak`` restarts from what is staged now), and
``as_dict`` is what ``store.stats()`` reports. Each name has one meaning, given here.
"""

from __future__ import annotations

from typing import Iterable, List, Sequence

import numpy as np

#: name -> meaning. Integers unless the name ends in ``_s`` (seconds).
FIELDS = {
    "hits": "routed experts already resident at acquire",
    "misses": "routed experts not resident at acquire: each is placed into the pool (experts placed)",
    "prefetched": "of the misses, experts placed from the prefetcher's staging (the rest were demand-loaded)",
    "evictions": "resident experts evicted to make room",
    "demand_bytes": "bytes read on the main thread at acquire (demand reads)",
    "read_s": "seconds demand reads took, from their issue to their last byte (on the reader's threads, while the "
              "main thread waits for them or places the experts that arrived first)",
    "read_wait_s": "of the demand reads' seconds, those the main thread spent waiting for their bytes",
    "demand_reads": "system reads of demand loads (a range, or adjacent ranges read at once)",
    "reads_in_place": "of those, reads that O_DIRECT put straight into their buffers, with no bounce buffer (offset, "
                      "length and memory 4096-aligned)",
    "pool_writes": "writes into the pool's arrays: a host copy, a staging row's copy or a slot write of one placed "
                   "expert's tensor, or one scatter of a tensor of all the experts one load places",
    "place_s": "seconds placing bytes into the pool (host writes, or host arrays or staging rows and queued array "
               "writes, which run with the layer that computes over them)",
    "fastpath": "MoE layer calls whose routed experts were all resident",
    "fallback": "MoE layer calls with at least one routed expert not resident",
    "grouped": "MoE layer calls that routed to more experts than fit and ran in groups",
    "host_syncs": "the engine's waits for the device on the forward path: routes or predictions brought to the "
                  "host, expert groups evaluated, the deferred check, a preloaded pool's hit count (one per "
                  "bulk.COUNT_EVERY forwards of several tokens, and one at stats())",
    "sync_s": "seconds spent in those waits",
    "route_s": "seconds of host bookkeeping of routes: distinct experts, residency and miss checks, eviction-order touches, "
               "hit counts (not waits, reads or placement)",
    "deferred_forwards": "forwards run with the miss check deferred to their end",
    "deferred_retries": "of those, forwards whose check found a routed expert not resident (each is run again)",
    "resumed_forwards": "of those, forwards run again deferred, after loading the one MoE layer whose experts their "
                        "check found missing (the others: run again layer by layer)",
    "rerun_layer_calls": "MoE layer calls of deferred forwards whose check found a routed expert not resident: "
                         "computed, discarded, and run again",
    "dropped_forwards": "deferred forwards a decode loop queued one step ahead and dropped unchecked (after a "
                        "retry of the step before, or when it stopped)",
    "prefetch_submitted": "prefetch requests queued",
    "prefetch_merged": "prefetch requests for an expert already queued, being read or staged",
    "prefetch_over_budget": "prefetch requests refused because staging would pass its limit",
    "prefetch_loads": "expert reads the prefetcher's threads completed",
    "prefetch_hits": "acquires served from staging",
    "prefetch_waited": "of those, acquires that waited for a read still running",
    "prefetch_read_s": "seconds the prefetcher's threads spent reading the experts acquires then took from staging",
    "prefetch_hidden_s": "of those, seconds no acquire waited for (each read's time less the wait for it): read "
                         "time hidden behind compute",
    "prefetch_dropped": "stale staged entries discarded (queued, being read or read) and failed reads",
    "prefetch_read_failures": "prefetch reads that failed (the demand read then serves)",
    "prefetch_staging_peak": "most host bytes the prefetcher held at once",
    "prefetch_off_forwards": "forwards --prefetch auto ran without prefetch",
    "verify_calls": "experts checked by byte-truth verification",
    "verify_ok": "experts whose every tensor matched its reference checksum",
    "verify_bad": "experts with a tensor that did not",
}


class ResidencyStats:
    def __init__(self):
        self.reset()

    def reset(self, staging_now: int = 0) -> None:
        for name in FIELDS:
            setattr(self, name, 0.0 if name.endswith("_s") else 0)
        self.prefetch_staging_peak = staging_now

    def as_dict(self) -> dict:
        return {name: getattr(self, name) for name in FIELDS}


class RoutedCounts:
    """How often each expert of each MoE layer was acquired while recording (``StreamingConfig.record``)."""

    def __init__(self, layers: Iterable[int], num_experts: int):
        self._counts = {layer: np.zeros(num_experts, dtype=np.int64) for layer in layers}

    def add(self, layer: int, experts: Sequence[int]) -> None:
        self._counts[layer][list(experts)] += 1

    def layers(self) -> List[int]:
        """The layers with anything recorded."""
        return [layer for layer, counts in self._counts.items() if counts.any()]

    def of(self, layer: int) -> np.ndarray:
        return self._counts[layer].copy()

    def hot(self, layer: int, n: int) -> List[int]:
        """The ``n`` experts of ``layer`` most often acquired, hottest first."""
        counts = self._counts[layer]
        order = np.argsort(-counts, kind="stable")[:n]
        return [int(e) for e in order if counts[e] > 0]
