"""Cross-layer expert prediction: a wrapper around each decoder layer submits likely experts early.

Before a layer's attention / Gated-DeltaNet runs, ``PredictingLayer`` applies the target layer's
``post_attention_layernorm`` and router ``gate`` to the layer input and takes each token's top
``top_k * mult`` experts; the target is this layer (``ahead`` 0) or the next (``ahead`` 1). Those not
resident are submitted to the prefetcher, whose threads read them while the layer computes. Budgets cap
the experts submitted per layer and per forward. The wrapper is composition on the built instance (the
model's ``layers`` list holds wrappers), so no mlx-lm class is changed.

``PredictDiagnostics`` (off unless asked for) measures what the prediction was worth: recall (predicted
and routed / routed), why routed experts were not resident at acquire (A: predicted but the read had not
finished, or evicted since; B: not predicted), main-thread time in predict and submit (the store counts
``place_s``), and the window from submit to acquire. Decode forwards (one token) are counted on their own as well.
"""

from __future__ import annotations

import time
from typing import Dict, Optional, Set

import mlx.core as mx
import mlx.nn as nn
import numpy as np



class PredictDiagnostics:
    FIELDS = ("routed", "predicted_and_routed", "predicted", "a_not_finished", "a_evicted", "b_not_predicted",
              "resident", "prefetch_served", "windows", "window_s")

    def __init__(self):
        self.reset_stats()

    def reset_stats(self) -> None:
        self.all = dict.fromkeys(self.FIELDS, 0)
        self.decode = dict.fromkeys(self.FIELDS, 0)
        self.predict_s = self.submit_s = 0.0

    def add(self, decode: bool, **counts) -> None:
        for scope in (self.all, self.decode) if decode else (self.all,):
            for name, value in counts.items():
                scope[name] += value

    @staticmethod
    def _summary(c: dict) -> dict:
        routed = c["routed"]
        return {**c, "recall": c["predicted_and_routed"] / routed if routed else 0.0,
                "avg_window_ms": 1000 * c["window_s"] / c["windows"] if c["windows"] else 0.0}

    def stats(self) -> dict:
        return {"all": self._summary(self.all), "decode": self._summary(self.decode),
                "predict_s": self.predict_s, "submit_s": self.submit_s}


class ExpertPredictor:
    """Owns the predictions of the forward in flight and turns them into prefetch requests."""

    def __init__(self, store, prefetcher, moe_blocks: Dict[int, nn.Module], norms: Dict[int, nn.Module],
                 ahead: int = 1, mult: int = 1, layer_budget: int = 0, forward_budget: int = 0,
                 diagnostics: bool = False):
        self.store, self.prefetcher = store, prefetcher
        self.blocks, self.norms = moe_blocks, norms
        self.ahead, self.mult = ahead, mult
        self.layer_budget, self.forward_budget = layer_budget, forward_budget
        self.diagnostics = PredictDiagnostics() if diagnostics else None
        self._predicted: Dict[int, tuple] = {}  # target layer -> (predicted, submitted, submit time)
        self._forward_submitted = 0
        self._decode = False

    def start_forward(self, tokens: int) -> None:
        self._predicted.clear()
        self._forward_submitted = 0
        self._decode = tokens == 1

    def predict(self, layer: int, x: mx.array) -> None:
        """From ``layer``'s input, predict the experts of ``layer + ahead`` and submit the missing ones."""
        target = layer + self.ahead
        if target not in self.blocks:
            return
        t0 = time.perf_counter()
        block = self.blocks[target]
        logits = block.gate(self.norms[target](x))
        k = min(block.top_k * self.mult, logits.shape[-1])
        top = mx.argpartition(-logits, kth=k - 1, axis=-1)[..., :k]
        counts = np.bincount(np.array(top).reshape(-1), minlength=logits.shape[-1])
        ranked = [int(e) for e in np.argsort(-counts, kind="stable") if counts[e] > 0]
        if self.layer_budget:
            ranked = ranked[: self.layer_budget]
        t1 = time.perf_counter()
        policy = self.store.policies[target]
        missing = [e for e in ranked if policy.slot(e) is None]
        if self.forward_budget:
            missing = missing[: max(0, self.forward_budget - self._forward_submitted)]
        self._forward_submitted += self.prefetcher.submit(target, missing)
        t2 = time.perf_counter()
        self._predicted[target] = (set(ranked), set(missing), t2)
        if self.diagnostics is not None:
            self.diagnostics.predict_s += t1 - t0
            self.diagnostics.submit_s += t2 - t1

    def account(self, layer: int, experts, resident: Set[int]) -> None:
        """Diagnostics of one acquire: ``experts`` routed, ``resident`` the ones already in the pool."""
        if self.diagnostics is None:
            return
        predicted, submitted, submitted_at = self._predicted.get(layer, (set(), set(), None))
        counts = dict.fromkeys(PredictDiagnostics.FIELDS, 0)
        counts["routed"] = len(experts)
        counts["predicted"] = len(predicted)
        counts["predicted_and_routed"] = len(predicted.intersection(experts))
        if submitted_at is not None:
            counts["windows"], counts["window_s"] = 1, time.perf_counter() - submitted_at
        for e in experts:
            if e in resident:
                counts["resident"] += 1
            elif e not in predicted:
                counts["b_not_predicted"] += 1
            elif e not in submitted:
                counts["a_evicted"] += 1  # resident when predicted, gone by the acquire
            elif self.prefetcher.state(layer, e) == "ready":
                counts["prefetch_served"] += 1
            else:
                counts["a_not_finished"] += 1  # queued or still being read (or dropped over budget)
        self.diagnostics.add(self._decode, **counts)


class PredictingLayer(nn.Module):
    """A decoder layer that asks the predictor first; everything else is the wrapped layer's."""

    def __init__(self, layer: nn.Module, index: int, predictor: ExpertPredictor, first: bool):
        super().__init__()
        self.layer = layer
        self.index = index
        self.is_linear = layer.is_linear
        self._predictor = predictor
        self._first = first

    def __call__(self, x: mx.array, mask=None, cache=None) -> mx.array:
        if self._first:
            self._predictor.start_forward(x.shape[1])
        self._predictor.predict(self.index, x)
        return self.layer(x, mask=mask, cache=cache)


def unwrap(layer: nn.Module) -> nn.Module:
    """The decoder layer itself, whether or not a ``PredictingLayer`` wraps it."""
    return layer.layer if isinstance(layer, PredictingLayer) else layer


def install_predictor(model, predictor: ExpertPredictor) -> None:
    """Wrap each decoder layer of ``model`` (an mlx-lm Qwen3-Next) in a ``PredictingLayer``."""
    layers = model.model.layers  # ``model.layers`` is a slice of it (a copy)
    for i, layer in enumerate(layers):
        layers[i] = PredictingLayer(layer, i, predictor, first=i == 0)
