"""build_streaming_model: the mlx-lm model with dense weights resident and experts streamed from disk.

mlx-lm's own loader builds the model with every weight lazy (``mx.load`` reads nothing until evaluated).
The adapter finds each MoE block's routed-expert switch module and replaces it, on this instance, by a
``StreamingSwitch`` over the store's pool, which drops the lazy expert arrays unread; only then are the
parameters evaluated: the dense weights load, the experts never do. The store is built with every part it
uses (reader, verifier, prefetcher, predictor); the pool size comes from the memory plan (``plan.py``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import mlx.core as mx
from mlx_lm.utils import load_model, load_tokenizer

from .runtime import qwen3_next
from .runtime.cuda_attention import avoid_graph_per_shape
from .runtime.patch import defer_miss_checks, install, install_state_capture, wrap_layers
from .runtime.sites import experts_per_token, expert_sites
from .residency.stats import ResidencyStats
from .residency.store import ExpertStore
from .residency.checksums import ByteVerifier
from .checkpoint.experts import ExpertIndex
from .checkpoint import MTP_FILE
from .checkpoint.packed import packed_index
from .checkpoint.safetensors import read_checkpoint_headers, read_header
from .config import StreamingConfig
from .errors import CheckpointError, ConfigError, ConfigMismatchError, MissingTensorError, UnsupportedModelError
from .io.reader import ExpertReader
from .prefetch.hooks import PrefetchHooks
from .prefetch.predictor import ExpertPredictor
from .prefetch.prefetcher import Prefetcher
from .prefetch.switch import PrefetchSwitch
from .runtime.switch import StreamingSwitch
from .mtp.load import load_mtp
from .plan import MemoryPlan, pool_capacity


@dataclass
class StreamingModel:
    """The built model (an mlx-lm ``Model``), its tokenizer, its expert store, and what built them."""

    model: object
    tokenizer: object
    store: ExpertStore
    config: StreamingConfig
    path: Path
    model_config: dict
    #: What the model holds, by part, and the pool the config gave (computed before any weight was read).
    plan: MemoryPlan
    #: The MTP head (``config.mtp``), its experts in the same store under layer id ``num_hidden_layers``.
    mtp: Optional[object] = None
    #: The prefetch side of each forward (``config.prefetch``); its ``switch`` with ``--prefetch auto``.
    prefetch: Optional[PrefetchHooks] = None

    def reset_stats(self) -> None:
        self.store.reset_stats()

    def close(self) -> None:
        self.store.close()

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


@dataclass
class _Checkpoint:
    """A checkpoint opened lazily: the mlx-lm model (nothing read yet), its expert sites by layer id (the MTP
    head's under ``num_hidden_layers``), the head, and the index of every expert."""

    model: object
    model_config: dict
    sites: dict
    head: Optional[object]
    index: ExpertIndex
    dense_bytes: int  #: the main model's non-expert tensors
    mtp_dense_bytes: int  #: the MTP head's non-expert tensors (0 without the head)


def _load_lazily(path: Path, model_config: dict):
    """mlx-lm's own model for ``path``, every weight lazy (nothing read yet), with errors in one line."""
    model_type = model_config.get("model_type")
    try:
        return load_model(path, lazy=True, strict=True)[0]
    except ValueError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
        try:
            skeleton = load_model(path, lazy=True, strict=False)[0]
        except (ValueError, KeyError, TypeError, AttributeError) as inner:
            raise UnsupportedModelError(
                f"{path / 'config.json'}: model_type {model_type!r} cannot be built by mlx-lm ({inner}); "
                f"mlx-streaming streams {SUPPORTED}") from None
        if not expert_sites(skeleton):
            raise _not_moe(path, model_type) from None
        kind = MissingTensorError if "Missing" in first else ConfigMismatchError
        raise kind(f"{path}: the shards do not match config.json: {first[:300]}") from None


SUPPORTED = ("MoE models whose routed experts are mlx-lm switch_layers modules (SwitchGLU / SwitchMLP), "
             "e.g. qwen3_next, qwen3_moe, mixtral, deepseek_v3, gpt_oss, glm4_moe; see the README's table")


def _not_moe(path: Path, model_type) -> UnsupportedModelError:
    return UnsupportedModelError(f"{path / 'config.json'}: model_type {model_type!r} has no routed experts to "
                                 f"stream; mlx-streaming streams {SUPPORTED}")


def open_checkpoint(path: Path, config: StreamingConfig) -> _Checkpoint:
    path = Path(path)
    model_config = read_config(path)
    tensors = read_checkpoint_headers(path)
    model = _load_lazily(path, model_config)
    sites = expert_sites(model)
    if not sites:
        raise _not_moe(path, model_config.get("model_type"))
    head, mtp_tensors = None, {}
    if config.mtp:
        if model_config.get("model_type") != qwen3_next.MODEL_TYPE:
            raise ConfigError(f"mtp: MTP speculation uses Qwen3-Next's MTP head; model_type "
                              f"{model_config.get('model_type')!r} has none here")
        mtp_path = Path(config.mtp_path) if config.mtp_path else path / MTP_FILE
        head = load_mtp(model_config, mtp_path, lazy=True)
        mtp_tensors = read_header(mtp_path)
        tensors.update(mtp_tensors)
        sites.update(qwen3_next.mtp_sites(head, model_config["num_hidden_layers"]))
    index = ExpertIndex(tensors, {i: (site.prefix, site.tensor_names()) for i, site in sites.items()})
    expert_names = set(index.expert_tensor_names())
    dense = {name: t.nbytes for name, t in tensors.items() if name not in expert_names}
    mtp_dense_bytes = sum(n for name, n in dense.items() if name in mtp_tensors)
    if config.packed_dir:
        index = packed_index(index, Path(config.packed_dir))
    return _Checkpoint(model, model_config, sites, head, index, sum(dense.values()) - mtp_dense_bytes, mtp_dense_bytes)


def _plan(ckpt: _Checkpoint, config: StreamingConfig) -> MemoryPlan:
    staging = config.staging_bytes if config.prefetch else 0
    index = ckpt.index
    pool = pool_capacity(config, index.num_experts, experts_per_token(ckpt.model_config), index.expert_bytes,
                         len(ckpt.sites), ckpt.dense_bytes + ckpt.mtp_dense_bytes, staging)
    return MemoryPlan(ckpt.dense_bytes, ckpt.mtp_dense_bytes, pool.slots, index.num_experts, len(ckpt.sites),
                      index.expert_bytes, staging, pool.allowance, pool.budget, pool.note)


def plan_memory(path, config: Optional[StreamingConfig] = None) -> MemoryPlan:
    """The memory plan of building ``path`` with ``config``, from the checkpoint's headers (no weight is read)."""
    config = config or StreamingConfig()
    return _plan(open_checkpoint(Path(path), config), config)


def within_budget(path, config: StreamingConfig, slots: int) -> StreamingConfig:
    """``config`` with a pool of ``slots`` experts per MoE layer, or of what its memory budget gives (where it sets
    one), whichever is less: a smaller pool, never a process over its budget."""
    if config.memory_budget is not None:
        slots = min(slots, plan_memory(path, config).slots)
    return config.with_pool(pool_slots=slots)


def build_streaming_model(path, config: Optional[StreamingConfig] = None, reader: Optional[ExpertReader] = None) -> StreamingModel:
    """``reader`` replaces the one ``config.io_mode`` would make (tests inject faults through it)."""
    path = Path(path)
    config = config or StreamingConfig()
    ckpt = open_checkpoint(path, config)
    index, model_config = ckpt.index, ckpt.model_config
    top_k = experts_per_token(model_config)
    plan = _plan(ckpt, config)
    capacity = plan.slots
    reader = reader or ExpertReader(config.io_mode, config.read_threads)
    main_sites = {i: site for i, site in ckpt.sites.items() if ckpt.head is None or i < model_config["num_hidden_layers"]}
    counters = ResidencyStats()
    prefetcher = predictor = None
    if config.prefetch:
        prefetcher = Prefetcher(index, reader, config.staging_bytes, counters, config.prefetch_threads)
        predictor = ExpertPredictor(main_sites, index.num_experts, top_k, ahead=config.prefetch_ahead,
                                    mult=config.prefetch_mult, layer_budget=config.prefetch_layer_budget,
                                    forward_budget=config.prefetch_forward_budget, diagnostics=config.diagnostics)
    store = ExpertStore(index, reader, capacity, top_k, config.record, verifier=ByteVerifier(index, counters) if config.verify else None,
                        prefetcher=prefetcher, predictor=predictor, miss_check=config.miss_check, counters=counters,
                        eviction=config.eviction)
    install(ckpt.sites, store.pool.arrays, lambda site: StreamingSwitch(site.switch, site.layer, store))
    mx.eval(ckpt.model.parameters(), ckpt.head.parameters() if ckpt.head else [])
    hooks = None
    if predictor is not None:
        hooks = PrefetchHooks(store, PrefetchSwitch() if config.prefetch == "auto" else None)
        wrap_layers(ckpt.model, main_sites, hooks.before_layer)
    defer_miss_checks(ckpt.model, main_sites, store)
    if ckpt.head is not None:
        install_state_capture(ckpt.model)
        avoid_graph_per_shape()  # before the first attention: a verify of K positions meets new shapes each step
    sm = StreamingModel(ckpt.model, load_tokenizer(path), store, config, path, model_config, plan, ckpt.head, hooks)
    if config.preload:
        store.fill()
        sm.reset_stats()
    if config.pin_hot:
        pin_hot_experts(sm, config.pin_hot, config.pin_cal_tokens)
    return sm


def pin_hot_experts(sm: StreamingModel, n: int, calibration_tokens: int) -> None:
    """Greedy-decode ``calibration_tokens`` of the config's calibration prompt with recording on, pin each layer's
    ``n`` hottest experts, and reset the counters so the calibration does not count."""
    from .decode.greedy import greedy_generate

    store = sm.store
    recording = store.record
    store.record = True
    greedy_generate(sm.model, sm.tokenizer.encode(sm.config.calibration_prompt), calibration_tokens,
                    sm.config.prefill_chunk)
    store.record = recording
    for layer in store.routed.layers():
        store.pin(layer, store.routed.hot(layer, n))
    sm.reset_stats()

