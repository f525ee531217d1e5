"""Everything the engine assumes about an mlx-lm model tree, for every architecture built on switch_layers.

mlx-lm builds the routed experts of each MoE block as one ``SwitchGLU`` or ``SwitchMLP`` module (under
``switch_mlp``, ``experts``, ``experts.switch_mlp``, ``switch_glu``, ...), whose parameters are stacked over
experts and saved under the module's own path. So an *expert site* is found by walking the built model:
its module path is the checkpoint's tensor prefix, its parameters are the expert tensors, and its layer id
is the first integer in the path (the decoder layer). The block's own routing code runs unchanged; the
engine only replaces the switch module and wraps decoder layers for prediction (``patch``, the one module that
edits the built model). Bare ``SwitchLinear`` modules are not experts (deepseek_v41 uses one in attention).

The per-architecture facts the predictor needs are small tables here: where the pre-MoE norm sits, what the
router is called, and the config key of the experts per token. Qwen3-Next's own extras (Gated-DeltaNet state
capture, the MTP head) live in ``qwen3_next.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Mapping, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.switch_layers import SwitchGLU, SwitchMLP

SWITCH_CLASSES = (SwitchGLU, SwitchMLP)
#: The norm a decoder layer applies before its MoE block, by name, first match wins.
PRE_MOE_NORMS = ("post_attention_layernorm", "pre_mlp_layernorm", "pre_ff_layernorm", "pre_feedforward_layernorm",
                 "pre_feedforward_layernorm_2", "ffn_norm", "norm", "ln")
#: The router of a MoE block (a Linear giving logits, or a module giving (indices, scores)).
ROUTERS = ("gate", "router")
#: Config keys of the routed experts per token, at the top level or under ``text_config``.
EXPERTS_PER_TOKEN_KEYS = ("num_experts_per_tok", "num_experts_per_token", "moe_topk", "moe_top_k", "moe_k",
                          "top_k_experts", "experts_per_token")


@dataclass
class ExpertSite:
    """One MoE block's routed experts in a built model."""

    layer: int  #: the engine's layer id (the decoder layer's index; the MTP layer gets its own)
    prefix: str  #: module path = checkpoint tensor prefix, e.g. "model.layers.3.mlp.switch_mlp"
    parent: nn.Module  #: the module holding the switch as attribute ``attr``
    attr: str
    switch: nn.Module  #: mlx-lm's SwitchGLU / SwitchMLP
    decoder_layer: nn.Module  #: the decoder layer around it
    router_owner: Optional[nn.Module]  #: the module holding the router (the block, or the decoder layer)

    def tensor_names(self) -> List[str]:
        """The switch's parameter names, e.g. ``gate_proj.weight``, ``gate_proj.scales``, ``fc1.bias``."""
        return [name for name, _ in tree_flatten(self.switch.parameters())]


def _child(module, key: str):
    return module[int(key)] if isinstance(module, list) else getattr(module, key)


def expert_sites(model: nn.Module, prefix: str = "", layer_id: Optional[int] = None) -> Dict[int, ExpertSite]:
    """``{layer id: site}`` for every routed-expert switch module in ``model`` (``prefix`` is prepended to
    tensor names; ``layer_id`` overrides the id, for a head that is one layer)."""
    sites = {}
    for path, module in model.named_modules():
        if not isinstance(module, SWITCH_CLASSES):
            continue
        keys = path.split(".")
        numbers = [i for i, key in enumerate(keys) if key.isdigit()]
        if not numbers:
            continue
        chain = [model]
        for key in keys:
            chain.append(_child(chain[-1], key))
        layer_at = numbers[0] + 1  # chain index of the decoder layer
        owner = next((m for m in reversed(chain[layer_at:-1]) if any(_router(m, r) for r in ROUTERS)), None)
        layer = int(keys[numbers[0]]) if layer_id is None else layer_id
        sites[layer] = ExpertSite(layer, prefix + path, chain[-2], keys[-1], module, chain[layer_at], owner)
    return sites


def _router(module, name: str):
    router = getattr(module, name, None) if isinstance(module, nn.Module) else None
    return router if isinstance(router, nn.Module) else None


def experts_per_token(config: Mapping) -> int:
    """Routed experts per token from config.json (the largest, where a list gives one per layer)."""
    for scope in (config, config.get("text_config") or {}):
        for key in EXPERTS_PER_TOKEN_KEYS:
            value = scope.get(key)
            if value:
                return max(value) if isinstance(value, list) else int(value)
    return 1


def pre_moe_norm(site: ExpertSite) -> Callable[[mx.array], mx.array]:
    for name in PRE_MOE_NORMS:
        norm = getattr(site.decoder_layer, name, None)
        if isinstance(norm, nn.Module):
            return norm
    return lambda x: x


def predict_experts(site: ExpertSite, x: mx.array, k: int) -> Optional[mx.array]:
    """Each token's likely experts at ``site`` from a decoder layer input ``x``: the site's own router on the
    pre-MoE norm of ``x``; the top ``k`` of its logits, or the indices a router that selects returns.
    None when the architecture's router is not known here."""
    if site.router_owner is None:
        return None
    router = next(r for r in (_router(site.router_owner, n) for n in ROUTERS) if r is not None)
    out = router(pre_moe_norm(site)(x))
    if isinstance(out, tuple):  # a router that selects: (indices, scores)
        return out[0]
    k = min(k, out.shape[-1])
    return mx.argpartition(-out, kth=k - 1, axis=-1)[..., :k]


def decoder_layer_list(model: nn.Module, sites: Mapping[int, ExpertSite]) -> List[nn.Module]:
    """The list object holding the decoder layers around ``sites`` (edited in place by ``wrap_layers``)."""
    prefix = next(iter(sites.values())).prefix
    keys = prefix.split(".")
    at = next(i for i, key in enumerate(keys) if key.isdigit())
    holder = model
    for key in keys[:at]:
        holder = _child(holder, key)
    return holder
