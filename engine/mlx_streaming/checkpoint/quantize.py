"""Quantize a dict of MLX-named float weights the way mlx-lm's converter does.

Which tensors are quantized, and with how many bits, comes from an unquantized template module and the
model's own ``quant_predicate`` (4-bit group 64, 8-bit for ``mlp.gate`` and ``shared_expert_gate``),
exactly as ``mlx_lm.utils.quantize_model`` decides; working tensor by tensor keeps memory bounded when a
checkpoint is bigger than RAM.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional

import mlx.core as mx
import mlx.nn as nn

GROUP_SIZE = 64
BITS = 4


def quant_plan(template: nn.Module, predicate: Callable, prefix: str = "",
               group_size: int = GROUP_SIZE) -> Dict[str, dict]:
    """``{module path: {"group_size", "bits"}}`` for every module the converter would quantize with
    ``group_size`` as its default (``--q-group-size``): a module whose input width the default group does
    not divide stays unquantized, as in ``mlx_lm.utils.quantize_model``."""
    plan = {}
    for path, module in template.named_modules():
        if not path or not hasattr(module, "to_quantized"):
            continue
        if module.weight.shape[-1] % group_size != 0:
            continue
        full = prefix + path
        choice = predicate(full, module)
        if choice is False:
            continue
        plan[full] = choice if isinstance(choice, dict) else {"group_size": group_size, "bits": BITS}
    return plan


def quantize_weights(weights: Dict[str, mx.array], plan: Dict[str, dict]) -> Dict[str, mx.array]:
    """Replace each planned ``P.weight`` by ``P.weight`` / ``P.scales`` / ``P.biases``."""
    out = {}
    for name, value in weights.items():
        params: Optional[dict] = plan.get(name.removesuffix(".weight")) if name.endswith(".weight") else None
        if params is None:
            out[name] = value
            continue
        w, scales, biases = mx.quantize(value, params["group_size"], params["bits"])
        base = name.removesuffix(".weight")
        out[f"{base}.weight"], out[f"{base}.scales"], out[f"{base}.biases"] = w, scales, biases
    return out


def quantization_block(plan: Dict[str, dict]) -> dict:
    """The ``quantization`` entry of config.json: defaults plus every path that differs from them."""
    block = {"group_size": GROUP_SIZE, "bits": BITS, "mode": "affine"}
    for path, params in sorted(plan.items()):
        if params["bits"] != BITS or params["group_size"] != GROUP_SIZE:
            block[path] = dict(params)
    return block
