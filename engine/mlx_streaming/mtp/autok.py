"""KChooser: the tokens per verify (K; 1 = no speculation) that maximise tokens per second, chosen while decoding.

Speculation pays only where a K-token verify costs much less than K decode steps (an accelerator bound by
memory bandwidth); on a compute-bound CPU it costs about K steps and loses. So nothing is assumed: the chooser
measures, per K, the wall seconds of a whole step (drafting, the verify, the commit) and, per draft position,
how often a draft is accepted given the drafts before it were. A step at K is then expected to commit
``1 + sum_i prod_{j<=i} p_j`` tokens (``p_j``: position j's acceptance, Laplace-smoothed), and the chooser picks
the K with the most expected tokens per second. Every K is probed ``PROBE_STEPS`` times first; afterwards the
K measured longest ago is probed once every ``REPROBE_EVERY`` steps, so the choice follows drifting costs and
acceptance. Exactness does not depend on K: every step commits greedy's ids.
"""

from __future__ import annotations

from typing import Dict, List

PROBE_STEPS = 1
REPROBE_EVERY = 64
#: Weight of the newest step in a K's cost (exponential moving average).
COST_WEIGHT = 0.3


class KChooser:
    def __init__(self, k_max: int = 4):
        self.candidates = list(range(1, k_max + 1))
        self.cost: Dict[int, float] = {}  #: K -> seconds per step (moving average)
        self.steps: Dict[int, int] = {k: 0 for k in self.candidates}
        self.seconds: Dict[int, float] = {k: 0.0 for k in self.candidates}  #: all steps at K together
        self.committed: Dict[int, int] = {k: 0 for k in self.candidates}  #: tokens those steps committed
        self.last_step: Dict[int, int] = {k: -1 for k in self.candidates}
        self.tried: List[int] = [0] * k_max  #: per draft position (1-based index), drafts verified there
        self.accepted: List[int] = [0] * k_max  #: of those, accepted
        self.step = 0

    def choose(self) -> int:
        unprobed = [k for k in self.candidates if self.steps[k] < PROBE_STEPS]
        if unprobed:
            return unprobed[0]
        if self.step % REPROBE_EVERY == REPROBE_EVERY - 1:
            return min(self.candidates, key=lambda k: self.last_step[k])
        return self.best()

    def best(self) -> int:
        return max(self.candidates, key=self.expected_tok_s)

    def record(self, k: int, seconds: float, accepted: int) -> None:
        """One step at ``k`` took ``seconds`` and accepted ``accepted`` of its ``k - 1`` drafts."""
        self.cost[k] = seconds if k not in self.cost else (1 - COST_WEIGHT) * self.cost[k] + COST_WEIGHT * seconds
        self.steps[k] += 1
        self.seconds[k] += seconds
        self.committed[k] += accepted + 1
        self.last_step[k] = self.step
        self.step += 1
        for position in range(1, min(accepted + 1, k - 1) + 1):
            self.tried[position] += 1
            self.accepted[position] += position <= accepted

    def acceptance(self, position: int) -> float:
        return (self.accepted[position] + 1) / (self.tried[position] + 2)

    def expected_tokens(self, k: int) -> float:
        tokens, reach = 1.0, 1.0
        for position in range(1, k):
            reach *= self.acceptance(position)
            tokens += reach
        return tokens

    def expected_tok_s(self, k: int) -> float:
        return self.expected_tokens(k) / self.cost[k] if self.cost.get(k) else 0.0

    def summary(self) -> List[dict]:
        """Per K: steps taken, ms per step (moving average), expected tokens per step and tok/s, the tok/s its
        steps achieved, and whether it is the choice."""
        best = self.best() if self.cost else None
        return [{"K": k, "steps": self.steps[k], "ms_per_step": 1000 * self.cost[k] if k in self.cost else None,
                 "expected_tokens_per_step": self.expected_tokens(k), "expected_tok_s": self.expected_tok_s(k),
                 "achieved_tok_s": self.committed[k] / self.seconds[k] if self.seconds[k] else None,
                 "chosen": k == best} for k in self.candidates]
