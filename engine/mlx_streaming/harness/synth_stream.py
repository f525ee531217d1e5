"""Qwen3-Next-80B-A3B at full size, written as a stream: ``synth --preset qwen3-next-80b``.

The published config (``QWEN3_NEXT_80B``) in the public 4-bit MLX layout (what ``mlx_lm.convert -q`` writes:
4-bit group-64 affine, the 8-bit ``mlp.gate`` / ``shared_expert_gate`` of the model's ``quant_predicate``,
shards of at most 5 GB named and indexed as ``mlx_lm.utils.save_model`` names them), about 45 GB, written
on a machine with less memory than that. Nothing is quantized: the packed 4-bit (8-bit) words are drawn
uniformly and their scales and biases chosen so each weight dequantizes to zero mean and the standard
deviation the smaller presets give (``1 / sqrt(fan_in)``, embeddings 1, router rows ``4 / sqrt(fan_in)``
times an expert's popularity). Every tensor is written in blocks of at most ``BLOCK_BYTES`` along its first
axis, each block drawn from a seed derived from (seed, tensor name, block), straight into a safetensors file
whose header was written first: memory stays at a few blocks whatever the checkpoint's size, the same seed
gives byte-identical files, and a layer's bytes do not depend on how many layers are written (``--layers``).

The names, shapes and dtypes come from mlx-lm's own classes (``Model`` and the project's ``MTPHead``, built
lazily so nothing is allocated, then ``nn.quantize``-d by the plan the converter uses), so the files are what
``mlx_lm.load`` expects. Routing is not uniform: each MoE router row (one expert) is scaled by a popularity
drawn once per layer (``popularity``), so some experts are hot, as after training.
"""

from __future__ import annotations

import json
import struct
import sys
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import numpy as np

from ..checkpoint.tokenizer_files import write_byte_tokenizer
from ..errors import ConfigError

#: Qwen3-Next-80B-A3B's published config.json (Qwen/Qwen3-Next-80B-A3B-Instruct), beyond ``synth.BASE_CONFIG``.
QWEN3_NEXT_80B = dict(
    hidden_size=2048, num_hidden_layers=48, num_experts=512, num_experts_per_tok=10, moe_intermediate_size=512,
    shared_expert_intermediate_size=512, intermediate_size=5120, num_attention_heads=16, num_key_value_heads=2,
    head_dim=256, linear_num_value_heads=32, linear_num_key_heads=16, linear_key_head_dim=128,
    linear_value_head_dim=128, linear_conv_kernel_dim=4, vocab_size=151936, rope_theta=10000000,
    partial_rotary_factor=0.25, max_position_embeddings=262144, norm_topk_prob=True, mtp_num_hidden_layers=1,
    # published entries mlx-lm does not read
    bos_token_id=151643, eos_token_id=151645, initializer_range=0.02, output_router_logits=False,
    router_aux_loss_coef=0.001, use_cache=True, use_sliding_window=False, mtp_use_dedicated_embeddings=False,
)

#: mlx_lm.utils.MAX_FILE_SIZE_GB: the converter starts a new shard before one would pass 5 GiB.
SHARD_BYTES = 5 << 30
#: The most bytes of one tensor generated at once (rows of its first axis; one expert never straddles blocks).
BLOCK_BYTES = 4 << 20
GROUP_SIZE = 64
#: Router rows: std ``ROUTER_GAIN / sqrt(hidden)`` (as the smaller presets), times a popularity per expert.
ROUTER_GAIN = 4.0
#: Spread of the experts' popularity: ``exp(POPULARITY_SIGMA * N(0, 1))``, drawn per router.
POPULARITY_SIGMA = 0.25
#: Norm weights as the MLX layout holds them (``1 + w``): ``1 + NORM_STD * N(0, 1)``.
NORM_STD = 0.1

_NORMS = ("layernorm.weight", "norm.weight", "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight")


def sized_config(sizes: dict, layers: Optional[int] = None) -> dict:
    """The full config.json (before quantization) for ``sizes``, with ``layers`` decoder layers."""
    from .synth import BASE_CONFIG

    config = {**BASE_CONFIG, **sizes}
    if layers is not None:
        config["num_hidden_layers"] = layers
    n = config["num_hidden_layers"]
    interval = config["full_attention_interval"]
    if n < interval:
        raise ConfigError(f"--layers {n}: Qwen3-Next needs at least {interval} layers (every {interval}th layer is "
                          f"full attention, and mlx-lm's qwen3_next model needs one)")
    config["layer_types"] = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)]
    return config


# ----------------------------------------------------------------------------- what is written


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of the MLX layout: ``dtype`` U32 (packed) or BF16; ``bits`` of its module when quantized."""

    name: str
    dtype: str
    shape: tuple
    bits: int = 0

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * (4 if self.dtype == "U32" else 2)

    @property
    def is_expert(self) -> bool:
        return ".switch_mlp." in self.name


@dataclass
class StreamPlan:
    """Every file and its tensors in write order, decided before any byte is written."""

    config: dict  #: config.json as written (with its quantization block)
    files: Dict[str, List[TensorSpec]] = field(default_factory=dict)  #: shards in order, then mtp.safetensors

    @property
    def total_bytes(self) -> int:
        return sum(s.nbytes for specs in self.files.values() for s in specs)

    @property
    def shards(self) -> List[str]:
        return [name for name in self.files if name.startswith("model")]

    def tensor(self, name: str) -> TensorSpec:
        return next(s for specs in self.files.values() for s in specs if s.name == name)


def _specs(module, plan: Dict[str, dict], prefix: str) -> List[TensorSpec]:
    """The quantized layout of ``module`` (lazy: nothing is allocated) under ``plan``, as ``TensorSpec``s."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    nn.quantize(module, class_predicate=lambda p, m: plan.get(p, False))
    specs = []
    for name, value in tree_flatten(module.parameters()):
        base, _, part = name.rpartition(".")
        bits = plan[base]["bits"] if base in plan and part in ("weight", "scales", "biases") else 0
        specs.append(TensorSpec(prefix + name, "U32" if value.dtype == mx.uint32 else "BF16", tuple(value.shape), bits))
    return specs


def plan_checkpoint(config: dict, shard_bytes: int = SHARD_BYTES) -> StreamPlan:
    """The files ``write_checkpoint`` writes for ``config`` (from ``sized_config``): names, shapes, dtypes, bytes.

    Nothing is allocated: mlx-lm's ``Model`` and the ``MTPHead`` are built lazily, only their shapes are read.
    """
    from mlx_lm.models.qwen3_next import Model, ModelArgs

    from ..checkpoint.mtp_extract import MTP_FILE
    from ..checkpoint.quantize import BITS, quant_plan, quantization_block
    from ..mtp.head import MTPHead

    args = ModelArgs.from_dict(config)
    model = Model(args)
    plan = quant_plan(model, model.quant_predicate)
    main = _specs(model, plan, "")
    predicate = model.quant_predicate

    def with_bits(path, module):  # as checkpoint.mtp_extract.convert_mtp quantizes the head
        choice = predicate(path, module)
        return choice if isinstance(choice, dict) else {"group_size": GROUP_SIZE, "bits": BITS}

    head = MTPHead(args)
    mtp = _specs(head, quant_plan(head, with_bits), "mtp.")

    # mlx_lm.utils.make_shards, then save_model's names
    groups: List[List[TensorSpec]] = []
    size = 0
    for spec in main:
        if not groups or size + spec.nbytes > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(spec)
        size += spec.nbytes
    n = len(groups)
    names = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" if n > 1 else "model.safetensors" for i in range(n)]
    block = quantization_block(plan)
    written = {**config, "quantization": block, "quantization_config": block}
    return StreamPlan(written, {**dict(zip(names, groups)), MTP_FILE: mtp})


# ----------------------------------------------------------------------------- values


def _rng(seed: int, name: str, block: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, zlib.crc32(name.encode()), block])))


def _raw(rng: np.random.Generator, n: int, dtype) -> np.ndarray:
    """``n`` uniformly random values of unsigned ``dtype``, straight from the bit generator (GB/s)."""
    words = -(-n * np.dtype(dtype).itemsize // 8)
    return rng.bit_generator.random_raw(words).view(dtype)[:n]


def to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits (uint16), rounding to nearest even, as ``astype(mx.bfloat16)`` does."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    return ((u + (np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1)))) >> 16).astype(np.uint16)


def from_bf16(b: np.ndarray) -> np.ndarray:
    return (b.astype(np.uint32) << 16).view(np.float32)


def popularity(seed: int, router: str, experts: int) -> np.ndarray:
    """Each expert's router-row scale (lognormal): the hot experts of one layer."""
    rng = _rng(seed, router + ":popularity", 0)
    return np.exp(rng.standard_normal(experts, dtype=np.float32) * np.float32(POPULARITY_SIGMA))


def _quant_std(base: str, fan_in: int) -> float:
    if base.endswith("embed_tokens"):
        return 1.0
    if base.endswith("mlp.gate"):
        return ROUTER_GAIN / np.sqrt(fan_in)
    return 1.0 / np.sqrt(fan_in)


def _plain(name: str, shape: tuple, rng: np.random.Generator) -> np.ndarray:
    """float32 values of a tensor the converter leaves unquantized (norms, DeltaNet parameters, conv)."""
    normal = lambda std: rng.standard_normal(shape, dtype=np.float32) * np.float32(std)  # noqa: E731
    if name.endswith(_NORMS):
        return 1 + normal(NORM_STD)
    if name.endswith("A_log"):
        return np.log(rng.uniform(1, 16, shape)).astype(np.float32)
    if name.endswith("dt_bias"):
        return rng.uniform(0.5, 1.5, shape).astype(np.float32)
    if name.endswith("conv1d.weight"):  # (channels, kernel, 1): the original layout's fan-in is the kernel
        return normal(1.0 / np.sqrt(shape[1]))
    return normal(1.0 / np.sqrt(shape[-1]))


def _scales(spec: TensorSpec, seed: int, block: int, r0: int, shape: tuple) -> np.ndarray:
    """float32 scales of rows ``r0:r0 + shape[0]`` of ``spec`` (a ``.scales`` tensor, or a ``.biases`` one's)."""
    base = spec.name.rpartition(".")[0]
    levels = 1 << spec.bits
    q_std = np.sqrt((levels * levels - 1) / 12.0)  # of a uniform 0..levels-1
    rng = _rng(seed, base + ".scales", block)
    jitter = _raw(rng, int(np.prod(shape)), np.uint16).reshape(shape).astype(np.float32)
    scales = jitter * np.float32(0.2 / 65535) + np.float32(0.9)  # +-10% from group to group
    scales *= np.float32(_quant_std(base, spec.shape[-1] * GROUP_SIZE) / q_std)
    if base.endswith("mlp.gate"):
        hot = popularity(seed, base, spec.shape[0])[r0:r0 + shape[0]]
        scales *= hot.reshape((-1,) + (1,) * (len(shape) - 1))
    return scales


def tensor_blocks(spec: TensorSpec, seed: int) -> Iterator[np.ndarray]:
    """The bytes of ``spec`` as arrays (uint32 words, or uint16 bfloat16 bits) of whole rows of its first
    axis, at most ``BLOCK_BYTES`` (or one row) each; block ``b`` is drawn from seed (seed, name, b)."""
    if not spec.shape:
        yield to_bf16(_plain(spec.name, (), _rng(seed, spec.name, 0)))
        return
    rows = spec.shape[0]
    unit = max(1, BLOCK_BYTES // (spec.nbytes // rows))
    part = spec.name.rpartition(".")[2]
    for block, r0 in enumerate(range(0, rows, unit)):
        shape = (min(rows, r0 + unit) - r0,) + tuple(spec.shape[1:])
        if spec.bits and part == "weight":
            yield _raw(_rng(seed, spec.name, block), int(np.prod(shape)), np.uint32).reshape(shape)
        elif spec.bits and part == "scales":
            yield to_bf16(_scales(spec, seed, block, r0, shape))
        elif spec.bits and part == "biases":  # zero mean: bias = -(levels - 1) / 2 * scale, of the scale as stored
            mid = np.float32(((1 << spec.bits) - 1) / 2)
            yield to_bf16(-mid * from_bf16(to_bf16(_scales(spec, seed, block, r0, shape))))
        else:
            yield to_bf16(_plain(spec.name, shape, _rng(seed, spec.name, block)))


# ----------------------------------------------------------------------------- files


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
