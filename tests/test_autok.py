"""--k auto: the chooser's rule on planted cost profiles, and the bench showing its measurements."""

import random

from mlx_streaming.mtp.autok import PROBE_STEPS, REPROBE_EVERY, KChooser


def _run(chooser, steps, cost, acceptance, seed=0):
    """Drive ``chooser`` with a planted profile: a step at K costs ``cost(K)`` seconds and each draft is accepted
    with probability ``acceptance`` while the drafts before it were."""
    rng = random.Random(seed)
    chosen = []
    for _ in range(steps):
        k = chooser.choose()
        accepted = 0
        while accepted < k - 1 and rng.random() < acceptance:
            accepted += 1
        chooser.record(k, cost(k), accepted)
        chosen.append(k)
    return chosen


def test_every_k_is_probed_first_then_reprobed_now_and_then():
    chooser = KChooser(k_max=4)
    chosen = _run(chooser, 200, cost=lambda k: 0.01 * k, acceptance=0.5)
    assert chosen[:4 * PROBE_STEPS] == [k for k in (1, 2, 3, 4) for _ in range(PROBE_STEPS)]
    # after the probes K=1 wins; every REPROBE_EVERY steps the K measured longest ago runs once: 2, then 3, then 4
    assert 200 // REPROBE_EVERY == 3
    assert [chooser.steps[k] for k in (2, 3, 4)] == [PROBE_STEPS + 1] * 3
    assert chooser.steps[1] == 200 - 3 * (PROBE_STEPS + 1)


def test_a_verify_that_costs_k_steps_turns_speculation_off():
    chooser = KChooser()
    _run(chooser, 100, cost=lambda k: 0.070 * k, acceptance=0.6)  # this CPU: a K-token verify costs ~K steps
    assert chooser.best() == 1


def test_a_cheap_verify_with_good_drafts_picks_k_above_one():
    chooser = KChooser()
    chosen = _run(chooser, 100, cost=lambda k: 0.010 + 0.001 * k, acceptance=0.8)  # an accelerator's profile
    assert chooser.best() > 1 and chosen[-10:].count(chooser.best()) >= 9
    rows = {r["K"]: r for r in chooser.summary()}
    assert rows[chooser.best()]["chosen"] and rows[chooser.best()]["expected_tok_s"] > rows[1]["expected_tok_s"]
    assert rows[1]["achieved_tok_s"] == rows[1]["steps"] / (rows[1]["steps"] * (0.010 + 0.001))


def test_acceptance_is_counted_per_draft_position():
    chooser = KChooser(k_max=4)
    chooser.record(4, 1.0, 1)  # draft 1 accepted, draft 2 rejected, draft 3 never compared
    assert (chooser.tried[1:], chooser.accepted[1:]) == ([1, 1, 0], [1, 0, 0])
    chooser.record(3, 1.0, 2)  # both drafts accepted
    assert (chooser.tried[1:], chooser.accepted[1:]) == ([2, 2, 0], [2, 1, 0])
