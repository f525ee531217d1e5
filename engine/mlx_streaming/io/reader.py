"""ExpertReader: batched positional reads of expert tensors into host buffers.

``buffered`` reads through the page cache. ``direct`` bypasses it: O_DIRECT on Linux, which needs the file
offset, the length and the buffer aligned, so a read where all three are multiples of 4096 (the packed layout's
records, read into the pool's rows or the reader's own block) goes straight into its buffer, and any other covers
the aligned superset of its range through a bounce buffer; F_NOCACHE on macOS, which needs no alignment. A
filesystem that refuses O_DIRECT (tmpfs, some network filesystems) falls back to buffered reads for that file
with one warning;
``effective_modes`` says what each file got. The reads of one call go to ``io.native.read_start`` together:
the native extension runs them on its own threads with the GIL released (or its Python twin, one by one),
and the caller takes their bytes in order as they arrive (``PendingRead``) or all at once (``read``).
"""

from __future__ import annotations

import errno
import os
import sys
import threading
import time
import warnings
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..config import IO_MODES, READ_THREADS
from ..errors import ConfigError, ExpertIOError
from . import native
from .native import ALIGN


class ExpertReader:
    def __init__(self, io_mode: str = "buffered", threads: int = READ_THREADS):
        """``threads``: native read threads per call (``bench --io`` varies it to find the disk's ceiling)."""
        if io_mode not in IO_MODES:
            raise ConfigError(f"io_mode must be one of {', '.join(IO_MODES)}, got {io_mode!r}")
        self.io_mode, self.threads = io_mode, threads
        #: Per path (as the caller names it): (fd, aligned reads).
        self._files: Dict[object, Tuple[int, bool]] = {}
        self.effective_modes: Dict[str, str] = {}
        #: System reads issued (after merging adjacent ranges).
        self.reads = 0
        self._lock = threading.Lock()

    def _file(self, path) -> Tuple[int, bool]:
        """(fd, whether its reads are aligned: O_DIRECT on Linux) of ``path``, opened once."""
        known = self._files.get(path)  # the common case, without the lock
        if known is not None:
            return known
        with self._lock:  # prefetch threads and the main thread share the reader
            known = self._files.get(path)
            if known is None:
                name = str(path)
                fd = self._open(name)
                aligned = self.effective_modes[name] == "direct" and sys.platform.startswith("linux")
                known = self._files[path] = (fd, aligned)
        return known

    def _open(self, path: str) -> int:
        mode = "buffered"
        try:
            if self.io_mode == "direct":
                try:
                    fd = self._open_direct(path)
                    mode = "direct"
                except OSError as exc:
                    if exc.errno not in (errno.EINVAL, errno.ENOTSUP):
                        raise
                    warnings.warn(f"{path}: the filesystem refuses cache-bypass reads; reading it through the page cache")
                    fd = os.open(path, os.O_RDONLY)
            else:
                fd = os.open(path, os.O_RDONLY)
        except OSError as exc:
            raise ExpertIOError(f"{path}: cannot open expert shard ({exc.strerror})") from None
        self.effective_modes[path] = mode
        return fd

    @staticmethod
    def _open_direct(path: str) -> int:
        """O_DIRECT (Linux) or F_NOCACHE (macOS) open; EINVAL means the filesystem refuses it."""
        return native.open_uncached(path)

    def _read_start(self, requests: Sequence[native.ReadRequest]):
        """The reads themselves, as a method so a test can inject faults beneath the error handling."""
        return native.read_start(requests, self.threads)

    def start(self, ranges: Sequence[tuple], into: Optional[Sequence[np.ndarray]] = None) -> "PendingRead":
        """Issue the reads of ``[(path, offset, nbytes), ...]`` as one batch and return at once; the result hands
        each range's bytes over in order as they arrive. Consecutive ranges that lie back to back in one file are
        fetched by one read (a packed expert is one read). With ``into`` (a writable uint8 buffer per range, of
        its length: where its bytes are to be placed) each range's bytes land there, a merged read's in its
        ranges' buffers in order, copied by the reading threads; else in one block the reader allocates."""
        spans = []  # (path, offset, nbytes, first range, end range)
        i = 0
        while i < len(ranges):
            path, offset, nbytes = ranges[i]
            j, end = i + 1, offset + nbytes
            while j < len(ranges) and ranges[j][1] == end and ranges[j][0] == path:
                end += ranges[j][2]
                j += 1
            spans.append((path, offset, end - offset, i, j))
            i = j
        files = [self._file(path) for path, *_ in spans]
        if into is None:
            buffers = _block([n for _, _, n, _, _ in spans],
                             [aligned and offset % ALIGN == 0 and n % ALIGN == 0
                              for (_, offset, n, _, _), (_, aligned) in zip(spans, files)])
        else:
            buffers = [list(into[first:end]) for *_, first, end in spans]
        requests = [(fd, offset, n, buffer, aligned)
                    for (_, offset, n, _, _), (fd, aligned), buffer in zip(spans, files, buffers)]
        pending = self._read_start(requests)
        self.reads += len(requests)
        return PendingRead(ranges, spans, buffers if into is None else None, pending, into)

    def read(self, ranges: Sequence[tuple]) -> List[np.ndarray]:
        """``[(path, offset, nbytes), ...]`` -> one uint8 array per range, in order, once all have arrived."""
        return self.start(ranges).take(len(ranges))

    def close(self) -> None:
        for fd, _ in self._files.values():
            os.close(fd)
        self._files.clear()


def _block(sizes: List[int], page_aligned: List[bool]) -> List[np.ndarray]:
    """One allocation, a uint8 view per size; the views marked ``page_aligned`` (O_DIRECT reads whose offset and
    length are multiples of ALIGN) start on an ALIGN boundary, so that their reads skip the bounce buffer."""
    starts, at = [], 0
    for n, aligned in zip(sizes, page_aligned):
        if aligned:
            at = -(-at // ALIGN) * ALIGN
        starts.append(at)
        at += n
    raw = np.empty(at + ALIGN, dtype=np.uint8)
    base = -raw.ctypes.data % ALIGN
    return [raw[base + start:base + start + n] for start, n in zip(starts, sizes)]


class PendingRead:
    """One batch of reads in flight (``ExpertReader.start``): ``take`` hands its ranges' bytes over in order."""

    def __init__(self, ranges: Sequence[tuple], spans: list, buffers: Optional[List[np.ndarray]], pending,
                 into: Optional[Sequence[np.ndarray]] = None):
        """``buffers``: one per span, where the ranges' bytes are not read ``into`` buffers of their own."""
        self._ranges, self._spans, self._buffers, self._pending, self._into = ranges, spans, buffers, pending, into
        #: Ranges handed over so far.
        self.taken = 0
        #: Seconds ``take`` blocked waiting for bytes.
        self.waited_s = 0.0
        self._span_of = [k for k, (*_, first, end) in enumerate(spans) for _ in range(first, end)]

    def arrived(self) -> int:
        """How many ranges, counted from the first, have all their bytes now (does not block)."""
        done = self._pending.finished()
        return self._spans[done - 1][4] if done else 0

    def take(self, upto: int) -> List[np.ndarray]:
        """The bytes of ranges [taken, upto), waiting for them where they have not arrived; a failed or short read
        among them raises ExpertIOError (its ``range_index``: the first range of the failed read)."""
        if upto <= self.taken:
            return []
        start = time.perf_counter()
        failure = self._pending.wait(self._span_of[upto - 1] + 1)
        self.waited_s += time.perf_counter() - start
        if failure is not None:
            k, err, got = failure
            path, offset, n, first, _ = self._spans[k]
            if err:
                error = ExpertIOError(f"{path}: read of {n} bytes at offset {offset} failed ({os.strerror(err)})")
            else:
                error = ExpertIOError(f"{path}: short read, {got} of {n} bytes at offset {offset}")
            error.range_index = first  # which of ``ranges`` failed (the caller knows whose bytes they are)
            raise error
        if self._into is not None:
            out = list(self._into[self.taken:upto])
        else:
            out = []
            for r in range(self.taken, upto):
                path, start_at, n = self._ranges[r]
                _, offset, *_ = self._spans[self._span_of[r]]
                out.append(self._buffers[self._span_of[r]][start_at - offset:start_at - offset + n])
        self.taken = upto
        return out

    def settle(self) -> None:
        """Wait until every read of the batch has finished, failed ones included (after a failure, before the
        buffers they write into are given to anything else)."""
        self._pending.wait(len(self._spans))

    @property
    def reads(self) -> int:
        """System reads the batch issued (a range, or adjacent ranges read at once)."""
        return len(self._spans)

    @property
    def in_place(self) -> int:
        """Of the finished reads, how many O_DIRECT put straight into their buffers (no bounce buffer)."""
        return self._pending.in_place

    @property
    def elapsed(self) -> float:
        """Seconds from the batch's start until its last read finished (once every range is taken)."""
        return self._pending.elapsed
