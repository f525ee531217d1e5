"""What ``synth --preset qwen3-next-80b`` writes, decided before any byte is: Qwen3-Next-80B-A3B's published config
(``QWEN3_NEXT_80B``), sized by ``sized_config``, and every file's tensors in write order (``plan_checkpoint``),
their names, shapes and dtypes read from mlx-lm's own classes (``Model`` and the project's ``MTPHead``, built lazily
so nothing is allocated, then ``nn.quantize``-d by the plan the converter uses)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional

import numpy as np

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
#: Quantization group size of the head's layers the model's predicate leaves to the default.
GROUP_SIZE = 64


#: config.json's ``torch_dtype`` -> the safetensors dtype of the unquantized tensors, scales and biases.
FLOAT_DTYPES = {"bfloat16": "BF16", "float32": "F32"}


def sized_config(sizes: dict, layers: Optional[int] = None, dtype: str = "bfloat16") -> dict:
    """The full config.json (before quantization) for ``sizes``, with ``layers`` decoder layers and ``dtype`` (a
    key of ``FLOAT_DTYPES``) for what is not packed."""
    from .synth import BASE_CONFIG

    config = {**BASE_CONFIG, **sizes, "torch_dtype": dtype}
    if layers is not None:
        config["num_hidden_layers"] = layers
    n = config["num_hidden_layers"]
    interval = config["full_attention_interval"]
    if n < interval:
        raise ConfigError(f"--layers {n}: Qwen3-Next needs at least {interval} layers (every {interval}th layer is "
                          f"full attention, and mlx-lm's qwen3_next model needs one)")
    config["layer_types"] = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)]
    return config


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of the MLX layout: ``dtype`` U32 (packed), BF16 or F32; ``bits`` of its module when quantized."""

    name: str
    dtype: str
    shape: tuple
    bits: int = 0

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * (2 if self.dtype == "BF16" else 4)

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


def _specs(module, plan: Dict[str, dict], prefix: str, floats: str) -> List[TensorSpec]:
    """The quantized layout of ``module`` (lazy: nothing is allocated) under ``plan``, as ``TensorSpec``s, what
    is not packed stored as ``floats``."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    nn.quantize(module, class_predicate=lambda p, m: plan.get(p, False))
    specs = []
    for name, value in tree_flatten(module.parameters()):
        base, _, part = name.rpartition(".")
        bits = plan[base]["bits"] if base in plan and part in ("weight", "scales", "biases") else 0
        specs.append(TensorSpec(prefix + name, "U32" if value.dtype == mx.uint32 else floats, tuple(value.shape), bits))
    return specs


def plan_checkpoint(config: dict, shard_bytes: int = SHARD_BYTES) -> StreamPlan:
    """The files ``write_checkpoint`` writes for ``config`` (from ``sized_config``): names, shapes, dtypes, bytes.

    Nothing is allocated: mlx-lm's ``Model`` and the ``MTPHead`` are built lazily, only their shapes are read.
    """
    from mlx_lm.models.qwen3_next import Model, ModelArgs

    from ..checkpoint import MTP_FILE
    from ..checkpoint.quantize import BITS, quant_plan, quantization_block
    from ..mtp.head import MTPHead

    args = ModelArgs.from_dict(config)
    model = Model(args)
    plan = quant_plan(model, model.quant_predicate)
    floats = FLOAT_DTYPES[config["torch_dtype"]]
    main = _specs(model, plan, "", floats)
    predicate = model.quant_predicate

    def with_bits(path, module):  # as checkpoint.mtp_extract.convert_mtp quantizes the head
        choice = predicate(path, module)
        return choice if isinstance(choice, dict) else {"group_size": GROUP_SIZE, "bits": BITS}

    head = MTPHead(args)
    mtp = _specs(head, quant_plan(head, with_bits), "mtp.", floats)

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
