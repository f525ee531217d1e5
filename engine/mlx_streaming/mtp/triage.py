"""Triage of a divergence between speculative and greedy ids.

At the first step where the ids differ, the greedy run's top-2 logit gap decides: a gap within the
tolerance is a floating-point near-tie (a verify of K tokens may pick other kernels than a one-token step,
as Metal does, and round differently), reported and allowed; a wider gap is a bug. The default tolerance is
two bf16 units in the last place of the top-1 logit (2 x 2^-7 relative): a near-tie is a gap the rounding
of one bf16 matmul output can close, nothing more. On the CPU backend a K-token verify is bit-identical to K
one-token steps, so there any divergence is a bug; the triage is for Metal.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

BF16_ULP = 2.0 ** -7
DEFAULT_ULPS = 2.0


@dataclass(frozen=True)
class Divergence:
    step: int
    spec_id: int
    top1: int
    top2: int
    gap: float
    tolerance: float

    @property
    def near_tie(self) -> bool:
        return self.gap <= self.tolerance


def tolerance_for(top1_logit: float, ulps: float = DEFAULT_ULPS) -> float:
    return ulps * BF16_ULP * max(abs(top1_logit), 1.0)


def first_divergence(spec_ids: Sequence[int], greedy_ids: Sequence[int],
                     margins: Sequence[Tuple[int, int, float, float]], ulps: float = DEFAULT_ULPS) -> Optional[Divergence]:
    """``margins[i]``: the greedy run's (top-1 id, top-2 id, gap, top-1 logit) at step ``i``."""
    for step, (s, g) in enumerate(zip(spec_ids, greedy_ids)):
        if s != g:
            top1, top2, gap, top1_logit = margins[step]
            return Divergence(step, s, top1, top2, gap, tolerance_for(top1_logit, ulps))
    if len(spec_ids) != len(greedy_ids):
        raise ValueError(f"speculative run gave {len(spec_ids)} ids, greedy {len(greedy_ids)}")
    return None
