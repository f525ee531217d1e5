"""What MTP speculation assumes about mlx-lm's Qwen3-Next model tree, beyond the generic expert sites.

- The MTP head is one more expert site (layer id ``num_hidden_layers``, tensors under ``mtp.``).
- Hidden states and logits: ``model.model`` gives the final hidden state (after the final norm), then
  ``lm_head`` (or the tied embedding) gives logits; the drafter embeds with ``model.model.embed_tokens``.
- Gated-DeltaNet state cannot be trimmed after a partial accept. For the direct commit,
  ``patch.install_state_capture`` wraps every Gated-DeltaNet mixer (``layer.linear_attn`` of layers with ``is_linear``) once, at build, in a
  ``StateCapture`` that, while capturing, steps a multi-token call position by position and keeps the
  state after each; its caches are mlx-lm's ``ArraysCache`` and the attention caches are trimmable.
"""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple, Union

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache

from .patch import StateCapture, unwrap
from .sites import ExpertSite, expert_sites

MODEL_TYPE = "qwen3_next"


def mtp_sites(head: nn.Module, num_hidden_layers: int) -> Dict[int, ExpertSite]:
    """The MTP head's expert site, as layer id ``num_hidden_layers`` (its tensors are ``mtp.``-prefixed)."""
    return expert_sites(head, prefix="mtp.", layer_id=num_hidden_layers)


def forward_with_hidden(model, ids: mx.array, cache) -> Tuple[mx.array, mx.array]:
    """Logits and the final hidden state (after the model's final norm) for ``ids`` of shape [1, L]."""
    hidden = model.model(ids, cache)
    return logits_from_hidden(model, hidden), hidden


def logits_from_hidden(model, hidden: mx.array) -> mx.array:
    if model.args.tie_word_embeddings:
        return model.model.embed_tokens.as_linear(hidden)
    return model.lm_head(hidden)


def embed(model, tokens: Union[Sequence[int], mx.array]) -> mx.array:
    """The embeddings of ``tokens``: ids on the host, or a (1, n) array of them (a draft not yet read back)."""
    return model.model.embed_tokens(tokens if isinstance(tokens, mx.array) else mx.array([list(tokens)]))


def state_captures(model) -> List[StateCapture]:
    """The ``StateCapture`` of every Gated-DeltaNet layer, in cache order (installed at build)."""
    captures = [layer.linear_attn for layer in map(unwrap, model.layers) if layer.is_linear]
    if not all(isinstance(c, StateCapture) for c in captures):
        raise ValueError("the direct commit needs the state capture: build the model with mtp=True")
    return captures


def recurrent_caches(cache) -> list:
    """The Gated-DeltaNet caches (not trimmable)."""
    return [c for c in cache if isinstance(c, ArraysCache)]


def attention_caches(cache) -> list:
    """The full-attention KV caches (trimmable)."""
    return [c for c in cache if not isinstance(c, ArraysCache)]
