"""The packed expert layout: per MoE layer one file in which each expert's tensors lie back to back in
one 4096-aligned record, so one read fetches a whole expert (the MLX layout needs one per stacked tensor,
nine for a quantized SwitchGLU). ``packed_index.json`` says where each tensor sits inside a record; dense weights stay where they are.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, Tuple

from tqdm import tqdm

from ..errors import CheckpointError
from ..io.native import ALIGN
from .experts import ExpertIndex
from .manifest import write_manifest
from .output import fresh_folder

INDEX_FILE = "packed_index.json"


def _record_layout(index: ExpertIndex) -> Tuple[Dict[str, int], int]:
    """Offset of each tensor inside an expert record, and the record's aligned size."""
    offsets, at = {}, 0
    for name in index.tensor_names:
        offsets[name] = at
        at += index.tensor_nbytes[name]
    return offsets, -(-at // ALIGN) * ALIGN


def repack(index: ExpertIndex, out_dir: Path) -> Path:
    """Write every layer's experts of ``index`` into ``out_dir`` in the packed layout, with a checksum
    manifest; return the index file. ``out_dir`` must be new, empty, or an earlier ``repack`` output."""
    with fresh_folder(out_dir, "repack") as partial:
        _write(index, partial)
        write_manifest(packed_index(index, partial), partial, "repack")
    return Path(out_dir).absolute() / INDEX_FILE


def _write(index: ExpertIndex, out_dir: Path) -> None:
    offsets, record = _record_layout(index)
    layers = {}
    for layer in tqdm(index.layers, desc="repack", unit="layer", disable=None):
        name = f"experts-layer{layer:03d}.bin"
        with open(out_dir / name, "wb") as out:
            for expert in range(index.num_experts):
                chunk = bytearray(record)
                for s in index.slices(layer, expert):
                    with open(s.path, "rb") as f:
                        f.seek(s.offset)
                        chunk[offsets[s.tensor]:offsets[s.tensor] + s.nbytes] = f.read(s.nbytes)
                out.write(chunk)
        layers[str(layer)] = name
    meta = {"align": ALIGN, "record_bytes": record, "num_experts": index.num_experts,
            "tensors": {n: {"offset": offsets[n], "nbytes": index.tensor_nbytes[n], "dtype": index.tensor_specs[n][0],
                            "shape": list(index.tensor_specs[n][1])} for n in index.tensor_names},
            "layers": layers}
    (out_dir / INDEX_FILE).write_text(json.dumps(meta, indent=2))


def packed_index(index: ExpertIndex, packed_dir: Path) -> ExpertIndex:
    """``index`` reading its experts from the packed layout in ``packed_dir`` (checked against ``index``)."""
    packed_dir = Path(packed_dir)
    path = packed_dir / INDEX_FILE
    try:
        meta = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing; make it with `mlx-streaming repack`") from None
    _, record = _record_layout(index)
    if sorted(meta["tensors"]) != sorted(index.tensor_names):
        raise CheckpointError(f"{path}: packs tensors {sorted(meta['tensors'])}, the checkpoint's experts have "
                              f"{sorted(index.tensor_names)}")
    for name in index.tensor_names:
        t = meta["tensors"][name]
        if (t["nbytes"], t["dtype"], tuple(t["shape"])) != (index.tensor_nbytes[name], *index.tensor_specs[name]):
            raise CheckpointError(f"{path}: tensor {name} is {t}, the checkpoint's is {index.tensor_specs[name]}")
    if meta["record_bytes"] != record or meta["num_experts"] != index.num_experts:
        raise CheckpointError(f"{path}: records of {meta['record_bytes']} bytes for {meta['num_experts']} experts, expected {record} for {index.num_experts}")
    placement = {}
    for layer in index.layers:
        file = packed_dir / meta["layers"].get(str(layer), "")
        if not file.is_file() or file.stat().st_size < record * index.num_experts:
            raise CheckpointError(f"{file}: packed experts of layer {layer} missing or truncated")
        placement[layer] = {n: (file, meta["tensors"][n]["offset"], record) for n in index.tensor_names}
    return index.relocated(placement)
