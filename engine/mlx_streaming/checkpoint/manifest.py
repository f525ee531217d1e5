"""Checksum manifests: the CRC32C of every expert byte range, taken when the checkpoint was written.

With a manifest, ``--verify`` compares every expert placed into the pool with the bytes as they were
written, so corruption that happened on disk afterwards is caught; without one it can only compare with the
disk as it is when the model is built. One manifest per folder (``expert-checksums.json``), keyed by file
name and ``offset+nbytes``, with each file's size so that a replaced file is noticed. Ranges are read with
plain buffered file objects, a path that shares nothing with the expert reader.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Dict, Iterable, Optional

from ..errors import CheckpointError
from ..io.native import crc32c
from .experts import ExpertIndex, ExpertSlice

MANIFEST_FILE = "expert-checksums.json"
ALGORITHM = "crc32c"


def range_key(offset: int, nbytes: int) -> str:
    return f"{offset}+{nbytes}"


def checksum_slices(slices: Iterable[ExpertSlice]) -> Dict[ExpertSlice, int]:
    """CRC32C of each slice's bytes, read from disk by buffered file objects."""
    files, crcs = {}, {}
    try:
        for s in slices:
            f = files.get(s.path) or files.setdefault(s.path, open(s.path, "rb"))
            f.seek(s.offset)
            crcs[s] = crc32c(memoryview(f.read(s.nbytes)))
    finally:
        for f in files.values():
            f.close()
    return crcs


def _all_slices(index: ExpertIndex):
    return (s for layer in index.layers for e in range(index.num_experts) for s in index.slices(layer, e))


def read_manifest(folder: Path) -> Optional[dict]:
    """The manifest of ``folder``, or None when it has none."""
    path = Path(folder) / MANIFEST_FILE
    if not path.exists():
        return None
    try:
        manifest = json.loads(path.read_text())
        if manifest.get("algorithm") != ALGORITHM or not isinstance(manifest.get("files"), dict):
            raise ValueError(f"not a {ALGORITHM} manifest")
        return manifest
    except ValueError as exc:
        raise CheckpointError(f"{path}: unreadable checksum manifest ({exc})") from None


def write_manifest(index: ExpertIndex, folder: Path, command: str) -> Path:
    """Checksum every expert range of ``index`` that lies in ``folder`` into the folder's manifest (entries
    of other files already there are kept; those of the files checksummed now are replaced)."""
    folder = Path(folder)
    mine = [s for s in _all_slices(index) if Path(s.path).parent.resolve() == folder.resolve()]
    files = (read_manifest(folder) or {}).get("files", {})
    fresh: Dict[str, dict] = {}
    for s, crc in checksum_slices(mine).items():
        name = Path(s.path).name
        entry = fresh.setdefault(name, {"size": Path(s.path).stat().st_size, "ranges": {}})
        entry["ranges"][range_key(s.offset, s.nbytes)] = crc
    files.update(fresh)
    path = folder / MANIFEST_FILE
    partial = folder / f".{MANIFEST_FILE}.partial-{os.getpid()}"
    partial.write_text(json.dumps({"algorithm": ALGORITHM, "written_by": f"mlx-streaming {command}",
                                   "files": dict(sorted(files.items()))}, indent=1))
    os.replace(partial, path)
    return path


class ManifestChecksums:
    """Expected checksums from the manifests of every folder ``index`` reads experts from.

    ``expected(slice)`` is None for a range no manifest covers. A file whose size differs from what its
    manifest recorded is refused here, at build, naming the file.
    """

    def __init__(self, index: ExpertIndex):
        self._files: Dict[Path, dict] = {}
        paths = {Path(s.path) for layer in index.layers for s in index.slices(layer, 0)}
        for folder in {p.parent for p in paths}:
            manifest = read_manifest(folder)
            if manifest is None:
                continue
            for path in (p for p in paths if p.parent == folder and p.name in manifest["files"]):
                entry = manifest["files"][path.name]
                if path.stat().st_size != entry["size"]:
                    raise CheckpointError(
                        f"{path}: {path.stat().st_size} bytes on disk, but {folder / MANIFEST_FILE} "
                        f"({manifest['written_by']}) recorded {entry['size']}: the file changed after it was checksummed")
                self._files[path] = entry["ranges"]

    @property
    def folders(self) -> list:
        return sorted({str(p.parent / MANIFEST_FILE) for p in self._files})

    def expected(self, s: ExpertSlice) -> Optional[int]:
        ranges = self._files.get(Path(s.path))
        return None if ranges is None else ranges.get(range_key(s.offset, s.nbytes))
