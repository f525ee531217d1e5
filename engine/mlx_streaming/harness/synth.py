"""Synthetic Qwen3-Next checkpoints in the exact layout of the public MLX 4-bit conversions.

Weights are generated in the original (Hugging Face) convention, bf16, one tensor at a time from a seed
derived from (seed, tensor name), so the same seed gives byte-identical files whatever the layout.
``layout="hf"`` writes them as they are (per-expert keys, zero-centred norms, ``mtp.*`` inside the shards);
``layout="mlx"`` passes them through what mlx-lm's converter does (the model's own ``sanitize``, then 4-bit
group-64 quantization with 8-bit router gates) one layer at a time, so medium checkpoints never sit in RAM
whole, and writes the MTP head to ``mtp.safetensors`` with ``convert_mtp``.

``qwen3-next-80b`` is the published model's config at full size (about 45 GB): too big to generate as floats
and quantize, it is written by ``synth_stream`` (packed 4-bit words drawn directly, streamed to disk).
"""

from __future__ import annotations

import json
import sys
import zlib
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models.qwen3_next import Model, ModelArgs
from tqdm import tqdm

from ..errors import ConfigError
from ..mtp.head import MTPHead
from ..checkpoint.manifest import write_manifest
from ..checkpoint import MTP_FILE
from ..checkpoint.mtp_extract import convert_mtp
from ..checkpoint.output import fresh_folder, writer_metadata
from ..checkpoint.quantize import quant_plan, quantization_block, quantize_weights
from ..checkpoint.tokenizer_files import write_byte_tokenizer

LAYOUTS = ("mlx", "hf")
#: The line synth prints on stderr once it has begun writing into its folder.
STARTED = "mlx-streaming: synth: writing"

#: Size knobs per preset; everything else is Qwen3-Next-80B-A3B's config. ``shard_mb`` keeps several shards
#: even for the tiny model, so that multi-shard indexing is always exercised.
PRESETS = {
    "tiny": dict(hidden_size=256, num_hidden_layers=4, num_experts=32, num_experts_per_tok=4,
                 moe_intermediate_size=128, shared_expert_intermediate_size=128, intermediate_size=512,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                 linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=64,
                 linear_value_head_dim=64, shard_mb=4),
    "small": dict(hidden_size=512, num_hidden_layers=12, num_experts=128, num_experts_per_tok=8,
                  moe_intermediate_size=256, shared_expert_intermediate_size=256, intermediate_size=1024,
                  num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                  linear_num_value_heads=8, linear_num_key_heads=4, linear_key_head_dim=64,
                  linear_value_head_dim=64, shard_mb=64),
    "medium": dict(hidden_size=1024, num_hidden_layers=24, num_experts=128, num_experts_per_tok=8,
                   moe_intermediate_size=512, shared_expert_intermediate_size=512, intermediate_size=2048,
                   num_attention_heads=8, num_key_value_heads=2, head_dim=128,
                   linear_num_value_heads=16, linear_num_key_heads=8, linear_key_head_dim=64,
                   linear_value_head_dim=64, shard_mb=512),
}

#: Presets written by ``synth_stream`` (the MLX layout only): their full config.json sizes.
STREAMED = ("qwen3-next-80b",)
PRESET_NAMES = (*PRESETS, *STREAMED)

BASE_CONFIG = {
    "architectures": ["Qwen3NextForCausalLM"],
    "model_type": "qwen3_next",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "decoder_sparse_step": 1,
    "full_attention_interval": 4,
    "hidden_act": "silu",
    "linear_conv_kernel_dim": 4,
    "max_position_embeddings": 32768,
    "mlp_only_layers": [],
    "mtp_num_hidden_layers": 1,
    "norm_topk_prob": True,
    "partial_rotary_factor": 0.25,
    "rms_norm_eps": 1e-6,
    "rope_scaling": None,
    "rope_theta": 10000000,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}

#: Original-layout norm weights stored zero-centred (the model multiplies by ``1 + w``).
_ZERO_CENTRED = ("input_layernorm.weight", "post_attention_layernorm.weight", "q_norm.weight",
                 "k_norm.weight", "model.norm.weight", "mtp.norm.weight", "pre_fc_norm_embedding.weight",
                 "pre_fc_norm_hidden.weight")


def preset_config(preset: str, vocab_size: Optional[int] = None, layers: Optional[int] = None,
                  dtype: str = "bfloat16") -> dict:
    """config.json (before quantization) of ``preset``, with ``layers`` decoder layers instead of its own;
    ``layers`` below ``full_attention_interval`` (4) is refused: mlx-lm's model needs a full-attention layer.
    ``dtype`` other than bfloat16 (what is not packed stored as float32) is written for the streamed preset."""
    from .synth_plan import FLOAT_DTYPES, QWEN3_NEXT_80B, sized_config

    if preset not in PRESET_NAMES:
        raise ConfigError(f"preset must be one of {', '.join(PRESET_NAMES)}, got {preset!r}")
    if dtype not in FLOAT_DTYPES:
        raise ConfigError(f"dtype must be one of {', '.join(FLOAT_DTYPES)}, got {dtype!r}")
    if preset in STREAMED:
        return sized_config(QWEN3_NEXT_80B, layers, dtype)
    if dtype != "bfloat16":
        raise ConfigError(f"--dtype {dtype}: written for preset {', '.join(STREAMED)} only; preset {preset} is "
                          f"bfloat16")
    sizes = {k: v for k, v in PRESETS[preset].items() if k != "shard_mb"}
    return sized_config({**sizes, "vocab_size": vocab_size}, layers)


def hf_tensor_specs(args: ModelArgs) -> List[Tuple[str, tuple]]:
    """Every original-layout tensor name and shape, main model then ``mtp.*``, in checkpoint order."""
    specs = []
    for prefix, module in (("", Model(args)), ("mtp.", MTPHead(args))):
        for name, value in tree_flatten(module.parameters()):
            name = prefix + name
            if ".switch_mlp." in name:
                for e in range(value.shape[0]):
                    specs.append((name.replace(".switch_mlp.", f".experts.{e}."), tuple(value.shape[1:])))
            elif name.endswith("conv1d.weight"):
                channels, kernel, _ = value.shape
                specs.append((name, (channels, 1, kernel)))
            else:
                specs.append((name, tuple(value.shape)))
    return specs


def init_value(name: str, shape: tuple, seed: int) -> np.ndarray:
    """Deterministic float32 values, scaled so a random model still gives varied text and routing."""
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    normal = lambda std: rng.standard_normal(shape, dtype=np.float32) * np.float32(std)  # noqa: E731
    if name.endswith(_ZERO_CENTRED):
        return normal(0.1)
    if name.endswith("linear_attn.norm.weight"):
        return 1 + normal(0.1)
    if name.endswith("A_log"):
        return np.log(rng.uniform(1, 16, shape)).astype(np.float32)
    if name.endswith("dt_bias"):
        return rng.uniform(0.5, 1.5, shape).astype(np.float32)
    if name.endswith("embed_tokens.weight"):
        return normal(1.0)
    if name.endswith("mlp.gate.weight"):
        # Experts differ in popularity (row norms), and routing is peaky: non-uniform, like a trained router.
        popularity = np.exp(rng.standard_normal((shape[0], 1), dtype=np.float32) * np.float32(0.5))
        return normal(4.0 / np.sqrt(shape[1])) * popularity
    return normal(1.0 / np.sqrt(shape[-1]))


def _chunks(specs: List[Tuple[str, tuple]], num_layers: int) -> Iterator[List[Tuple[str, tuple]]]:
    """One chunk per decoder layer; the embedding rides with layer 0, the final norm and lm_head with the
    last layer (so each chunk holds a MoE layer, which mlx-lm's ``sanitize`` needs to act), then ``mtp.*``."""
    by_layer: Dict[int, list] = {i: [] for i in range(num_layers)}
    mtp = []
    for name, shape in specs:
        if name.startswith("mtp."):
            mtp.append((name, shape))
        elif name.startswith("model.layers."):
            by_layer[int(name.split(".")[2])].append((name, shape))
        else:
            by_layer[0 if "embed_tokens" in name else num_layers - 1].append((name, shape))
    yield from by_layer.values()
    yield mtp


class _ShardWriter:
    """Writes tensors into ``model-0000i-of-0000n.safetensors`` files of about ``shard_bytes`` each."""

    def __init__(self, out_dir: Path, shard_bytes: int):
        self.out_dir, self.shard_bytes = out_dir, shard_bytes
        self.pending: Dict[str, mx.array] = {}
        self.parts: List[Tuple[Path, List[str]]] = []
        self.total = 0

    def add(self, weights: Dict[str, mx.array]) -> None:
        for name, value in weights.items():
            if self.pending and sum(v.nbytes for v in self.pending.values()) + value.nbytes > self.shard_bytes:
                self._flush()
            self.pending[name] = value
            self.total += value.nbytes

    def _flush(self) -> None:
        part = self.out_dir / f".part-{len(self.parts)}.safetensors"
        mx.save_safetensors(str(part), self.pending, metadata=writer_metadata("synth"))
        self.parts.append((part, list(self.pending)))
        self.pending = {}

    def finish(self) -> None:
        if self.pending:
            self._flush()
        n = len(self.parts)
        weight_map = {}
        for i, (part, names) in enumerate(self.parts):
            shard = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            part.rename(self.out_dir / shard)
            weight_map.update({name: shard for name in names})
        index = {"metadata": {"total_size": self.total}, "weight_map": dict(sorted(weight_map.items()))}
        (self.out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=4))


def synth_checkpoint(out_dir: Path, preset: str = "tiny", seed: int = 0, layout: str = "mlx",
                     layers: Optional[int] = None, dtype: str = "bfloat16") -> Path:
    """Write a synthetic checkpoint to ``out_dir`` and return it. ``out_dir`` must be new, empty, or written
    by this project earlier (then it is replaced whole, once the new one is complete); the mlx layout gets a
    checksum manifest of its experts. ``layers`` keeps every per-layer shape with that many decoder layers;
    ``dtype`` float32 stores what is not packed as float32 (the streamed preset only)."""
    if layout not in LAYOUTS:
        raise ConfigError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    config = preset_config(preset, layers=layers, vocab_size=0, dtype=dtype)  # refuses bad input first
    if preset in STREAMED:
        if layout != "mlx":
            raise ConfigError(f"layout {layout} is not written for preset {preset} (it would be "
                              f"{_hf_bytes(config) / 1e9:.0f} GB of bf16); only the mlx layout is")
        return _synth_streamed(Path(out_dir), preset, config, seed)
    with fresh_folder(out_dir, "synth") as partial:
        _started(out_dir, preset, layers)
        _write(partial, preset, seed, layout, layers)
        if layout == "mlx":
            from ..config import StreamingConfig
            from ..model import open_checkpoint

            write_manifest(open_checkpoint(partial, StreamingConfig(mtp=True)).index, partial, "synth")
    return Path(out_dir)


def _started(out_dir: Path, preset: str, layers: Optional[int]) -> None:
    shape = f"preset {preset}" + (f", {layers} layers" if layers else "")
    print(f"{STARTED} {Path(out_dir).absolute()} ({shape})", file=sys.stderr, flush=True)


def _hf_bytes(config: dict) -> int:
    from .synth_plan import plan_checkpoint

    plan = plan_checkpoint(config)
    return sum(int(np.prod(s.shape)) * 32 // s.bits * 2 if s.bits and s.name.endswith(".weight") else
               (0 if s.bits else s.nbytes) for specs in plan.files.values() for s in specs)


def _synth_streamed(out_dir: Path, preset: str, config: dict, seed: int) -> Path:
    from .synth_plan import plan_checkpoint
    from .synth_stream import say, write_checkpoint

    with fresh_folder(out_dir, "synth") as partial:
        size = plan_checkpoint(config).total_bytes
        _started(out_dir, preset, config["num_hidden_layers"])
        say(f"synth: {size / 1e9:.1f} GB, {config['num_hidden_layers']} layers, streamed in blocks of at most 4 MB")
        stats = write_checkpoint(partial, config, seed)
        say(f"synth: wrote {stats.bytes / 1e9:.2f} GB in {stats.files} files in {stats.seconds:.1f} s "
            f"({stats.gb_per_s:.2f} GB/s)")
    return out_dir


def _write(out_dir: Path, preset: str, seed: int, layout: str, layers: Optional[int] = None) -> None:
    vocab = write_byte_tokenizer(out_dir)
    config = preset_config(preset, vocab_size=-(-vocab // 64) * 64, layers=layers)
    args = ModelArgs.from_dict(config)
    template = Model(args)
    plan = quant_plan(template, template.quant_predicate)
    writer = _ShardWriter(out_dir, PRESETS[preset]["shard_mb"] << 20)

    chunks = list(_chunks(hf_tensor_specs(args), args.num_hidden_layers))
    for chunk in tqdm(chunks, desc=f"synth {preset}", unit="layer", disable=None):
        weights = {n: mx.array(init_value(n, s, seed)).astype(mx.bfloat16) for n, s in chunk}
        if layout == "hf":
            writer.add(weights)
        elif chunk[0][0].startswith("mtp."):
            mx.save_safetensors(str(out_dir / MTP_FILE), convert_mtp(weights, args), metadata=writer_metadata("synth"))
        else:
            writer.add(quantize_weights(template.sanitize(weights), plan))
        mx.eval(writer.pending)
    writer.finish()

    if layout == "mlx":
        block = quantization_block(plan)
        config.update(quantization=block, quantization_config=block)
    (out_dir / "config.json").write_text(json.dumps(config, indent=4))
