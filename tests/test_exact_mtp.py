"""Speculative ids against greedy ids, token by token: 4 prompts x K in {2, 3, 4} x both Gated-DeltaNet
commit modes x pools at 100% and 25%. A divergence within the near-tie tolerance is reported (see the
exactness section of the run's summary); any other fails."""

import dataclasses

import pytest

from mlx_streaming.generate import greedy_generate
from mlx_streaming.model import build_streaming_model
from mlx_streaming.mtp.drafter import MTPDrafter
from mlx_streaming.mtp.speculative import mtp_generate
from mlx_streaming.mtp.triage import first_divergence
from mlx_streaming.pytest_plugin import EXACTNESS_KEY, TEST_PROMPTS

pytestmark = pytest.mark.exact
MAX_TOKENS = 32


@pytest.fixture(scope="module", params=[1.0, 0.25], ids=["pool100", "pool25"])
def spec_setup(request, model_dir, mtp_path, streaming_config, mtp_model):
    """(model with MTP, pool fraction, greedy ids and margins per prompt)."""
    if request.param == 1.0:
        sm, owned = mtp_model, None
    else:
        slots = round(mtp_model.store.index.num_experts * request.param)
        owned = sm = build_streaming_model(model_dir, streaming_config.replace(mtp=True, mtp_path=str(mtp_path), pool_slots=slots))
    greedy = {}
    for i, prompt in enumerate(TEST_PROMPTS):
        margins = []
        greedy[i] = (greedy_generate(sm.model, sm.tokenizer.encode(prompt), MAX_TOKENS, margins=margins), margins)
    yield sm, request.param, greedy
    if owned is not None:
        owned.close()


@pytest.mark.parametrize("verify_mode", ["direct", "replay"])
@pytest.mark.parametrize("K", [2, 3, 4])
@pytest.mark.parametrize("prompt", range(len(TEST_PROMPTS)))
def test_speculative_ids_equal_greedy_ids(spec_setup, prompt, K, verify_mode, record_property):
    sm, pool, greedy = spec_setup
    greedy_ids, margins = greedy[prompt]
    ids, stats = mtp_generate(sm.model, MTPDrafter(sm.mtp, sm.model), sm.tokenizer.encode(TEST_PROMPTS[prompt]),
                              MAX_TOKENS, K, verify_mode)
    divergence = first_divergence(ids, greedy_ids, margins)
    record_property(EXACTNESS_KEY, {
        "prompt": prompt, "K": K, "verify_mode": verify_mode, "pool": f"{pool:.0%}",
        "divergence": None if divergence is None else {**dataclasses.asdict(divergence), "near_tie": divergence.near_tie},
    })
    assert stats["tokens"] == MAX_TOKENS and stats["verify_mode"] == verify_mode
    assert divergence is None or divergence.near_tie, f"speculative ids diverge from greedy: {divergence}"
