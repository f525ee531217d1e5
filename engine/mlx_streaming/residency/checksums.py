"""Byte-truth verification: the bytes that land in the pool are the bytes the checkpoint was written with.

Every expert placed into the pool is read back out of the MLX pool arrays and its CRC32C compared with a
reference. The reference is the checkpoint's checksum manifest where one covers the tensor (taken when the
checkpoint was written: corruption on disk since then is caught), else a checksum read from disk when the
verifier is built (a fault on the way from disk to the pool, or a shard changed after the build, is caught;
what was already corrupt at build is not). ``calls`` counts checks, so a report of ``bad == 0`` can show
that checks ran; ``from_manifest`` counts the expert tensors whose reference is a manifest.
"""

from __future__ import annotations

from typing import Dict, Tuple

import mlx.core as mx
import numpy as np

from ..checkpoint.experts import ExpertIndex
from ..checkpoint.manifest import ManifestChecksums, checksum_slices
from .pool import numpy_exportable
from .stats import ResidencyStats
from ..errors import StreamingError
from ..io.native import crc32c


class ExpertVerifyError(StreamingError):
    """An expert's bytes in the pool differ from its reference checksum."""


class ByteVerifier:
    def __init__(self, index: ExpertIndex, counters: ResidencyStats):
        self.index, self.counters = index, counters
        manifests = ManifestChecksums(index)
        self.manifests = manifests.folders
        self._expected: Dict[Tuple[int, int, str], Tuple[int, str]] = {}
        unlisted = []
        for layer in index.layers:
            for e in range(index.num_experts):
                for s in index.slices(layer, e):
                    crc = manifests.expected(s)
                    if crc is None:
                        unlisted.append((layer, e, s))
                    else:
                        self._expected[(layer, e, s.tensor)] = (crc, "the checksum manifest")
        self.from_manifest = len(self._expected)
        from_disk = checksum_slices(s for _, _, s in unlisted)
        for layer, e, s in unlisted:
            self._expected[(layer, e, s.tensor)] = (from_disk[s], "checksummed when the model was built")


    def check(self, layer: int, expert: int, pool: Dict[str, mx.array], slot: int) -> None:
        """Compare every tensor of ``expert`` in ``pool[...][slot]`` with its reference checksum."""
        self.counters.verify_calls += 1
        for s in self.index.slices(layer, expert):
            held = numpy_exportable(pool[s.tensor][slot])
            expected, reference = self._expected[(layer, expert, s.tensor)]
            if crc32c(memoryview(np.ascontiguousarray(np.array(held))).cast("B")) != expected:
                self.counters.verify_bad += 1
                raise ExpertVerifyError(
                    f"layer {layer} expert {expert} tensor {s.tensor}: the pool's bytes differ from {s.path} "
                    f"at offset {s.offset} ({s.nbytes} bytes) as {reference}"
                )
        self.counters.verify_ok += 1
