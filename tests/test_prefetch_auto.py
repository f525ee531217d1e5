"""--prefetch auto: the switch's rule on planted costs, and a streaming model using it stays exact."""

import pytest

from mlx_streaming.prefetch.switch import EXPLOIT, WINDOW, PrefetchSwitch


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def _decode(switch, clock, forwards, cost_on, cost_off, tokens=1):
    """Run ``forwards`` forwards; each takes ``cost_on`` or ``cost_off`` seconds per token by the switch's arm."""
    arms = []
    for _ in range(forwards):
        on = switch.forward(tokens)
        arms.append(on)
        clock.now += (cost_on if on else cost_off) * tokens
    return arms


def test_probes_both_arms_then_keeps_the_cheaper_and_probes_again():
    clock = _Clock()
    switch = PrefetchSwitch(clock)
    probes = 2 * (WINDOW + 1)
    arms = _decode(switch, clock, probes + EXPLOIT, cost_on=0.2, cost_off=0.1)
    assert arms[:probes] == [True] * (WINDOW + 1) + [False] * (WINDOW + 1)
    assert switch.decisions == [False] and switch.measured == {True: pytest.approx(0.2), False: pytest.approx(0.1)}
    assert arms[probes:] == [False] * EXPLOIT
    assert _decode(switch, clock, 1, 0.2, 0.1) == [True]  # the next probe round begins


def test_prefetch_that_pays_stays_on_and_prefill_chunks_are_not_timed():
    clock = _Clock()
    switch = PrefetchSwitch(clock)
    _decode(switch, clock, 3, cost_on=0.1, cost_off=0.3)
    _decode(switch, clock, 1, cost_on=100.0, cost_off=100.0, tokens=64)  # a long prefill: not a decode forward
    _decode(switch, clock, 2 * (WINDOW + 1), cost_on=0.1, cost_off=0.3)
    assert switch.decisions == [True] and switch.measured == {True: pytest.approx(0.1), False: pytest.approx(0.3)}


def test_auto_prefetch_decodes_greedy_ids(model_dir, reference_model):
    from mlx_streaming.config import StreamingConfig
    from mlx_streaming.decode.greedy import greedy_generate
    from mlx_streaming.model import build_streaming_model

    with build_streaming_model(model_dir, StreamingConfig(pool_slots=6, prefetch="auto")) as sm:
        ids = sm.tokenizer.encode("def fibonacci(n):")
        got = greedy_generate(sm.model, ids, 40)
        s = sm.store.stats()
        assert sm.prefetch.switch.decisions  # both arms were probed and a decision taken
    assert got == greedy_generate(reference_model, ids, 40)
    assert s["prefetch_off_forwards"] >= WINDOW + 1 and s["prefetch_submitted"] > 0
