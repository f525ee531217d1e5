"""The MTP head, as the public Qwen3-Next reference implementations define it.

``e = pre_fc_norm_embedding(embed(next_token))``, ``h = pre_fc_norm_hidden(hidden)`` (the main model's
hidden state after its final norm), ``x = fc(concat([e, h]))``, one full-attention decoder layer with a
MoE block, then ``norm``. Embedding and lm_head are the main model's. Parameter names match the
checkpoint's ``mtp.*`` keys without the prefix.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.qwen3_next import ModelArgs, Qwen3NextDecoderLayer

#: Norms stored zero-centred in the original layout (the model multiplies by ``1 + w``): these names
#: of the head itself, and these suffixes inside its decoder layer.
ZERO_CENTRED_NAMES = ("pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight", "norm.weight")
ZERO_CENTRED_SUFFIXES = (
    ".input_layernorm.weight",
    ".post_attention_layernorm.weight",
    ".q_norm.weight",
    ".k_norm.weight",
)


def is_zero_centred(name: str) -> bool:
    """Whether the head's tensor ``name`` (without ``mtp.``) is a zero-centred norm weight."""
    return name in ZERO_CENTRED_NAMES or name.endswith(ZERO_CENTRED_SUFFIXES)


class MTPHead(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.fc = nn.Linear(2 * args.hidden_size, args.hidden_size, bias=False)
        self.pre_fc_norm_embedding = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        # A layer index whose position in the 3:1 pattern is full attention.
        self.layers = [Qwen3NextDecoderLayer(args, layer_idx=args.full_attention_interval - 1)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, embeddings: mx.array, hidden: mx.array, mask=None, cache=None) -> mx.array:
        """Next hidden state (after ``norm``) from the next token's embedding and the current hidden state."""
        e = self.pre_fc_norm_embedding(embeddings)
        h = self.pre_fc_norm_hidden(hidden)
        x = self.fc(mx.concatenate([e, h], axis=-1))
        x = self.layers[0](x, mask=mask, cache=cache)
        return self.norm(x)
