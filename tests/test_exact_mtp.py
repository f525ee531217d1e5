"""Speculative ids against greedy ids, token by token: 4 prompts x K in {2, 3, 4} x both Gated-DeltaNet
commit modes (and K auto with the direct commit) x pools at 100% and 25%. The greedy ids and margins are the
in-memory oracle's (mlx-lm's own model, computed once per prompt for the whole session). A divergence within the near-tie tolerance is
reported (see the exactness section of the run's summary); any other fails."""

import dataclasses

import pytest

from mlx_streaming.model import build_streaming_model
from mlx_streaming.mtp.drafter import MTPDrafter
from mlx_streaming.mtp.speculative import mtp_generate
from mlx_streaming.mtp.triage import first_divergence
from mlx_streaming.harness.pytest_plugin import EXACTNESS_KEY, TEST_PROMPTS

pytestmark = pytest.mark.exact
MAX_TOKENS = 32


@pytest.fixture(scope="module", params=[1.0, 0.25], ids=["pool100", "pool25"])
def spec_setup(request, mtp_path, pool_config, mtp_model):
    """(model with MTP, its pool's share of the experts): built once per pool, shared by every prompt, K and mode.
    pool100 is the suite's model with its head (every expert, or the pool the suite's budget gives); pool25 a
    quarter of the experts, or that budget's pool where it is less."""
    if request.param == 1.0:
        yield mtp_model, mtp_model.store.capacity / mtp_model.store.index.num_experts
        return
    config = pool_config(round(mtp_model.store.index.num_experts * request.param), mtp=True, mtp_path=str(mtp_path))
    if config.pool_slots == mtp_model.store.capacity:
        pytest.skip(f"the suite's memory budget gives {config.pool_slots} slots per MoE layer, less than a quarter of "
                    "the experts: pool100 runs that pool already")
    with build_streaming_model(mtp_model.path, config) as sm:
        yield sm, sm.store.capacity / sm.store.index.num_experts


#: K chosen per step ("auto") runs the same verify and commit as a fixed K: the direct commit covers it.
CASES = [(K, mode) for K in (2, 3, 4) for mode in ("direct", "replay")] + [("auto", "direct")]


@pytest.mark.parametrize("K,commit_mode", CASES)
@pytest.mark.parametrize("prompt", range(len(TEST_PROMPTS)))
def test_speculative_ids_equal_greedy_ids(spec_setup, oracle, prompt_ids, exact_tokens, prompt, K, commit_mode,
                                          record_property):
    sm, pool = spec_setup
    n = min(MAX_TOKENS, exact_tokens)
    greedy_ids, margins = oracle.ids(prompt, n), oracle.margins(prompt, n)
    ids, stats = mtp_generate(sm.model, MTPDrafter(sm.mtp, sm.model), prompt_ids[prompt], n, K, commit_mode)
    divergence = first_divergence(ids, greedy_ids, margins)
    record_property(EXACTNESS_KEY, {
        "prompt": prompt, "K": K, "commit_mode": commit_mode, "pool": f"{pool:.0%}",
        "divergence": None if divergence is None else {**dataclasses.asdict(divergence), "near_tie": divergence.near_tie},
    })
    assert stats["tokens"] == n and stats["commit_mode"] == commit_mode
    assert divergence is None or divergence.near_tie, f"speculative ids diverge from greedy: {divergence}"


def test_one_k_chooser_kept_across_server_requests_and_every_request_equals_greedy(mtp_model, oracle, prompt_ids,
                                                                                   exact_tokens):
    """``serve`` answers greedy requests through ``loop.engine_step`` with one K chooser for the model: each
    request starts from what the ones before it measured, and each one's ids are greedy's."""
    import mlx.core as mx

    from mlx_streaming.integrations import loop

    def sampler(logprobs):
        return mx.argmax(logprobs, axis=-1)

    sampler.greedy = True  # what the server's sampler says of a request at temperature 0
    engine = loop.EngineLoop(mtp_model, "auto", "direct", speculate=True)
    n, drafted = min(MAX_TOKENS, exact_tokens), 0
    for prompt in range(len(TEST_PROMPTS)):
        steps = list(loop.engine_step(mx.array(prompt_ids[prompt]), mtp_model.model, engine, max_tokens=n,
                                      sampler=sampler))
        ids = [token for token, _, _ in steps]
        divergence = first_divergence(ids, oracle.ids(prompt, n), oracle.margins(prompt, n))
        assert divergence is None or divergence.near_tie, f"prompt {prompt}: {divergence}"
        drafted += sum(from_draft for _, _, from_draft in steps)
    assert engine.chooser.step > n  # one request takes at most n - 1 steps: the chooser counted several
    assert drafted > 0  # the first request's climb probes K=2: drafts were committed
