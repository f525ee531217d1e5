"""Qwen3-Next-80B-A3B at full size, written as a stream: ``synth --preset qwen3-next-80b``.

The published config in the public 4-bit MLX layout (what ``mlx_lm.convert -q`` writes: 4-bit group-64 affine,
the 8-bit ``mlp.gate`` / ``shared_expert_gate`` of the model's ``quant_predicate``, shards of at most 5 GB named
and indexed as ``mlx_lm.utils.save_model`` names them), about 45 GB, written on a machine with less memory than
that. What is written is planned first (``synth_plan``); each tensor's values are generated in blocks of at most
``synth_values.BLOCK_BYTES`` along its first axis (``synth_values``), straight into a safetensors file whose
header was written first: memory stays at a few blocks whatever the checkpoint's size.
"""

from __future__ import annotations

import json
import struct
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import numpy as np

from ..checkpoint.tokenizer_files import write_byte_tokenizer
from .synth_plan import SHARD_BYTES, StreamPlan, TensorSpec, plan_checkpoint
from .synth_values import tensor_blocks


def safetensors_header(specs: List[TensorSpec], metadata: dict) -> Tuple[bytes, Dict[str, int]]:
    """The file's first bytes (length, JSON padded to 8 bytes) and each tensor's offset in the file."""
    header, offsets, at = {"__metadata__": metadata}, {}, 0
    for s in specs:
        header[s.name] = {"dtype": s.dtype, "shape": list(s.shape), "data_offsets": [at, at + s.nbytes]}
        offsets[s.name] = at
        at += s.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    start = 8 + len(raw)
    return struct.pack("<Q", len(raw)) + raw, {n: start + o for n, o in offsets.items()}


def _ahead(items: Iterator, depth: int = 2) -> Iterator:
    """``items``, produced by a background thread at most ``depth`` ahead of the consumer: drawing the next
    blocks (numpy, GIL released) overlaps writing this one. An error in the thread is raised here; leaving
    early (an error or Ctrl-C in the consumer) stops the thread."""
    import queue
    import threading

    q: "queue.Queue" = queue.Queue(depth)
    stop = threading.Event()
    done = object()

    def put(item) -> bool:
        while not stop.is_set():
            try:
                q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for item in items:
                if not put((None, item)):
                    return
            put((None, done))
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            put((exc, None))

    thread = threading.Thread(target=produce, name="synth-blocks", daemon=True)
    thread.start()
    try:
        while True:
            try:
                exc, item = q.get(timeout=0.1)
            except queue.Empty:
                continue
            if exc is not None:
                raise exc
            if item is done:
                return
            yield item
    finally:
        stop.set()
        thread.join()


def _file_blocks(specs: List[TensorSpec], offsets: Dict[str, int], seed: int, name: str,
                 checksums: Optional[dict]) -> Iterator[memoryview]:
    """Every block of the file's tensors in order, each expert row's CRC32C recorded on the way."""
    from ..io.native import crc32c

    for spec in specs:
        at = offsets[spec.name]
        row = spec.nbytes // spec.shape[0] if spec.shape else spec.nbytes
        for values in tensor_blocks(spec, seed):
            data = memoryview(np.ascontiguousarray(values)).cast("B")
            if checksums is not None and spec.is_expert:
                for i in range(0, len(data), row):
                    checksums[(name, at + i, row)] = crc32c(data[i:i + row])
            at += len(data)
            yield data


def write_file(path: Path, specs: List[TensorSpec], seed: int, metadata: dict,
               checksums: Optional[Dict[Tuple[str, int, int], int]] = None,
               progress: Callable[[int], None] = lambda n: None) -> int:
    """Write one safetensors file tensor by tensor, block by block (drawn a few blocks ahead in a thread);
    record each expert row's CRC32C in ``checksums`` under (file name, offset, bytes). Returns its size."""
    head, offsets = safetensors_header(specs, metadata)
    with open(path, "wb") as f:
        f.write(head)
        for data in _ahead(_file_blocks(specs, offsets, seed, path.name, checksums)):
            f.write(data)
            progress(len(data))
    return path.stat().st_size


@dataclass
class WriteStats:
    bytes: int
    seconds: float
    files: int

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds else 0.0


def write_checkpoint(out_dir: Path, config: dict, seed: int = 0, shard_bytes: int = SHARD_BYTES,
                     manifest: bool = True) -> WriteStats:
    """Write ``config``'s checkpoint into the existing folder ``out_dir``, streaming (see the module's doc)."""
    from tqdm import tqdm

    from ..checkpoint.manifest import ALGORITHM, MANIFEST_FILE, range_key
    from ..checkpoint.output import writer_metadata

    start = time.perf_counter()
    plan = plan_checkpoint(config, shard_bytes)
    checksums: Dict[Tuple[str, int, int], int] = {}
    metadata = writer_metadata("synth")
    total = 0
    with tqdm(total=plan.total_bytes, unit="B", unit_scale=True, desc="synth", disable=None) as bar:
        for name, specs in plan.files.items():
            total += write_file(out_dir / name, specs, seed, metadata, checksums, bar.update)
    index = {"metadata": {"total_size": sum(s.nbytes for n in plan.shards for s in plan.files[n]),
                          "total_parameters": _parameters(plan)},
             "weight_map": dict(sorted((s.name, n) for n in plan.shards for s in plan.files[n]))}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=4))
    (out_dir / "config.json").write_text(json.dumps(plan.config, indent=4))
    write_byte_tokenizer(out_dir, config["vocab_size"])
    if manifest:
        _write_manifest(out_dir, checksums, ALGORITHM, MANIFEST_FILE, range_key)
    return WriteStats(total, time.perf_counter() - start, len(plan.files))


def _parameters(plan: StreamPlan) -> int:
    """As mlx_lm.utils.get_total_parameters counts them: a packed weight as its unpacked count."""
    n = 0
    for name in plan.shards:
        for s in plan.files[name]:
            part = s.name.rpartition(".")[2]
            count = int(np.prod(s.shape, dtype=np.int64))
            if s.bits and part == "weight":
                n += count * 32 // s.bits
            elif not (s.bits and part in ("scales", "biases")):
                n += count
    return n


def _write_manifest(out_dir: Path, checksums, algorithm, manifest_file, range_key) -> None:
    """``checkpoint.manifest.write_manifest``'s file, from the CRCs taken while writing (45 GB not read back).
    The index comes from the engine's own reading of the files just written, so it covers what it reads."""
    from ..checkpoint.manifest import checksum_slices
    from ..config import StreamingConfig
    from ..model import open_checkpoint

    index = open_checkpoint(out_dir, StreamingConfig(mtp=True)).index
    files: Dict[str, dict] = {}
    slices = [s for layer in index.layers for e in range(index.num_experts) for s in index.slices(layer, e)]
    missing = [s for s in slices if (Path(s.path).name, s.offset, s.nbytes) not in checksums]
    checksums = dict(checksums)
    for s, crc in checksum_slices(missing).items():  # none, unless a tensor's rows are not its experts
        checksums[(Path(s.path).name, s.offset, s.nbytes)] = crc
    for s in slices:
        name = Path(s.path).name
        entry = files.setdefault(name, {"size": Path(s.path).stat().st_size, "ranges": {}})
        entry["ranges"][range_key(s.offset, s.nbytes)] = checksums[(name, s.offset, s.nbytes)]
    (out_dir / manifest_file).write_text(json.dumps({"algorithm": algorithm, "written_by": "mlx-streaming synth",
                                                     "files": dict(sorted(files.items()))}, indent=1))


def say(text: str) -> None:
    print(f"mlx-streaming: {text}", file=sys.stderr, flush=True)
