"""Cross-layer expert prediction: from a decoder layer's input, the likely experts of this or the next MoE layer.

Before a layer's attention (or recurrent mixer) runs, the store asks the predictor for the experts of the
MoE layer ``ahead`` sites on (0: this layer's own, 1: the next one's): the adapter runs that site's own
router on its pre-MoE norm of the layer input and takes each token's top ``top_k * mult``. The store
submits the ones not resident to the prefetcher, whose threads read them while the layer computes. Budgets
cap the experts submitted per layer and per forward.

``PredictDiagnostics`` (off unless asked for) measures what the prediction was worth: recall (predicted
and routed / routed), why routed experts were not resident at acquire (A: predicted but the read had not
finished, or evicted since; B: not predicted), main-thread time in predict and submit (the store counts
``place_s``), and the window from submit to acquire. Decode forwards (one token) are counted on their own as well.
"""

from __future__ import annotations

import time
from typing import Dict, List, Optional, Sequence, Set, Tuple

import mlx.core as mx
import numpy as np

from ..runtime.sites import ExpertSite, predict_experts


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
    """Predicts each MoE site's experts and remembers what it predicted and submitted, for the budgets and
    the diagnostics. It reads no bytes and holds no pool: the store acts on its predictions."""

    def __init__(self, sites: Dict[int, ExpertSite], num_experts: int, top_k: int, ahead: int = 1, mult: int = 1,
                 layer_budget: int = 0, forward_budget: int = 0, diagnostics: bool = False):
        self.sites, self.num_experts = sites, num_experts
        order = sorted(sites)
        #: decoder layer index -> the MoE layer its input predicts (this one's own, or the next one's)
        self.targets = {layer: order[order.index(layer) + ahead] for layer in order if order.index(layer) + ahead < len(order)}
        self.k = top_k * mult
        self.layer_budget, self.forward_budget = layer_budget, forward_budget
        self.diagnostics = PredictDiagnostics() if diagnostics else None
        self._predicted: Dict[int, tuple] = {}  # target layer -> (predicted, submitted, submit time)
        self._forward_submitted = 0
        self._decode = False

    def start_forward(self, tokens: int) -> None:
        self._predicted.clear()
        self._forward_submitted = 0
        self._decode = tokens == 1

    def predict(self, layer: int, x) -> Optional[Tuple[int, mx.array]]:
        """(target MoE layer, each token's likely experts there: a lazy array) from decoder layer ``layer``'s
        input, or None; ``rank`` takes them once on the host."""
        target = self.targets.get(layer)
        if target is None:
            return None
        t0 = time.perf_counter()
        top = predict_experts(self.sites[target], x, self.k)
        if self.diagnostics is not None:
            self.diagnostics.predict_s += time.perf_counter() - t0
        return None if top is None else (target, top)

    def rank(self, target: int, top: np.ndarray) -> List[int]:
        """``target``'s predicted experts (``predict``'s array, on the host), most tokens first."""
        t0 = time.perf_counter()
        counts = np.bincount(top.reshape(-1), minlength=self.num_experts)[: self.num_experts]
        ranked = [int(e) for e in np.argsort(-counts, kind="stable") if counts[e] > 0]
        if self.layer_budget:
            ranked = ranked[: self.layer_budget]
        if self.diagnostics is not None:
            self.diagnostics.predict_s += time.perf_counter() - t0
        self._predicted[target] = (set(ranked), set(), None)
        return ranked

    def within_budget(self, missing: Sequence[int]) -> List[int]:
        """The part of ``missing`` the per-forward budget still allows."""
        if self.forward_budget:
            return list(missing[: max(0, self.forward_budget - self._forward_submitted)])
        return list(missing)

    def submitted(self, target: int, missing: Sequence[int], accepted: int, seconds: float) -> None:
        self._forward_submitted += accepted
        predicted = self._predicted[target][0]
        self._predicted[target] = (predicted, set(missing), time.perf_counter())
        if self.diagnostics is not None:
            self.diagnostics.submit_s += seconds

    def account(self, layer: int, experts, resident: Set[int], prefetch_state) -> None:
        """Diagnostics of one acquire: ``experts`` routed, ``resident`` the ones already in the pool;
        ``prefetch_state(layer, expert)`` says where a submitted read is."""
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
            elif prefetch_state(layer, e) == "ready":
                counts["prefetch_served"] += 1
            else:
                counts["a_not_finished"] += 1  # queued or still being read (or dropped over budget)
        self.diagnostics.add(self._decode, **counts)
