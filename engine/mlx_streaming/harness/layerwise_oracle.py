"""An exactness oracle that never holds the whole model: mlx-lm's own model, run one part at a time from disk.

The in-memory oracle (``mlx_lm.load`` + greedy decoding) needs the whole checkpoint in memory, which is exactly
what a larger-than-memory model does not allow. This oracle builds the same model with mlx-lm's own classes
(``mlx_lm.utils.load_model(path, lazy=True)``: config, quantization, sanitize, its forward code untouched) and
keeps every parameter an unmaterialized lazy load. Each *part* of the model is:

* each decoder layer (``model.layers[i]``, everything under it), and
* each other module that holds parameters of its own (Qwen3-Next: ``model.embed_tokens``, ``model.norm``,
  ``lm_head``).

When mlx-lm's forward calls a part (``__call__``, or ``as_linear`` for a tied embedding), that part's full
weights are read from the checkpoint's safetensors files (a fresh lazy ``mx.load`` of the shards holding them,
evaluated: only those tensors' bytes are read), the part runs, its output and the caches handed to it
(KV caches, Gated-DeltaNet conv / recurrent states) are evaluated (``mx.eval``), and its weights are swapped back
for the never-evaluated placeholders, so they are freed. At most one part's weights are materialized at a time
(two where one part calls another, which no supported architecture does). mlx-lm's caches
(``make_prompt_cache``) carry the state between tokens, so a step costs one read of the whole checkpoint.

The parts are found by walking mlx-lm's module tree; each part's ``__call__`` / ``as_linear`` loads, runs and
drops (``runtime.patch.call_through``, the one way the project edits a built mlx-lm model); the model's own
``__call__`` (masks, layer order, linear/full attention dispatch) runs as it is. Nothing here touches the
engine's pool, slot tables or streaming switch: only the safetensors header reader, ``top2_margin`` and that
per-instance call wrapper.

Supported architectures (``SUPPORTED_MODEL_TYPES``): those checked against mlx-lm's in-memory greedy decoding
(ids and logits bit for bit) with the materialized weights bounded by one part. Any other ``model_type`` is
refused in one line. The checkpoint must be in MLX layout (what ``mlx_lm.convert`` writes): where mlx-lm's
``sanitize`` would rewrite a tensor (Hugging Face layout), the oracle refuses rather than rewrite it per part.
The MTP head is not run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, Iterator, List, Sequence, Tuple

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache

from ..checkpoint.safetensors import read_checkpoint_headers
from ..errors import CheckpointError, UnsupportedModelError
from ..decode.greedy import greedy_generate, greedy_steps
from ..runtime.patch import call_through, direct_arrays
from .layerwise_parts import LayerwiseStats, Part, one_line

#: The model_types whose layerwise greedy ids and logits were checked equal (bit for bit) to mlx-lm's
#: in-memory greedy decoding, with no weight materialized outside its part: the project's target (qwen3_next,
#: the embedded default model) and every architecture of the tiny synthetic checkpoints
#: (``harness/tiny_archs.json``, written by mlx-lm itself), with mlx-lm 0.32. tests/test_layerwise_oracle.py
#: checks the default model and a few of these each run, all of them with MLX_STREAMING_LAYERWISE_ALL_ARCHS=1.
SUPPORTED_MODEL_TYPES = (
    "qwen3_next",
    "afmoe", "bailing_hybrid", "bailing_moe", "bailing_moe_linear", "bailing_moe_v3", "deepseek", "deepseek_v2",
    "deepseek_v3", "deepseek_v32", "deepseek_v41", "dots1", "ernie4_5_moe", "exaone_moe", "gemma4", "gemma4_text",
    "glm4_moe", "glm4_moe_lite", "glm_moe_dsa", "gpt_oss", "granitemoe", "granitemoehybrid", "hunyuan", "jamba",
    "kimi_k25", "kimi_k3", "kimi_linear", "kimi_vl", "Klear", "laguna", "lfm2_moe", "llama4", "longcat_flash",
    "longcat_flash_ngram", "mellum", "mimo_v2_flash", "minimax", "minimax_m3_vl", "mistral3", "mistral4", "mixtral",
    "nemotron_h", "olmoe", "phimoe", "phixtral", "qwen2_moe", "qwen3_5_moe", "qwen3_moe", "qwen3_vl_moe",
    "solar_open", "step3p5",
)

#: Prompt tokens per prefill forward; the in-memory oracle (``decode.greedy.greedy_steps``) uses the same, so both
#: run the same computations.
PREFILL_CHUNK = 256

#: Methods through which a model's forward uses a part's weights.
_WRAPPED_METHODS = ("__call__", "as_linear")


class LayerwiseOracle:
    """mlx-lm's model of the checkpoint at ``path``, computed part by part from disk (see the module's doc)."""

    def __init__(self, path):
        import mlx.nn as nn
        from mlx_lm.utils import load_model

        path = Path(path)
        config_path = path / "config.json"
        if not config_path.is_file():
            raise CheckpointError(f"{config_path}: missing: not a model folder")
        try:
            config = json.loads(config_path.read_text())
            model_type = config["model_type"]
        except (ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{config_path}: no model_type ({one_line(exc)})") from None
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"{path}: the layerwise oracle does not support model_type {model_type!r} "
                f"(supported: qwen3_next and {len(SUPPORTED_MODEL_TYPES) - 1} other mlx-lm MoE architectures, "
                f"listed in mlx_streaming.harness.layerwise_oracle.SUPPORTED_MODEL_TYPES)")
        tensors = read_checkpoint_headers(path)  # one-line CheckpointError for a missing or broken shard
        try:
            model, _ = load_model(path, lazy=True)  # every parameter a lazy load: nothing read yet
        except (ValueError, FileNotFoundError, KeyError) as exc:
            raise CheckpointError(
                f"{path}: mlx-lm cannot build its {model_type} model from this checkpoint: {one_line(exc)}") from None
        self.path, self.model_type, self.model = path, model_type, model
        self.stats = LayerwiseStats()
        self._materialized = 0
        params = dict(tree_flatten(model.parameters()))
        self._check_layout(tensors, params)

        module_paths = {id(m): name for name, m in model.named_modules()}
        layer_names = [module_paths[id(layer)] for layer in model.layers]
        parts: Dict[str, Part] = {}
        owners: Dict[str, nn.Module] = {}
        covered = set()
        for name, module in model.named_modules():
            in_layer = next((ln for ln in layer_names if name == ln or name.startswith(ln + ".")), None)
            for key, container, slot, array in direct_arrays(module):
                full = f"{name}.{key}" if name else key
                if full not in params:  # a private array (rope frequencies...), not a weight
                    continue
                part_name = in_layer if in_layer is not None else name
                if part_name not in parts:
                    parts[part_name] = Part(self, part_name)
                    owners[part_name] = module if in_layer is None else next(
                        layer for layer in model.layers if module_paths[id(layer)] == in_layer)
                parts[part_name].add(container, slot, array, tensors[full])
                covered.add(full)
        missing = sorted(set(params) - covered)
        if missing:
            raise UnsupportedModelError(f"{path}: parameters outside any part the oracle can load: {', '.join(missing[:5])}")
        for part_name, owner in owners.items():
            call_through(owner, _WRAPPED_METHODS, parts[part_name].run)
        self.parts = parts
        self.stats.part_bytes = {n: p.nbytes for n, p in parts.items()}
        self.stats.model_bytes = sum(p.nbytes for p in parts.values())

    def _check_layout(self, tensors, params) -> None:
        """Each parameter is one stored tensor, as stored (MLX layout): same name, shape and size, not rewritten
        by mlx-lm's ``sanitize``."""
        for name, array in params.items():
            info = tensors.get(name)
            if info is None:
                raise CheckpointError(f"{self.path}: tensor {name} of mlx-lm's {self.model_type} model is in no shard")
            if tuple(info.shape) != tuple(array.shape) or info.nbytes != array.nbytes:
                raise CheckpointError(
                    f"{info.path}: tensor {name} is {list(info.shape)} {info.dtype}; mlx-lm's model holds "
                    f"{list(array.shape)} {array.dtype}")
        sanitize = getattr(self.model, "sanitize", None)
        if sanitize is None:
            return
        stored = {}
        for file in sorted({info.path for info in tensors.values()}):
            stored.update(mx.load(str(file)))  # lazy
        sanitized = sanitize(dict(stored))
        for name in params:
            if sanitized.get(name) is not stored[name]:
                raise CheckpointError(
                    f"{self.path}: tensor {name} is not in MLX layout (mlx-lm's sanitize rewrites it); "
                    f"convert the checkpoint with mlx_lm.convert first")

    def __call__(self, inputs: mx.array, cache=None) -> mx.array:
        """One forward of mlx-lm's model, part by part; the logits come back evaluated."""
        self.stats.forwards += 1
        return self.model(inputs, cache=cache)

    def make_cache(self):
        """mlx-lm's own caches for the model (KV caches, Gated-DeltaNet / Mamba states...)."""
        return make_prompt_cache(self.model)

    def steps(self, prompt_ids: Sequence[int], max_tokens: int,
              prefill_chunk: int = PREFILL_CHUNK) -> Iterator[Tuple[int, mx.array]]:
        """Yield ``(greedy id, the logits it was taken from)`` for ``max_tokens`` steps after the prompt: the
        in-memory oracle's loop (``decode.greedy.greedy_steps``) on this model."""
        return greedy_steps(self, prompt_ids, max_tokens, prefill_chunk)

    def greedy(self, prompt_ids: Sequence[int], max_tokens: int,
               prefill_chunk: int = PREFILL_CHUNK) -> Tuple[List[int], List[tuple]]:
        """(greedy ids, each step's ``top2_margin``: (top-1 id, top-2 id, top-1 minus top-2 logit, top-1 logit))."""
        margins = []
        return greedy_generate(self, prompt_ids, max_tokens, prefill_chunk, margins=margins), margins


def greedy(path, prompt_ids: Sequence[int], max_tokens: int) -> Tuple[List[int], List[tuple]]:
    """Greedy decoding of mlx-lm's model of ``path`` without holding it: (ids, each step's ``top2_margin``).

    The ids are mlx-lm's in-memory greedy ids; each margin is ``decode.greedy.top2_margin`` of the logits the id was
    taken from (its third field is the top-1 minus top-2 logit gap)."""
    return LayerwiseOracle(path).greedy(prompt_ids, max_tokens)
