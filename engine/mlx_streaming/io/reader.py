"""ExpertReader: batched positional reads of expert tensors into host buffers.

``buffered`` reads through the page cache. ``direct`` bypasses it: O_DIRECT on Linux, which needs the file
offset, the length and the buffer aligned, so each read covers the aligned superset of the range into a
page-aligned bounce buffer; F_NOCACHE on macOS, which needs no alignment. A filesystem that refuses
O_DIRECT (tmpfs, some network filesystems) falls back to buffered reads for that file with one warning;
``effective_modes`` says what each file got. This is the pure-Python path; the native one keeps this seam.
"""

from __future__ import annotations

import errno
import mmap
import os
import sys
import warnings
from typing import Dict, List, Sequence

import numpy as np

from ..config import IO_MODES
from ..errors import ConfigError, ExpertIOError

ALIGN = 4096
#: fcntl's F_NOCACHE on macOS (not every Python's fcntl module names it).
F_NOCACHE = 48


class ExpertReader:
    def __init__(self, io_mode: str = "buffered"):
        if io_mode not in IO_MODES:
            raise ConfigError(f"io_mode must be one of {', '.join(IO_MODES)}, got {io_mode!r}")
        self.io_mode = io_mode
        self._fds: Dict[str, int] = {}
        self.effective_modes: Dict[str, str] = {}
        #: System reads issued (after merging adjacent ranges).
        self.reads = 0
        self._bounce = mmap.mmap(-1, ALIGN)

    def _fd(self, path) -> int:
        key = str(path)
        fd = self._fds.get(key)
        if fd is None:
            fd = self._fds[key] = self._open(key)
        return fd

    def _open(self, path: str) -> int:
        mode = "buffered"
        try:
            if self.io_mode == "direct" and sys.platform.startswith("linux"):
                try:
                    fd = self._open_direct(path)
                    mode = "direct"
                except OSError as exc:
                    if exc.errno != errno.EINVAL:
                        raise
                    warnings.warn(f"{path}: the filesystem refuses O_DIRECT; reading it through the page cache")
                    fd = os.open(path, os.O_RDONLY)
            else:
                fd = os.open(path, os.O_RDONLY)
                if self.io_mode == "direct" and sys.platform == "darwin":
                    import fcntl

                    fcntl.fcntl(fd, getattr(fcntl, "F_NOCACHE", F_NOCACHE), 1)
                    mode = "direct"
        except OSError as exc:
            raise ExpertIOError(f"{path}: cannot open expert shard ({exc.strerror})") from None
        self.effective_modes[path] = mode
        return fd

    @staticmethod
    def _open_direct(path: str) -> int:
        """O_DIRECT open; EINVAL means the filesystem refuses it."""
        return os.open(path, os.O_RDONLY | os.O_DIRECT)

    # The two system calls, as methods so a test can inject faults (EIO, short reads) beneath the real
    # error handling.
    @staticmethod
    def _pread(fd: int, nbytes: int, offset: int) -> bytes:
        return os.pread(fd, nbytes, offset)

    @staticmethod
    def _preadv(fd: int, buffer: memoryview, offset: int) -> int:
        return os.preadv(fd, [buffer], offset)

    def read(self, ranges: Sequence[tuple]) -> List[np.ndarray]:
        """``[(path, offset, nbytes), ...]`` -> one uint8 array per range, in order. Consecutive ranges that
        lie back to back in one file are fetched by one read (a packed expert is one read)."""
        out: List[np.ndarray] = []
        i = 0
        while i < len(ranges):
            path, offset, nbytes = ranges[i]
            j, end = i + 1, offset + nbytes
            while j < len(ranges) and ranges[j][0] == path and ranges[j][1] == end:
                end += ranges[j][2]
                j += 1
            data = self._read_one(str(path), offset, end - offset)
            self.reads += 1
            for _, start, n in ranges[i:j]:
                out.append(data[start - offset:start - offset + n])
            i = j
        return out

    def _read_one(self, path: str, offset: int, nbytes: int) -> np.ndarray:
        fd = self._fd(path)
        try:
            if self.effective_modes[path] == "direct" and sys.platform.startswith("linux"):
                return self._read_aligned(path, fd, offset, nbytes)
            data = self._pread(fd, nbytes, offset)
        except OSError as exc:
            raise ExpertIOError(f"{path}: read of {nbytes} bytes at offset {offset} failed ({exc.strerror})") from None
        if len(data) != nbytes:
            raise ExpertIOError(f"{path}: short read, {len(data)} of {nbytes} bytes at offset {offset}")
        return np.frombuffer(data, dtype=np.uint8)

    def _read_aligned(self, path: str, fd: int, offset: int, nbytes: int) -> np.ndarray:
        start = offset - offset % ALIGN
        span = -(-(offset + nbytes - start) // ALIGN) * ALIGN
        if len(self._bounce) < span:
            self._bounce.close()
            self._bounce = mmap.mmap(-1, span)
        got = self._preadv(fd, memoryview(self._bounce)[:span], start)
        if got < offset + nbytes - start:
            raise ExpertIOError(f"{path}: short read, {max(0, got - (offset - start))} of {nbytes} bytes at offset {offset}")
        return np.frombuffer(self._bounce, dtype=np.uint8, count=nbytes, offset=offset - start).copy()

    @property
    def staging_bytes(self) -> int:
        """Host memory held for reads (the O_DIRECT bounce buffer)."""
        return len(self._bounce)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._bounce.close()
