"""Byte-truth verification: the bytes that land in the pool are the bytes on disk.

Checksums (CRC32C, native or its Python twin) of every expert tensor are computed once, when the verifier is built, by a path that
shares nothing with the reader (buffered Python file objects, one read per tensor); every expert placed
into the pool is then read back out of the MLX pool arrays and checked. So a fault anywhere on the way (the
read, the dtype view, the slot write) or a shard changed on disk after indexing is caught. ``calls`` counts
checks, so a report of ``bad == 0`` can show that checks ran.
"""

from __future__ import annotations

from typing import Dict, Tuple

import mlx.core as mx
import numpy as np

from ..checkpoint.experts import ExpertIndex
from ..errors import StreamingError
from ..io.native import crc32c


class ExpertVerifyError(StreamingError):
    """An expert's bytes in the pool differ from its bytes on disk."""


def _crc(data) -> int:
    return crc32c(memoryview(data).cast("B"))


class ByteVerifier:
    def __init__(self, index: ExpertIndex):
        self.index = index
        self._expected: Dict[Tuple[int, int, str], int] = {}
        files = {}
        try:
            for layer in index.layers:
                for e in range(index.num_experts):
                    for s in index.slices(layer, e):
                        f = files.get(s.path) or files.setdefault(s.path, open(s.path, "rb"))
                        f.seek(s.offset)
                        self._expected[(layer, e, s.tensor)] = _crc(f.read(s.nbytes))
        finally:
            for f in files.values():
                f.close()
        self.calls = self.ok = self.bad = 0

    def reset_stats(self) -> None:
        self.calls = self.ok = self.bad = 0

    def stats(self) -> dict:
        return {"verify_calls": self.calls, "verify_ok": self.ok, "verify_bad": self.bad}

    def check(self, layer: int, expert: int, pool: Dict[str, mx.array], slot: int) -> None:
        """Compare every tensor of ``expert`` in ``pool[...][slot]`` with its checksum from disk."""
        self.calls += 1
        for s in self.index.slices(layer, expert):
            held = pool[s.tensor][slot]
            if held.dtype == mx.bfloat16:
                held = held.view(mx.uint16)
            if _crc(np.ascontiguousarray(np.array(held))) != self._expected[(layer, expert, s.tensor)]:
                self.bad += 1
                raise ExpertVerifyError(
                    f"layer {layer} expert {expert} tensor {s.tensor}: the pool's bytes differ from {s.path} "
                    f"at offset {s.offset} ({s.nbytes} bytes) as checksummed when the model was built"
                )
        self.ok += 1
