"""ExpertReader: batched positional reads of expert tensors into host buffers.

``buffered`` reads through the page cache. ``direct`` bypasses it: O_DIRECT on Linux, which needs the file
offset, the length and the buffer aligned, so each read covers the aligned superset of the range through a
page-aligned bounce buffer; F_NOCACHE on macOS, which needs no alignment. A filesystem that refuses
O_DIRECT (tmpfs, some network filesystems) falls back to buffered reads for that file with one warning;
``effective_modes`` says what each file got. The reads of one call go to ``io.native.read_batch`` together:
the native extension runs them on its own threads with the GIL released (or its Python twin, one by one).
"""

from __future__ import annotations

import errno
import os
import sys
import threading
import warnings
from typing import Dict, List, Sequence

import numpy as np

from ..config import IO_MODES, READ_THREADS
from ..errors import ConfigError, ExpertIOError
from . import native


class ExpertReader:
    def __init__(self, io_mode: str = "buffered", threads: int = READ_THREADS):
        """``threads``: native read threads per call (``bench --io`` varies it to find the disk's ceiling)."""
        if io_mode not in IO_MODES:
            raise ConfigError(f"io_mode must be one of {', '.join(IO_MODES)}, got {io_mode!r}")
        self.io_mode, self.threads = io_mode, threads
        self._fds: Dict[str, int] = {}
        self.effective_modes: Dict[str, str] = {}
        #: System reads issued (after merging adjacent ranges).
        self.reads = 0
        self._lock = threading.Lock()

    def _fd(self, path) -> int:
        key = str(path)
        with self._lock:  # prefetch threads and the main thread share the reader
            fd = self._fds.get(key)
            if fd is None:
                fd = self._fds[key] = self._open(key)
        return fd

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

    def _read_batch(self, requests: Sequence[native.ReadRequest]) -> native.ReadFailure:
        """The reads themselves, as a method so a test can inject faults beneath the error handling."""
        return native.read_batch(requests, self.threads)

    def read(self, ranges: Sequence[tuple]) -> List[np.ndarray]:
        """``[(path, offset, nbytes), ...]`` -> one uint8 array per range, in order. Consecutive ranges that
        lie back to back in one file are fetched by one read (a packed expert is one read); all the reads of
        one call are issued as one batch."""
        spans = []  # (path, offset, nbytes, first range, end range)
        i = 0
        while i < len(ranges):
            path, offset, nbytes = ranges[i]
            j, end = i + 1, offset + nbytes
            while j < len(ranges) and ranges[j][0] == path and ranges[j][1] == end:
                end += ranges[j][2]
                j += 1
            spans.append((str(path), offset, end - offset, i, j))
            i = j
        buffers = [np.empty(n, dtype=np.uint8) for _, _, n, _, _ in spans]
        requests = [(self._fd(path), offset, n, buf, self._aligned(path))
                    for (path, offset, n, _, _), buf in zip(spans, buffers)]
        failure = self._read_batch(requests)
        self.reads += len(requests)
        if failure is not None:
            k, err, got = failure
            path, offset, n, first, _ = spans[k]
            if err:
                error = ExpertIOError(f"{path}: read of {n} bytes at offset {offset} failed ({os.strerror(err)})")
            else:
                error = ExpertIOError(f"{path}: short read, {got} of {n} bytes at offset {offset}")
            error.range_index = first  # which of ``ranges`` failed (the caller knows whose bytes they are)
            raise error
        out: List[np.ndarray] = []
        for (_, offset, _, first, end), data in zip(spans, buffers):
            for _, start, n in ranges[first:end]:
                out.append(data[start - offset:start - offset + n])
        return out

    def _aligned(self, path: str) -> bool:
        return self.effective_modes[path] == "direct" and sys.platform.startswith("linux")

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
