"""load_mtp: the MTP head from ``mtp.safetensors`` (MLX layout, bf16 or already quantized)."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.qwen3_next import Model, ModelArgs
from mlx_lm.utils import infer_quant_config

from ..checkpoint.quantize import GROUP_SIZE, quant_plan
from ..checkpoint.safetensors import read_header
from ..errors import ConfigMismatchError
from .head import MTPHead


def load_mtp(model_config: dict, path, quantize: bool = True, lazy: bool = False) -> MTPHead:
    """Build the head for ``model_config`` and load ``path`` into it.

    A quantized file keeps the bits and group size it was written with (read off its shapes, as mlx-lm
    does); a bf16 file is quantized like the main model when ``quantize`` is true, else kept bf16. With
    ``lazy`` nothing is read yet (the streaming builder swaps the expert arrays out before evaluating).
    """
    path = Path(path)
    read_header(path)  # a clear error for a missing, truncated or corrupt file
    weights = {k.removeprefix("mtp."): v for k, v in mx.load(str(path)).items()}
    args = ModelArgs.from_dict(model_config)
    head = MTPHead(args)
    if any(k.endswith(".scales") for k in weights):
        nn.quantize(head, class_predicate=lambda p, m: f"{p}.scales" in weights and infer_quant_config(p, m, weights))
    try:
        head.load_weights(list(weights.items()), strict=True)
    except ValueError as exc:
        raise ConfigMismatchError(f"{path}: the MTP weights do not match config.json: {exc}") from None
    if quantize and not any(k.endswith(".scales") for k in weights):
        group_size = model_config.get("quantization", {}).get("group_size", GROUP_SIZE)
        plan = quant_plan(head, Model(args).quant_predicate, group_size=group_size)
        nn.quantize(head, class_predicate=lambda p, m: plan.get(p, False))
    if not lazy:
        mx.eval(head.parameters())
    return head
