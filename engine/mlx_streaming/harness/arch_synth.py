"""Tiny checkpoints of every MoE architecture mlx-lm builds from switch_layers, written by mlx-lm itself.

For ``synth --arch NAME``: the architecture's config (``tiny_archs.json``: hidden 64, 16 routed experts,
2-4 layers, the dense-first-layer and shared-expert settings each family uses) goes through mlx-lm's own
model class, gets seeded random weights (norm weights ``1 + 0.1 N(0, 1)``, so a
``1 + w`` convention would show), is cast to bf16 as ``mlx_lm.convert`` casts, quantized by mlx-lm's
``quantize_model`` (4-bit, group 64, the model's own ``quant_predicate``: 8-bit routers where it says so)
and saved by mlx-lm's ``save_model`` / ``save_config``: exactly what ``mlx_lm.convert`` writes.
"""

from __future__ import annotations

import copy
import importlib
import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map_with_path
from mlx_lm.utils import MODEL_ARCHITECTURE_REMAPPING, MODEL_REMAPPING, quantize_model, save_config, save_model

from ..errors import ConfigError
from ..checkpoint.manifest import write_manifest
from ..checkpoint.output import fresh_folder
from ..checkpoint.tokenizer_files import write_byte_tokenizer

TINY_ARCHS = json.loads((Path(__file__).parent / "tiny_archs.json").read_text())


def _randomize(model, seed: int) -> None:
    mx.random.seed(seed)
    weights = []
    for name, p in tree_flatten(model.parameters()):
        if not mx.issubdtype(p.dtype, mx.floating):
            weights.append((name, p))
            continue
        leaf = name.rsplit(".", 1)[-1]
        if p.ndim == 1 and ("norm" in name.lower() or leaf in ("scale", "layer_scalar", "per_expert_scale")):
            value = 1.0 + 0.1 * mx.random.normal(p.shape)
        elif "bias" in leaf and any(k in name.lower() for k in ("expert", "router", "correction")):
            value = 0.01 * mx.random.normal(p.shape)
        elif p.ndim >= 2:
            value = mx.random.normal(p.shape) * p.shape[-1] ** -0.5
        else:
            value = 0.05 * mx.random.normal(p.shape)
        weights.append((name, value.astype(p.dtype)))
    model.load_weights(weights, strict=True)


def _cast_like_convert(model, dtype=mx.bfloat16) -> None:
    keep = getattr(model, "cast_predicate", lambda _: True)
    model.update(tree_map_with_path(
        lambda k, v: v.astype(dtype) if keep(k) and mx.issubdtype(v.dtype, mx.floating) else v, model.parameters()))


def synth_arch(out_dir: Path, arch: str, seed: int = 0) -> Path:
    """Write the tiny ``arch`` checkpoint to ``out_dir`` (new, empty, or an earlier synth output)."""
    if arch not in TINY_ARCHS:
        raise ConfigError(f"arch {arch!r} is not one this project writes; choose one of: {', '.join(TINY_ARCHS)}")
    config = copy.deepcopy(TINY_ARCHS[arch])
    with fresh_folder(out_dir, "synth") as partial:
        # mlx-lm's own class for the model_type. There is no public constructor from a config alone:
        # load_model without weights trips some architectures' sanitize (qwen3_vl_moe, kimi_k25).
        model_class, args_class = _model_classes(config)
        model = model_class(args_class.from_dict(copy.deepcopy(config)))
        _randomize(model, seed)
        _cast_like_convert(model)
        model, quantized_config = quantize_model(model, copy.deepcopy(config), 64, 4)
        save_model(partial, model)
        save_config(quantized_config, partial / "config.json")
        write_byte_tokenizer(partial)
        from ..config import StreamingConfig
        from ..model import open_checkpoint

        write_manifest(open_checkpoint(partial, StreamingConfig()).index, partial, "synth")
    return Path(out_dir)


def _model_classes(config: dict) -> tuple:
    """mlx-lm's (``Model``, ``ModelArgs``) for ``config``, its module found through mlx-lm's public remapping
    tables, as its loader finds it."""
    model_type = config["model_type"]
    architectures = config.get("architectures") or ()
    for architecture in (architectures,) if isinstance(architectures, str) else architectures:
        if (model_type, architecture) in MODEL_ARCHITECTURE_REMAPPING:
            model_type = MODEL_ARCHITECTURE_REMAPPING[model_type, architecture]
            break
    else:
        model_type = MODEL_REMAPPING.get(model_type, model_type)
    module = importlib.import_module(f"mlx_lm.models.{model_type}")
    return module.Model, module.ModelArgs
