"""Near-tie triage: the classification itself, and a planted perturbation through the real pipeline."""

import mlx.core as mx
import mlx.nn as nn
import pytest

from mlx_streaming.mtp.drafter import MTPDrafter
from mlx_streaming.mtp.speculative import mtp_generate
from mlx_streaming.mtp.triage import BF16_ULP, first_divergence, tolerance_for


def test_identical_runs_have_no_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3], [(1, 0, 1.0, 5.0)] * 3) is None


def test_gap_within_tolerance_is_a_near_tie_and_wider_is_a_bug():
    tol = tolerance_for(10.0)
    assert tol == pytest.approx(2 * BF16_ULP * 10.0)
    tie = first_divergence([1, 9], [1, 2], [(1, 0, 1.0, 10.0), (2, 9, tol / 2, 10.0)])
    bug = first_divergence([1, 9], [1, 2], [(1, 0, 1.0, 10.0), (2, 9, tol * 2, 10.0)])
    assert tie.step == 1 and tie.near_tie and (tie.top1, tie.top2) == (2, 9)
    assert bug.step == 1 and not bug.near_tie


class VerifyNudge(nn.Module):
    """Wraps lm_head: in multi-token (verify) calls, raises the top-2 logit by ``delta`` at every position
    whose top-1 / top-2 are ``pair``. A planted kernel difference, visible only to the verify."""

    def __init__(self, inner, pair, delta: float):
        super().__init__()
        self.inner, self.pair, self.delta = inner, pair, delta

    def __call__(self, h):
        logits = self.inner(h)
        if h.shape[1] == 1:
            return logits
        order = mx.argsort(-logits.astype(mx.float32), axis=-1)
        first, second = order[..., 0:1], order[..., 1:2]
        top1, top2 = self.pair  # in either order: an exact tie may sort either way
        hit = ((first == top1) & (second == top2)) | ((first == top2) & (second == top1))
        bump = hit * (mx.arange(logits.shape[-1]) == self.pair[1]) * self.delta
        return (logits.astype(mx.float32) + bump).astype(logits.dtype)


@pytest.mark.parametrize("near_tie", [True, False])
def test_planted_perturbation_is_triaged(mtp_model, oracle, prompt_ids, near_tie):
    """Flip the verify's choice at the closest greedy step (a near-tie) or at the widest (a bug)."""
    sm = mtp_model
    ids = prompt_ids[0]
    greedy, margins = oracle.ids(0, 24), oracle.margins(0, 24)
    pick = min if near_tie else max
    step = pick(range(1, len(margins)), key=lambda i: margins[i][2])  # decode steps only: the verify sees them
    top1, top2, gap, top1_logit = margins[step]
    original = sm.model.lm_head
    # an exact tie (gap 0) still flips: at least one bf16 unit of the top-1 logit
    sm.model.lm_head = VerifyNudge(original, (top1, top2), max(gap * 1.5, tolerance_for(top1_logit) / 2))
    try:
        spec, _ = mtp_generate(sm.model, MTPDrafter(sm.mtp, sm.model), ids, 24, K=2, commit_mode="direct")
    finally:
        sm.model.lm_head = original
    d = first_divergence(spec, greedy, margins)
    assert d is not None, "the planted perturbation changed nothing"
    assert (d.step, d.spec_id) == (step, top2)
    assert d.near_tie == near_tie, d
