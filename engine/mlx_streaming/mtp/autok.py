"""KChooser: the tokens per verify (K; 1 = no speculation) that maximise tokens per second, chosen while decoding.

Speculation pays only where a K-token verify costs much less than K decode steps (an accelerator bound by
memory bandwidth); on a compute-bound CPU it costs about K steps and loses, and at a bounded pool a verify also
loads the union of its tokens' experts. So nothing is assumed: the chooser measures, per K, the wall seconds of
a whole step (drafting, the verify with its loads, the commit) and, per draft position, how often a draft is
accepted given the drafts before it were. A step at K is then expected to commit ``1 + sum_i prod_{j<=i} p_j``
tokens (``p_j``: position j's acceptance, Laplace-smoothed), and the chooser picks the measured K with the most
expected tokens per second.

A probe of a K that does not pay costs tokens, so probes are few. The chooser climbs: K=1 first (``CLIMB_AFTER``
steps), then the K above the largest measured while the most that K could reach (its expected tokens at the
acceptance measured so far, in the step time of the K below: a further draft position never makes a step cheaper)
comes within ``UNSURE`` of the best. That bound, not the K below's own rate, decides, because a step with drafts
pays a fixed cost and, on a GPU, each further position little: K=2 can read below K=1 where K=3 and K=4 are well
above it (an H100 at a full pool: K=2 0.98x of K=1, K=3 and K=4 1.14x), while on a compute-bound CPU, where a
verify costs about K steps, the bound falls with every K. A K within UNSURE of the best, measured on fewer than
``PROBE_MAX`` recent steps, is probed again first: one step can be a switch's transient. Then it reprobes the best
K's neighbours and any K reading within UNSURE of it, the one measured longest ago, first ``REPROBE_EVERY`` steps
after the climb, the interval doubling (to ``REPROBE_MAX``) while reprobes leave the choice as it was and starting
over when one changes it: the choice follows drifting costs and acceptance, and where speculation never pays, auto
spends a K=2 step (and, where its bound reads close, a K=3 step) in its first 64 and a few after.

A choice of K=1 holds until the chooser's next decision (``hold``), so the decoder runs those steps one ahead, as
greedy decoding does, and records them as one stretch (``record_ahead``): a step's own time in a stretch depends
on its place in it, not on K. Exactness does not depend on K: every step commits greedy's ids.

A chooser can be kept across runs of one loaded model (``serve`` keeps one per model; ``begin`` starts each run):
what a step costs at each K is the machine's and the pool's, so a later run starts at the K measured best, with no
climb, and its reprobes go on where the last run's left off; each run's first step is not weighed, and acceptance,
which the text decides (code drafts better than prose), carries at most ``ACCEPT_CARRIED`` outcomes per draft
position into the next run.
"""

from __future__ import annotations

import statistics
from collections import deque
from typing import Deque, Dict, List, Optional

#: Steps at K=1 before the climb probes K=2 (the first steps after a prefill, or after other work changed the
#: pool, cost more than the steady ones; the very first, which carries the prefill's transition, runs alone and is
#: not weighed, so K=1 starts the climb with PROBE_MAX steps measured).
CLIMB_AFTER = 5
#: A K whose recent steps read within this share of the best K's expected tokens per second is probed again, up
#: to PROBE_MAX steps (one step can be a switch's transient, the loads of a larger union of experts, or noise),
#: and the climb goes on to the K above while the most it could reach does.
UNSURE = 0.9
PROBE_MAX = 4
REPROBE_EVERY = 64
#: Steps a reprobe of K=1 holds: a stretch run one ahead pays its first step's wait once (on this CPU its first
#: step takes about twice a steady one), which a one-step reprobe would weigh as K=1's cost.
AHEAD_PROBE = 4
REPROBE_MAX = 1024
#: A K's cost is the median of its last COST_WINDOW steps (of those since it last ran more than REPROBE_EVERY
#: steps before: a reprobe's earlier measures are from another time). A median, because a step now and then takes
#: several times its neighbours (on an H100 one of about 40 steps with drafts took 90 ms against their 18), and in
#: a mean one such step hides a K that pays until its window forgets it; a stretch without drafts is recorded at
#: its mean (``record_ahead``), so its own spikes are spread over its steps.
COST_WINDOW = 8
#: Outcomes per draft position a kept chooser carries into its next run (``begin``): enough to start from what
#: the model's drafts did so far, few enough that the new text's own outcomes soon outweigh them.
ACCEPT_CARRIED = 32


class KChooser:
    def __init__(self, k_max: int = 4):
        self.candidates = list(range(1, k_max + 1))
        self.cost: Dict[int, float] = {}  #: K -> seconds per step (median of its recent steps)
        self._recent: Dict[int, Deque[float]] = {k: deque(maxlen=COST_WINDOW) for k in self.candidates}
        self.steps: Dict[int, int] = {k: 0 for k in self.candidates}
        self.seconds: Dict[int, float] = {k: 0.0 for k in self.candidates}  #: all steps at K together
        self.committed: Dict[int, int] = {k: 0 for k in self.candidates}  #: tokens those steps committed
        self.last_step: Dict[int, int] = {k: -1 for k in self.candidates}
        self.tried: List[float] = [0] * k_max  #: per draft position (1-based index), drafts verified there
        self.accepted: List[float] = [0] * k_max  #: of those, accepted
        self.step = 0
        self._first = True  #: the next step is its run's first (after the prefill): run alone, not weighed
        #: Steps between reprobes, and the step of the next (None: still climbing).
        self.interval = REPROBE_EVERY
        self.next_reprobe: Optional[int] = None
        self._reprobe_of: Optional[int] = None  #: the choice a reprobe running now was made against

    def begin(self) -> None:
        """A run starts (its prompt prefilled). Its first step is not weighed; the measured costs and the reprobe
        schedule stand (a reprobe the last run left unfinished is dropped); acceptance keeps at most ACCEPT_CARRIED
        outcomes per position, scaled down from what it counted."""
        self._first = True
        self._reprobe_of = None
        for position, tried in enumerate(self.tried):
            if tried > ACCEPT_CARRIED:
                self.accepted[position] *= ACCEPT_CARRIED / tried
                self.tried[position] = ACCEPT_CARRIED

    def choose(self) -> int:
        climb = self._climb()
        if climb is not None:
            return climb
        best = self.best()
        if self.next_reprobe is None:
            self.next_reprobe = self.step + self.interval
        if self.step >= self.next_reprobe:
            self._reprobe_of = best
            return min(self._reprobed(best), key=lambda k: self.last_step[k])
        return best

    def hold(self) -> int:
        """How many steps a choice of K=1 just made holds before the chooser decides again: the first step alone
        (it carries the prefill's transition and is not weighed), then the climb's steps left at K=1,
        ``AHEAD_PROBE`` for a reprobe, else the steps until the next reprobe. The decoder runs them one step ahead,
        the way greedy decoding runs (a step without drafts has nothing to wait for), and records them together
        (``record_ahead``)."""
        if self._first:
            return 1
        if self.steps[self.candidates[0]] < CLIMB_AFTER:
            return CLIMB_AFTER - self.steps[self.candidates[0]]
        if self._reprobe_of is not None or self._climb() is not None:  # a probe
            return AHEAD_PROBE
        return max(1, self.next_reprobe - self.step)

    def _climb(self) -> Optional[int]:
        """The K to probe next, or None: a K whose steps read within UNSURE of the best's, measured on fewer than
        PROBE_MAX of its recent steps, is probed again (the least measured first: one step can be a switch's
        transient, or noise); then the K above the largest measured, where the most it could reach (its expected
        tokens at the acceptance measured so far, in the step time of the K below it: a further draft position
        never makes a step cheaper) comes within UNSURE of the best."""
        if self.steps[self.candidates[0]] < CLIMB_AFTER:
            return self.candidates[0]
        best = self.best()
        bar = UNSURE * self.expected_tok_s(best)
        close = [k for k in self.cost
                 if k != best and len(self._recent[k]) < PROBE_MAX and self.expected_tok_s(k) >= bar]
        if close:
            return min(close, key=lambda k: (len(self._recent[k]), k))
        top = max(self.cost)
        if top < self.candidates[-1] and self.expected_tokens(top + 1) / self.cost[top] >= bar:
            return top + 1
        return None

    def _reprobed(self, best: int) -> List[int]:
        """The Ks a reprobe chooses from: ``best``'s neighbours, and any other measured K that reads within UNSURE
        of it (one unlucky probe must not rule out for good a K that is not a neighbour of the choice)."""
        bar = UNSURE * self.expected_tok_s(best)
        return sorted({n for n in (best - 1, best + 1) if n in self.steps}
                      | {k for k in self.cost if k != best and self.expected_tok_s(k) >= bar})

    def best(self) -> int:
        """The measured K with the most expected tokens per second."""
        measured = [k for k in self.candidates if k in self.cost] or self.candidates[:1]
        return max(measured, key=self.expected_tok_s)

    def record_ahead(self, seconds: List[float]) -> None:
        """A stretch of steps without drafts, run one ahead, took ``seconds`` (per step). A step's own time there
        depends on its place, not on K: the first waits for its own forward and queues the next, the last finds its
        forward done (on this CPU about 2x and 0.2x of a steady step), so every step is weighed at the stretch's
        mean; a short stretch, whose first step weighs more, is what a switch to K=1 costs."""
        mean = sum(seconds) / len(seconds)
        for _ in seconds:
            self.record(1, mean, 0)

    def record(self, k: int, seconds: float, accepted: int) -> None:
        """One step at ``k`` took ``seconds`` and accepted ``accepted`` of its ``k - 1`` drafts."""
        if self.step - self.last_step[k] > REPROBE_EVERY:
            self._recent[k].clear()
        if not self._first:
            self._recent[k].append(seconds)
            self.cost[k] = statistics.median(self._recent[k])
        self._first = False
        self.steps[k] += 1
        self.seconds[k] += seconds
        self.committed[k] += accepted + 1
        self.last_step[k] = self.step
        self.step += 1
        for position in range(1, min(accepted + 1, k - 1) + 1):
            self.tried[position] += 1
            self.accepted[position] += position <= accepted
        if self._reprobe_of is not None:  # a reprobe: back off while the choice stands, start over when it moves
            kept = self.best() == self._reprobe_of
            self.interval = min(2 * self.interval, REPROBE_MAX) if kept else REPROBE_EVERY
            self.next_reprobe, self._reprobe_of = self.step + self.interval, None

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
        """Per K: steps taken, ms per step (median of its recent steps), expected tokens per step and tok/s, the
        tok/s its steps achieved, and whether it is the choice."""
        best = self.best() if self.cost else None
        return [{"K": k, "steps": self.steps[k], "ms_per_step": 1000 * self.cost[k] if k in self.cost else None,
                 "expected_tokens_per_step": self.expected_tokens(k), "expected_tok_s": self.expected_tok_s(k),
                 "achieved_tok_s": self.committed[k] / self.seconds[k] if self.seconds[k] else None,
                 "chosen": k == best} for k in self.candidates]
