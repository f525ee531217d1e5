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
def spec_setup(request, model_dir, mtp_path, streaming_config, mtp_model):
    """(model with MTP, pool fraction): built once per pool, shared by every prompt, K and mode."""
    if request.param == 1.0:
        yield mtp_model, request.param
        return
    slots = round(mtp_model.store.index.num_experts * request.param)
    with build_streaming_model(model_dir, streaming_config.replace(mtp=True, mtp_path=str(mtp_path), pool_slots=slots)) as sm:
        yield sm, request.param


#: K chosen per step ("auto") runs the same verify and commit as a fixed K: the direct commit covers it.
CASES = [(K, mode) for K in (2, 3, 4) for mode in ("direct", "replay")] + [("auto", "direct")]


@pytest.mark.parametrize("K,verify_mode", CASES)
@pytest.mark.parametrize("prompt", range(len(TEST_PROMPTS)))
def test_speculative_ids_equal_greedy_ids(spec_setup, oracle, prompt_ids, prompt, K, verify_mode, record_property):
    sm, pool = spec_setup
    greedy_ids, margins = oracle.ids(prompt, MAX_TOKENS), oracle.margins(prompt, MAX_TOKENS)
    ids, stats = mtp_generate(sm.model, MTPDrafter(sm.mtp, sm.model), prompt_ids[prompt], MAX_TOKENS, K, verify_mode)
    divergence = first_divergence(ids, greedy_ids, margins)
    record_property(EXACTNESS_KEY, {
        "prompt": prompt, "K": K, "verify_mode": verify_mode, "pool": f"{pool:.0%}",
        "divergence": None if divergence is None else {**dataclasses.asdict(divergence), "near_tie": divergence.near_tie},
    })
    assert stats["tokens"] == MAX_TOKENS and stats["verify_mode"] == verify_mode
    assert divergence is None or divergence.near_tie, f"speculative ids diverge from greedy: {divergence}"
