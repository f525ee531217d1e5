"""Pull ``mtp.*`` out of an original-layout (Hugging Face) checkpoint into its own quantized file.

mlx-lm's converter drops ``mtp.*``; this writes them in the form ``mtp.load_mtp`` reads: per-expert tensors
stacked into ``mtp.layers.0.mlp.switch_mlp.*``, zero-centred norms turned into ``1 + w`` exactly once, and
the same quantization as the main model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, Optional

import mlx.core as mx
from mlx_lm.models.qwen3_next import Model, ModelArgs

from ..errors import CheckpointError, MissingTensorError
from ..mtp.head import MTPHead, is_zero_centred
from .experts import ExpertIndex
from .manifest import write_manifest
from .output import fresh_file, writer_metadata
from .quantize import BITS, GROUP_SIZE, quant_plan, quantize_weights
from .safetensors import read_checkpoint_headers, read_header

#: The MTP layer's MoE block, as ``mtp.load_mtp`` and the engine name it.
MTP_PREFIX = "mtp.layers.0.mlp"
EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")


def convert_mtp(hf_weights: Dict[str, mx.array], args: ModelArgs, bits: Optional[int] = BITS,
                group_size: int = GROUP_SIZE) -> Dict[str, mx.array]:
    """Original-layout ``mtp.*`` tensors -> the MLX layout (still ``mtp.``-prefixed), quantized to ``bits``
    in groups of ``group_size`` (router gates 8-bit), or left bf16 when ``bits`` is None."""
    weights = {k.removeprefix("mtp."): v for k, v in hf_weights.items() if k.startswith("mtp.")}
    prefix = MTP_PREFIX.removeprefix("mtp.")
    for proj in EXPERT_PROJS:
        names = [f"{prefix}.experts.{e}.{proj}.weight" for e in range(args.num_experts)]
        missing = [n for n in names if n not in weights]
        if missing:
            raise MissingTensorError(f"mtp.{missing[0]}: expert tensor of the MTP layer is missing")
        weights[f"{prefix}.switch_mlp.{proj}.weight"] = mx.stack([weights.pop(n) for n in names])
    for name, value in weights.items():
        if is_zero_centred(name):
            weights[name] = value + 1.0
    if bits is None:
        return {f"mtp.{k}": v for k, v in weights.items()}
    template = MTPHead(args)
    predicate = Model(args).quant_predicate

    def with_bits(path, module):
        choice = predicate(path, module)
        return choice if isinstance(choice, dict) else {"group_size": group_size, "bits": bits}

    quantized = quantize_weights(weights, quant_plan(template, with_bits, group_size=group_size))
    return {f"mtp.{k}": v for k, v in quantized.items()}


def extract_mtp(hf_dir: Path, out_file: Path, bits: int = BITS, group_size: int = GROUP_SIZE) -> Path:
    """``mlx-streaming extract-mtp``: read the original checkpoint's ``mtp.*`` lazily, write ``out_file``."""
    hf_dir = Path(hf_dir)
    config_path = hf_dir / "config.json"
    if not config_path.exists():
        raise CheckpointError(f"{config_path}: missing (extract-mtp needs the original checkpoint's config)")
    config = json.loads(config_path.read_text())
    tensors = read_checkpoint_headers(hf_dir)
    shards = sorted({t.path for name, t in tensors.items() if name.startswith("mtp.")})
    if not shards:
        raise MissingTensorError(f"{hf_dir}: no mtp.* tensor in any shard")
    hf_weights = {}
    for shard in shards:
        hf_weights.update({k: v for k, v in mx.load(str(shard)).items() if k.startswith("mtp.")})
    args = ModelArgs.from_dict(config)
    weights = convert_mtp(hf_weights, args, bits, group_size)
    with fresh_file(out_file, "extract-mtp") as partial:
        mx.save_safetensors(str(partial), weights, metadata=writer_metadata("extract-mtp"))
    out_file = Path(out_file).absolute()
    tensors = read_header(out_file)
    switch = f"{MTP_PREFIX}.switch_mlp."
    names = [name.removeprefix(switch) for name in tensors if name.startswith(switch)]
    write_manifest(ExpertIndex(tensors, {args.num_hidden_layers: (switch[:-1], names)}), out_file.parent, "extract-mtp")
    return out_file
