"""The native extension's entry points, or their pure-Python twins.

``mlx_streaming._native`` (sources in ``native/``) runs a batch of reads on its own pthread pool with the
GIL released (``read_start`` queues them and returns; the caller takes them in order as they finish), opens
files past the page cache and computes CRC32C. Each function here has a twin written
in Python with the same contract; ``MLX_STREAMING_NATIVE=0`` selects the twins, and so does a failed build
(said once, as a warning, at import). Tests run both and compare bytes.
"""

from __future__ import annotations

import atexit
import errno
import os
import sys
import time
import warnings
from typing import Optional, Sequence, Tuple

ALIGN = 4096
#: Pieces per ``preadv`` (at most IOV_MAX, 1024 on Linux and macOS).
IOV_BATCH = 256
#: fcntl's F_NOCACHE on macOS (not every Python's fcntl module names it).
F_NOCACHE = 48
#: ``(fd, offset, length, destination, aligned)``: the destination a writable buffer, or a list of them whose lengths
#: sum to the read's, filled in order (one read landing in several places); ``aligned`` (O_DIRECT, which needs
#: aligned offsets, lengths and memory) reads in place where the offset and every piece's address and length are
#: multiples of 4096, else the 4096-aligned superset of the range through a bounce buffer.
ReadRequest = Tuple[int, int, int, object, bool]
#: ``None``, or the first failing request's ``(index, errno, bytes delivered)``; errno 0 is a short read.
ReadFailure = Optional[Tuple[int, int, int]]


def _load_extension():
    if os.environ.get("MLX_STREAMING_NATIVE", "1") == "0":
        return None
    try:
        from .. import _native
    except ImportError as exc:
        warnings.warn(f"mlx_streaming._native is not available ({exc}); expert reads and checksums use the "
                      "pure-Python twins", RuntimeWarning, stacklevel=2)
        return None
    atexit.register(_native.shutdown)
    return _native


_native = _load_extension()
NATIVE = _native is not None


# ---------------------------------------------------------------- twins

def _crc32c_table():
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ (0x82F63B78 if c & 1 else 0)
        table.append(c)
    return table


_CRC_TABLE = _crc32c_table()


def py_crc32c(data, crc: int = 0) -> int:
    crc ^= 0xFFFFFFFF
    table = _CRC_TABLE
    for byte in memoryview(data).cast("B").tobytes():
        crc = (crc >> 8) ^ table[(crc ^ byte) & 0xFF]
    return crc ^ 0xFFFFFFFF


def py_open_uncached(path: str) -> int:
    if sys.platform.startswith("linux"):
        return os.open(path, os.O_RDONLY | os.O_DIRECT)
    fd = os.open(path, os.O_RDONLY)
    if sys.platform == "darwin":
        import fcntl

        try:
            fcntl.fcntl(fd, getattr(fcntl, "F_NOCACHE", F_NOCACHE), 1)
        except OSError:
            os.close(fd)
            raise
        return fd
    os.close(fd)
    raise OSError(errno.ENOTSUP, "no cache-bypass read on this platform", path)


def _pieces(destination, length: int) -> list:
    """A request's destination as byte views in order (one buffer: its first ``length`` bytes)."""
    if isinstance(destination, (list, tuple)):
        pieces = [memoryview(b).cast("B") for b in destination]
        if sum(len(p) for p in pieces) != length:
            raise ValueError(f"destination of {sum(len(p) for p in pieces)} bytes for a read of {length}")
        return pieces
    return [memoryview(destination).cast("B")[:length]]


def _fits_in_place(offset: int, pieces: list) -> bool:
    """Whether an aligned read can skip the bounce buffer: its offset and every piece's address and length are
    multiples of ALIGN."""
    import ctypes

    def address(piece):
        return ctypes.addressof(ctypes.c_char.from_buffer(piece)) if len(piece) else 0

    return offset % ALIGN == 0 and all(len(p) % ALIGN == 0 and address(p) % ALIGN == 0 for p in pieces)


def _read_pieces(fd: int, pieces: list, offset: int) -> int:
    """The pieces filled in order from ``offset``, in place: one ``preadv`` for them all, again from where a short
    one stopped; returns the bytes read."""
    got, k = 0, 0
    while k < len(pieces):
        n = os.preadv(fd, pieces[k:k + IOV_BATCH], offset + got)
        if n == 0:
            break
        got += n
        while k < len(pieces) and n >= len(pieces[k]):
            n -= len(pieces[k])
            k += 1
        if n:
            pieces[k] = pieces[k][n:]
    return got


#: Set once a read straight into a destination is refused with EFAULT (memory the kernel cannot read into
#: directly); aligned reads then all use the bounce buffer.
_in_place_refused = False


def _read_in_order(requests: Sequence[ReadRequest]) -> Tuple[ReadFailure, int]:
    """One request after another on the calling thread (``os.preadv`` releases the GIL while it reads); returns
    the first failure and how many aligned reads went straight into their destination."""
    global _in_place_refused
    import mmap

    bounce, in_place = None, 0
    try:
        for i, (fd, offset, length, destination, aligned) in enumerate(requests):
            pieces = _pieces(destination, length)
            try:
                got = None
                if not aligned:
                    got = _read_pieces(fd, pieces, offset)
                elif not _in_place_refused and _fits_in_place(offset, pieces):
                    try:
                        got = _read_pieces(fd, pieces, offset)
                        in_place += 1
                    except OSError as exc:  # read again through the bounce buffer
                        if exc.errno not in (errno.EINVAL, errno.EFAULT):
                            raise
                        _in_place_refused = exc.errno == errno.EFAULT  # the memory's; EINVAL may be this read's
                if got is None:  # the aligned superset through the bounce buffer, then copied into the pieces
                    start = offset - offset % ALIGN
                    span = -(-(offset + length - start) // ALIGN) * ALIGN
                    if bounce is None or len(bounce) < span:
                        bounce = mmap.mmap(-1, span)
                    raw = _read_pieces(fd, [memoryview(bounce)[:span]], start)
                    got = min(length, max(0, raw - (offset - start)))
                    at = offset - start
                    for piece in pieces:
                        n = min(len(piece), offset - start + got - at)
                        if n <= 0:
                            break
                        piece[:n] = bounce[at:at + n]
                        at += n
            except OSError as exc:
                return (i, exc.errno or errno.EIO, 0), in_place
            if got != length:
                return (i, 0, got), in_place
        return None, in_place
    finally:
        if bounce is not None:
            bounce.close()


class PyPendingReads:
    """The twin of the native ``PendingReads``: its reads ran, one by one, when it was made."""

    def __init__(self, requests: Sequence[ReadRequest]):
        start = time.perf_counter()
        #: the first failure; aligned reads that went straight into their destination (no bounce buffer)
        self._failure, self.in_place = _read_in_order(requests)
        self.elapsed = time.perf_counter() - start  #: seconds from the start until the last read finished
        self._n = len(requests)

    def wait(self, upto: int) -> ReadFailure:
        """None when requests [0, upto) each delivered their length, else the first failing one's failure."""
        failure = self._failure
        return failure if failure is not None and failure[0] < upto else None

    def finished(self) -> int:
        return self._n


def py_read_start(requests: Sequence[ReadRequest], threads: int = 1) -> PyPendingReads:
    return PyPendingReads(requests)


# ---------------------------------------------------------------- the chosen implementation

crc32c = _native.crc32c if NATIVE else py_crc32c
open_uncached = _native.open_uncached if NATIVE else py_open_uncached
read_start = _native.read_start if NATIVE else py_read_start
