"""safetensors headers -> tensor byte ranges, without reading any tensor.

The format: 8 bytes little-endian header length N, N bytes of JSON
(``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``), then the data;
offsets are relative to the end of the header.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Dict

from ..errors import CheckpointError

#: Bytes per element of every dtype a checkpoint of ours may hold.
DTYPE_SIZES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1,
    "U16": 2, "I16": 2, "F16": 2, "BF16": 2,
    "U32": 4, "I32": 4, "F32": 4,
    "U64": 8, "I64": 8, "F64": 8,
}

_MAX_HEADER = 100 << 20


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lies: ``path`` bytes ``[offset, offset + nbytes)``."""

    name: str
    path: Path
    dtype: str
    shape: tuple
    offset: int
    nbytes: int


def _raw_header(path: Path) -> tuple:
    """(header JSON object, byte where the data starts, file size), checked against the file's size."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, no header length)")
            (n,) = struct.unpack("<Q", head)
            if n > min(_MAX_HEADER, size - 8):
                raise CheckpointError(f"{path}: corrupt safetensors header (declares {n} header bytes, file has {size})")
            raw = f.read(n)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: shard file is missing") from None
    try:
        header = json.loads(raw)
        if not isinstance(header, dict):
            raise ValueError("header is not a JSON object")
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: corrupt safetensors header ({exc})") from None
    return header, 8 + n, size


def read_metadata(path: os.PathLike) -> Dict[str, str]:
    """A safetensors file's ``__metadata__`` (empty when it has none)."""
    metadata = _raw_header(Path(path))[0].get("__metadata__")
    return metadata if isinstance(metadata, dict) else {}


def read_header(path: os.PathLike) -> Dict[str, TensorInfo]:
    """Parse one shard's header and check it against the file's size."""
    path = Path(path)
    header, data_start, size = _raw_header(path)
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: corrupt safetensors header entry for tensor {name}") from None
        if dtype not in DTYPE_SIZES:
            raise CheckpointError(f"{path}: tensor {name} has unknown dtype {dtype}")
        count = 1
        for d in shape:
            count *= d
        if end - begin != count * DTYPE_SIZES[dtype] or begin < 0:
            raise CheckpointError(f"{path}: tensor {name} spans {end - begin} bytes, shape {list(shape)} {dtype} needs {count * DTYPE_SIZES[dtype]}")
        if data_start + end > size:
            raise CheckpointError(
                f"{path}: truncated shard: tensor {name} ends at byte {data_start + end}, file has {size}"
            )
        tensors[name] = TensorInfo(name, path, dtype, shape, data_start + begin, end - begin)
    return tensors


def read_checkpoint_headers(model_dir: os.PathLike) -> Dict[str, TensorInfo]:
    """Every tensor of a sharded checkpoint: the index's weight map, each named shard's header.

    A checkpoint without ``model.safetensors.index.json`` must be one ``model.safetensors``.
    """
    model_dir = Path(model_dir)
    index_path = model_dir / "model.safetensors.index.json"
    if index_path.exists():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (ValueError, KeyError) as exc:
            raise CheckpointError(f"{index_path}: not a safetensors index ({exc})") from None
        shards = sorted(set(weight_map.values()))
    else:
        weight_map = None
        shards = ["model.safetensors"]
        if not (model_dir / shards[0]).exists():
            raise CheckpointError(f"{model_dir}: no weights: neither {index_path.name} nor {shards[0]} is there")
    tensors = {}
    for shard in shards:
        shard_path = model_dir / shard
        if not shard_path.exists():
            raise CheckpointError(f"{shard_path}: shard named in {index_path.name} is missing")
        tensors.update(read_header(shard_path))
    if weight_map is not None:
        for name, shard in weight_map.items():
            if name not in tensors or tensors[name].path.name != shard:
                raise CheckpointError(f"{model_dir / shard}: the index places tensor {name} there, the shard lacks it")
    return tensors
