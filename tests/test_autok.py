"""--k auto: the chooser's rule on planted cost profiles, and the bench showing its measurements."""

import random

from mlx_streaming.mtp.autok import CLIMB_AFTER, REPROBE_EVERY, KChooser


def _run(chooser, steps, cost, acceptance, seed=0):
    """Drive ``chooser`` with a planted profile: a step at K costs ``cost(K)`` seconds (``cost(K, step)`` where it
    takes two arguments) and each draft is accepted with probability ``acceptance`` while the drafts before it
    were."""
    rng = random.Random(seed)
    chosen = []
    for step in range(steps):
        k = chooser.choose()
        accepted = 0
        while accepted < k - 1 and rng.random() < acceptance:
            accepted += 1
        chooser.record(k, cost(k) if cost.__code__.co_argcount == 1 else cost(k, step), accepted)
        chosen.append(k)
    return chosen


def test_the_climb_stops_where_speculation_stops_paying_and_reprobes_back_off():
    chooser = KChooser(k_max=4)
    chosen = _run(chooser, 200, cost=lambda k: 0.01 * k, acceptance=0.5)
    assert chosen[:CLIMB_AFTER + 2] == [1] * CLIMB_AFTER + [2, 1]  # K=2 lost to K=1: K=3 and K=4 never run
    assert chooser.steps[3] == chooser.steps[4] == 0
    # K=2 again REPROBE_EVERY steps after the climb, then twice as long after each reprobe that changed nothing
    climbed = CLIMB_AFTER + 1
    assert [i for i, k in enumerate(chosen) if k == 2] == [CLIMB_AFTER, climbed + REPROBE_EVERY,
                                                           climbed + 1 + 3 * REPROBE_EVERY]


def test_where_a_verify_costs_k_steps_auto_keeps_the_pace_of_k_1():
    """This CPU's profile (a K-token verify costs about K steps): auto's tokens per second over a short and a
    long run stay within 3% of K=1's, the probes included."""
    for steps in (64, 512):
        chooser = KChooser()
        _run(chooser, steps, cost=lambda k: 0.070 * k, acceptance=0.6)
        assert chooser.best() == 1
        tokens, seconds = sum(chooser.committed.values()), sum(chooser.seconds.values())
        assert tokens / seconds >= 0.97 / 0.070


def test_a_cheap_verify_with_good_drafts_climbs_to_k_above_one():
    chooser = KChooser()
    chosen = _run(chooser, 100, cost=lambda k: 0.010 + 0.001 * k, acceptance=0.8)  # an accelerator's profile
    assert chosen[CLIMB_AFTER - 1:CLIMB_AFTER + 3] == [1, 2, 3, 4] and chooser.best() > 1 and chosen[-10:].count(chooser.best()) >= 9
    rows = {r["K"]: r for r in chooser.summary()}
    assert rows[chooser.best()]["chosen"] and rows[chooser.best()]["expected_tok_s"] > rows[1]["expected_tok_s"]
    assert rows[1]["achieved_tok_s"] == rows[1]["steps"] / (rows[1]["steps"] * (0.010 + 0.001))


def test_a_verify_that_becomes_cheap_is_found_by_a_reprobe():
    chooser = KChooser()
    chosen = _run(chooser, 400, cost=lambda k, step: 0.01 * k if step < 100 else 0.010 + 0.001 * k, acceptance=0.8)
    assert chosen[CLIMB_AFTER - 1:CLIMB_AFTER + 2] == [1, 2, 1] and chooser.best() > 1 and chosen[-10:].count(chooser.best()) >= 9


def test_acceptance_is_counted_per_draft_position():
    chooser = KChooser(k_max=4)
    chooser.record(4, 1.0, 1)  # draft 1 accepted, draft 2 rejected, draft 3 never compared
    assert (chooser.tried[1:], chooser.accepted[1:]) == ([1, 1, 0], [1, 0, 0])
    chooser.record(3, 1.0, 2)  # both drafts accepted
    assert (chooser.tried[1:], chooser.accepted[1:]) == ([2, 2, 0], [2, 1, 0])


def test_a_probe_slowed_by_its_switch_is_probed_again_before_the_climb_stops():
    """The first step at a new K can cost more than its steady ones (the loads of a larger union of experts): a K
    close behind the best after one step is probed again, and the climb goes on where its steady steps pay."""
    seen = set()

    def cost(k):
        first = k not in seen
        seen.add(k)
        return (0.010 + 0.004 * (k - 1)) * (1.3 if first and k > 1 else 1.0)

    chooser = KChooser()
    chosen = _run(chooser, 100, cost=cost, acceptance=1.0)  # every draft accepted: the costs alone decide
    assert chosen[CLIMB_AFTER:CLIMB_AFTER + 3] == [2, 2, 3] and chooser.best() > 1
