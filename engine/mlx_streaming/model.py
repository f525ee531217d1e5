"""build_streaming_model: the mlx-lm model with dense weights resident and experts streamed from disk.

mlx-lm's own loader builds the model with every weight lazy (``mx.load`` reads nothing until evaluated).
Each MoE block's ``switch_mlp`` is then replaced on this instance by a ``StreamingSwitchGLU`` over the
store's pool, which drops the lazy expert arrays unread, and only then are the parameters evaluated: the
dense weights load, the experts never do.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Tuple

import mlx.core as mx
from mlx_lm.models.qwen3_next import Qwen3NextSparseMoeBlock
from mlx_lm.utils import load_model, load_tokenizer

from .cache.store import ExpertStore
from .cache.verify import ByteVerifier
from .checkpoint.experts import ExpertIndex
from .checkpoint.mtp_extract import MTP_FILE, MTP_PREFIX
from .checkpoint.packed import packed_index
from .checkpoint.safetensors import read_checkpoint_headers, read_header
from .config import StreamingConfig, format_size
from .errors import (CheckpointError, ConfigMismatchError, MissingTensorError, PoolTooSmallError,
                     UnsupportedModelError)
from .io.reader import ExpertReader
from .moe.predict import ExpertPredictor, install_predictor
from .moe.prefetch import Prefetcher
from .moe.streaming_switch import StreamingSwitchGLU
from .mtp.load import load_mtp


@dataclass
class StreamingModel:
    """The built model (an mlx-lm ``Model``), its tokenizer, its expert store, and what built them."""

    model: object
    tokenizer: object
    store: ExpertStore
    config: StreamingConfig
    path: Path
    model_config: dict
    dense_bytes: int
    #: One line: what the pool became and which option sized it.
    pool_note: str
    #: The MTP head (``config.mtp``), its experts in the same store under layer id ``num_hidden_layers``.
    mtp: Optional[object] = None

    def reset_stats(self) -> None:
        self.store.reset_stats()

    def close(self) -> None:
        if self.store.prefetcher is not None:
            self.store.prefetcher.close()
        self.store.reader.close()

    def __enter__(self) -> "StreamingModel":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_config(path: Path) -> dict:
    config_path = Path(path) / "config.json"
    try:
        return json.loads(config_path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{config_path}: missing; a model folder needs config.json") from None
    except ValueError as exc:
        raise CheckpointError(f"{config_path}: not valid JSON ({exc})") from None


def moe_layer_prefixes(model) -> dict:
    """``{layer id: switch_mlp tensor prefix}`` for every sparse MoE layer of an mlx-lm Qwen3-Next model."""
    return {
        i: f"model.layers.{i}.mlp.switch_mlp"
        for i, layer in enumerate(model.layers)
        if isinstance(layer.mlp, Qwen3NextSparseMoeBlock)
    }


def pool_capacity(config: StreamingConfig, num_experts: int, top_k: int, expert_bytes: int, moe_layers: int,
                  dense_bytes: int) -> Tuple[int, str]:
    """Slots per MoE layer from whichever sizing knob is set (none: every expert resident), and one line
    saying what the pool became. A pool bigger than the model's experts is cut to them (and says so); one
    below ``top_k`` is refused, naming the knob."""
    layer_bytes = expert_bytes * moe_layers
    if config.pool_slots is not None:
        slots, asked = config.pool_slots, f"pool_slots={config.pool_slots}"
    elif config.pool_bytes is not None:
        slots, asked = config.pool_bytes // layer_bytes, f"pool_bytes={format_size(config.pool_bytes)}"
    elif config.memory_budget is not None:
        left = config.memory_budget - dense_bytes - config.memory_allowance
        asked = f"memory_budget={format_size(config.memory_budget)}"
        if left <= 0:
            raise PoolTooSmallError(
                f"{asked} is below the dense weights ({format_size(dense_bytes)}) plus memory_allowance "
                f"({format_size(config.memory_allowance)}): nothing is left for the expert pool")
        slots = left // layer_bytes
    else:
        slots, asked = num_experts, "no pool size given"
    if slots < top_k:
        raise PoolTooSmallError(
            f"{asked} gives {slots} expert slots per MoE layer, below num_experts_per_tok={top_k}: one token needs "
            f"{top_k} experts resident, at least {format_size(top_k * layer_bytes)} "
            f"({moe_layers} MoE layers x {format_size(expert_bytes)} per expert)")
    note = ""
    if slots > num_experts:
        slots, note = num_experts, f", more than the model has: cut to {num_experts}"
    return slots, (f"pool: {slots} of {num_experts} experts per MoE layer x {moe_layers} layers = "
                   f"{format_size(slots * layer_bytes)} ({asked}{note})")


@dataclass
class _Checkpoint:
    """A checkpoint opened lazily: the mlx-lm model (nothing read yet), its MoE blocks by layer id (the MTP
    head's under ``num_hidden_layers``), the head, and the index of every expert."""

    model: object
    model_config: dict
    blocks: dict
    head: Optional[object]
    index: ExpertIndex
    dense_bytes: int


#: The ``model_type`` values whose MoE blocks the engine streams.
SUPPORTED_MODEL_TYPES = ("qwen3_next",)


def open_checkpoint(path: Path, config: StreamingConfig) -> _Checkpoint:
    model_config = read_config(path)
    model_type = model_config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"{Path(path) / 'config.json'}: model_type {model_type!r} is not supported; "
            f"mlx-streaming streams the experts of: {', '.join(SUPPORTED_MODEL_TYPES)}")
    tensors = read_checkpoint_headers(path)
    try:
        model, model_config = load_model(path, lazy=True, strict=True)
    except ValueError as exc:
        text = str(exc)
        kind = MissingTensorError if "Missing" in text else ConfigMismatchError
        raise kind(f"{path}: the shards do not match config.json: {text}") from None

    prefixes = moe_layer_prefixes(model)
    blocks = {i: model.layers[i].mlp for i in prefixes}
    head = None
    if config.mtp:
        mtp_path = Path(config.mtp_path) if config.mtp_path else path / MTP_FILE
        head = load_mtp(model_config, mtp_path, lazy=True)
        tensors.update(read_header(mtp_path))
        mtp_layer = model_config["num_hidden_layers"]
        prefixes[mtp_layer] = f"{MTP_PREFIX}.switch_mlp"
        blocks[mtp_layer] = head.layers[0].mlp
    index = ExpertIndex(tensors, prefixes, model_config)
    expert_names = set(index.expert_tensor_names())
    dense_bytes = sum(t.nbytes for name, t in tensors.items() if name not in expert_names)
    if config.packed_dir:
        index = packed_index(index, Path(config.packed_dir))
    return _Checkpoint(model, model_config, blocks, head, index, dense_bytes)


def build_streaming_model(path, config: Optional[StreamingConfig] = None, reader: Optional[ExpertReader] = None) -> StreamingModel:
    """``reader`` replaces the one ``config.io_mode`` would make (tests inject faults through it)."""
    path = Path(path)
    config = config or StreamingConfig()
    ckpt = open_checkpoint(path, config)
    index, model_config = ckpt.index, ckpt.model_config
    capacity, pool_note = pool_capacity(config, index.num_experts, model_config["num_experts_per_tok"],
                                        index.expert_bytes, len(ckpt.blocks), ckpt.dense_bytes)
    store = ExpertStore(index, reader or ExpertReader(config.io_mode), capacity, model_config["num_experts_per_tok"], config.record)
    if config.verify:
        store.verifier = ByteVerifier(index)
    for i, block in ckpt.blocks.items():
        block.switch_mlp = StreamingSwitchGLU(block.switch_mlp, i, store)
    mx.eval(ckpt.model.parameters(), ckpt.head.parameters() if ckpt.head else [])
    if config.prefetch:
        attach_prefetch(ckpt.model, store, config)
    sm = StreamingModel(ckpt.model, load_tokenizer(path), store, config, path, model_config, ckpt.dense_bytes,
                        pool_note, ckpt.head)
    if config.pin_hot:
        pin_hot_experts(sm, config.pin_hot, config.pin_cal_tokens)
    return sm


def attach_prefetch(model, store: ExpertStore, config: StreamingConfig) -> None:
    """Start the prefetcher and wrap the main model's decoder layers with the expert predictor."""
    layers = [layer for layer in store.index.layers if layer < len(model.layers)]
    store.prefetcher = Prefetcher(store.index, store.reader, config.staging_bytes, config.prefetch_threads)
    store.predictor = ExpertPredictor(
        store, store.prefetcher, {i: model.layers[i].mlp for i in layers},
        {i: model.layers[i].post_attention_layernorm for i in layers}, ahead=config.prefetch_ahead,
        mult=config.prefetch_mult, layer_budget=config.prefetch_layer_budget,
        forward_budget=config.prefetch_forward_budget, diagnostics=config.diagnostics)
    install_predictor(model, store.predictor)


def pin_hot_experts(sm: StreamingModel, n: int, calibration_tokens: int) -> None:
    """Greedy-decode ``calibration_tokens`` of the config's prompt with recording on, pin each layer's
    ``n`` hottest experts, and reset the counters so the calibration does not count."""
    from .generate import greedy_generate

    store = sm.store
    recording = store.record
    store.record = True
    greedy_generate(sm.model, sm.tokenizer.encode(sm.config.prompt), calibration_tokens, sm.config.prefill_chunk)
    store.record = recording
    for layer in store.recorded_layers():
        store.pin(layer, store.hot(layer, n))
    sm.reset_stats()

