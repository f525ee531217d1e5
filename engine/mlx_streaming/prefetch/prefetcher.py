"""Background prefetcher: worker threads read predicted experts' bytes into bounded host staging buffers.

Threads only read bytes (through the reader, whose native batch runs with the GIL released); the main
thread places ready experts into the pool when the MoE block acquires them (``take``). A request for an
expert already queued, being read or ready is merged into it. Staging memory (queued plus held bytes) never
exceeds ``staging_limit``: a request that would pass it is dropped. Whatever is left for a layer once that
layer has acquired its experts is stale and dropped (``drop_layer``). ``close()`` (and interpreter exit)
stops every thread.
"""

from __future__ import annotations

import atexit
import threading
import time
import weakref
from collections import OrderedDict, deque
from typing import List, Optional, Sequence, Tuple

from ..residency.stats import ResidencyStats
from ..errors import ExpertIOError

QUEUED, READING, READY, FAILED = "queued", "reading", "ready", "failed"
Key = Tuple[int, int]


class _Entry:
    __slots__ = ("state", "nbytes", "buffers", "error", "stale", "read_s")

    def __init__(self, nbytes: int):
        self.state, self.nbytes, self.buffers, self.error, self.stale = QUEUED, nbytes, None, None, False
        self.read_s = 0.0  #: seconds its read took on a worker thread


class Prefetcher:
    def __init__(self, index, reader, staging_limit: int, counters: ResidencyStats, threads: int = 2):
        """Counts into ``counters`` (the store's ``prefetch_*`` fields), under its own lock."""
        self.index, self.reader, self.staging_limit, self.counters = index, reader, staging_limit, counters
        self._entries: "OrderedDict[Key, _Entry]" = OrderedDict()
        self._queue: deque = deque()
        self._cv = threading.Condition()
        self._closed = False
        self.staging_bytes = 0
        self._threads = [threading.Thread(target=self._work, name=f"mlx-streaming-prefetch-{i}", daemon=True)
                         for i in range(threads)]
        for t in self._threads:
            t.start()
        atexit.register(_close_at_exit, weakref.ref(self))

    # ------------------------------------------------------------ main thread

    def submit(self, layer: int, experts: Sequence[int]) -> int:
        """Queue reads of ``experts`` of ``layer``; returns how many were queued (not merged or refused)."""
        queued = 0
        with self._cv:
            if self._closed:
                return 0
            for e in experts:
                key = (layer, int(e))
                if key in self._entries and not self._entries[key].stale:
                    self.counters.prefetch_merged += 1
                    continue
                nbytes = self.index.expert_bytes
                if self.staging_bytes + nbytes > self.staging_limit:
                    self.counters.prefetch_over_budget += 1
                    continue
                self._entries[key] = _Entry(nbytes)
                self._queue.append(key)
                self.staging_bytes += nbytes
                self.counters.prefetch_staging_peak = max(self.counters.prefetch_staging_peak, self.staging_bytes)
                self.counters.prefetch_submitted += 1
                queued += 1
            if queued:
                self._cv.notify_all()
        return queued

    def state(self, layer: int, expert: int) -> Optional[str]:
        with self._cv:
            entry = self._entries.get((layer, expert))
            return None if entry is None or entry.stale else entry.state

    def take(self, layer: int, expert: int) -> Optional[List]:
        """The expert's staged buffers, waiting for a read in progress; None if it was never submitted,
        is still queued (it is cancelled: the caller's demand read is as fast), or its read failed."""
        key = (layer, expert)
        with self._cv:
            entry = self._entries.get(key)
            if entry is None or entry.stale:
                return None
            if entry.state == QUEUED:
                self._discard(key, entry)
                return None
            waited = 0.0
            if entry.state == READING:
                self.counters.prefetch_waited += 1
                start = time.perf_counter()
                while entry.state == READING:
                    self._cv.wait()
                waited = time.perf_counter() - start
            buffers = entry.buffers
            self._discard(key, entry)
            if entry.state != READY:
                return None
            self.counters.prefetch_hits += 1
            self.counters.prefetch_read_s += entry.read_s
            self.counters.prefetch_hidden_s += max(0.0, entry.read_s - waited)
            return buffers

    def drop_layer(self, layer: int) -> None:
        """Discard what is left for ``layer`` (its MoE block has acquired its experts: the rest is stale)."""
        with self._cv:
            for key in [k for k in self._entries if k[0] == layer]:
                entry = self._entries[key]
                if entry.state == READING:
                    entry.stale = True  # the worker discards it when the read ends
                else:
                    self._discard(key, entry)
                self.counters.prefetch_dropped += 1

    def _discard(self, key: Key, entry: _Entry) -> None:
        if self._entries.get(key) is entry:
            del self._entries[key]
        if entry.state == QUEUED:
            self._queue.remove(key)
        self.staging_bytes -= entry.nbytes
        entry.nbytes = 0  # discarding twice (a failed read someone waited on) releases the bytes once
        entry.buffers = None

    def close(self) -> None:
        """Stop and join every worker; drop everything staged."""
        with self._cv:
            if self._closed:
                return
            self._closed = True
            self._cv.notify_all()
        for t in self._threads:
            t.join()
        with self._cv:
            for key, entry in list(self._entries.items()):
                self._discard(key, entry)

    @property
    def alive_threads(self) -> int:
        return sum(t.is_alive() for t in self._threads)

    # ------------------------------------------------------------ workers

    def _work(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                key = self._queue.popleft()
                entry = self._entries[key]
                entry.state = READING
            layer, expert = key
            slices = self.index.slices(layer, expert)
            start = time.perf_counter()
            try:
                buffers, error = self.reader.read([(s.path, s.offset, s.nbytes) for s in slices]), None
            except ExpertIOError as exc:
                buffers, error = None, exc
            with self._cv:
                entry.buffers, entry.error, entry.read_s = buffers, error, time.perf_counter() - start
                entry.state = READY if error is None else FAILED
                if error is None:
                    self.counters.prefetch_loads += 1
                else:
                    self.counters.prefetch_read_failures += 1
                if entry.stale or error is not None:
                    self._discard(key, entry)
                self._cv.notify_all()


def _close_at_exit(ref) -> None:
    prefetcher = ref()
    if prefetcher is not None:
        prefetcher.close()
