"""PrefetchSwitch: prefetch on where it pays, off where it does not, decided while decoding (``--prefetch auto``).

Prefetch hides demand reads behind compute, but costs a router matmul and a host sync per layer for its
prediction; where decode is compute-bound (this CPU) or the pool already holds what is routed, that cost is
not won back. So it is measured: decode forwards (at most 16 tokens) alternate between probe windows of
``WINDOW`` forwards with prefetch on and off (the first forward of a window settles and is not counted), then the
cheaper arm, by median wall seconds per token, runs for ``EXPLOIT`` forwards before both are probed again.
Prefetch changes which experts are read when, never which are routed: the ids are greedy's either way.
"""

from __future__ import annotations

import statistics
import time
from typing import Dict, List, Optional, Tuple

WINDOW = 12
EXPLOIT = 96


class PrefetchSwitch:
    def __init__(self, clock=time.perf_counter):
        self.clock = clock
        self.on = True
        self._plan: List[Tuple[bool, bool]] = _probes()  # (prefetch on, timed) for the coming forwards
        self._probing = True
        self._left = 0  # forwards of the current decision before the next probes
        self._window: Dict[bool, List[float]] = {True: [], False: []}
        self._timing: Optional[tuple] = None  # (arm, timed, start, tokens) of the running forward
        #: Median seconds per token of each arm in the last probes, and every decision taken (True: on).
        self.measured: Dict[bool, float] = {}
        self.decisions: List[bool] = []

    def forward(self, tokens: int) -> bool:
        """A forward of ``tokens`` tokens starts (the previous one has ended); whether it prefetches."""
        now = self.clock()
        if self._timing is not None:
            arm, timed, start, n = self._timing
            if timed:
                self._window[arm].append((now - start) / n)
            self._timing = None
        if self._probing and not self._plan:
            self._decide()
        if tokens > 16:  # a prefill chunk: neither timed nor counted
            return self.on
        if not self._probing:
            if self._left:
                self._left -= 1
            else:
                self._plan, self._window, self._probing = _probes(), {True: [], False: []}, True
        if self._plan:
            self.on, timed = self._plan.pop(0)
            self._timing = (self.on, timed, now, tokens)
        return self.on

    def _decide(self) -> None:
        self.measured = {arm: statistics.median(v) for arm, v in self._window.items() if v}
        self.on = self.measured.get(True, float("inf")) <= self.measured.get(False, float("inf"))
        self.decisions.append(self.on)
        self._probing, self._left = False, EXPLOIT


def _probes() -> List[Tuple[bool, bool]]:
    """One probe round: each arm for a settling forward, then ``WINDOW`` timed ones."""
    return [(arm, timed) for arm in (True, False) for timed in [False] + [True] * WINDOW]
