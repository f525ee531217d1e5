"""The streaming model against mlx-lm's in-memory model on the same checkpoint (the oracle)."""

import mlx.core as mx
import pytest

from mlx_streaming.config import StreamingConfig
from mlx_streaming.decode.greedy import greedy_generate, greedy_steps
from mlx_streaming.model import build_streaming_model

pytestmark = pytest.mark.exact


def test_full_pool_logits_are_bit_identical(streaming_model, oracle, prompt_ids, exact_tokens):
    n = min(33, exact_tokens)  # the prompt's last position, then 32 decode steps
    reference = list(zip(oracle.ids(0, n), oracle.logits(0, n)))
    assert streaming_model.store.capacity == streaming_model.store.index.num_experts
    steps = 0
    for (ref_id, ref_logits), (id_, logits) in zip(reference, greedy_steps(streaming_model.model, prompt_ids[0], n)):
        assert id_ == ref_id
        assert mx.array_equal(logits, ref_logits).item(), f"logits differ at step {steps}"
        steps += 1
    assert steps == n


@pytest.mark.parametrize("io_mode", ["buffered", "direct"])
def test_minimum_pool_greedy_ids_match(model_dir, streaming_model, pool_config, oracle, prompt_ids, exact_tokens,
                                       io_mode):
    """The fewest slots a token can run in, greedy ids equal to the oracle's; with byte-truth verification where
    the suite turns it on (a model mlx-lm cannot hold), every placed expert checked."""
    top_k = streaming_model.store.top_k
    n = min(64, exact_tokens)
    with build_streaming_model(model_dir, pool_config(top_k, io_mode=io_mode)) as sm:
        for prompt, ids in enumerate(prompt_ids[:3]):
            assert greedy_generate(sm.model, ids, n) == oracle.ids(prompt, n)
        stats = sm.store.stats()
        assert stats["evictions"] > 0 and stats["misses"] > 0
        assert set(sm.store.reader.effective_modes.values()) == {io_mode}
        if sm.config.verify:
            assert stats["verify_calls"] == stats["misses"]


#: Prompt tokens of the one-chunk prefills below (the first of ``LONG_PROMPT_TEXT``'s): already past the union of
#: experts that a pool of top_k + 2 slots holds in every MoE layer (each layer routes them to 14 to 30 distinct
#: experts).
LONG_PROMPT_TOKENS = 64
LONG_PROMPT_TEXT = "def f(x):\n    return x * 2 + 1\n" * 40


def test_long_prompt_with_pool_below_one_layers_union_runs_in_groups(model_dir, reference_model, streaming_model):
    ids = streaming_model.tokenizer.encode(LONG_PROMPT_TEXT)[:LONG_PROMPT_TOKENS]
    assert len(ids) == LONG_PROMPT_TOKENS
    top_k = reference_model.args.num_experts_per_tok
    with build_streaming_model(model_dir, StreamingConfig(pool_slots=top_k + 2)) as sm:
        sm.store.route_log = []
        got = greedy_generate(sm.model, ids, 16, prefill_chunk=LONG_PROMPT_TOKENS)
        prefill = [(layer, len(experts)) for layer, tokens, experts in sm.store.route_log if tokens == LONG_PROMPT_TOKENS]
        # the one prefill forward routed every MoE layer to more experts than the pool holds
        assert {layer for layer, _ in prefill} == set(sm.store.index.layers)
        assert all(experts > sm.store.capacity for _, experts in prefill), prefill
        assert sm.store.stats()["grouped"] >= len(prefill)
    assert got == greedy_generate(reference_model, ids, 16, prefill_chunk=LONG_PROMPT_TOKENS)


def test_a_call_in_groups_computes_each_route_once(model_dir, reference_model, streaming_model, monkeypatch):
    """The one-chunk prefill of a pool below every layer's union of experts: each group computes only the routes
    to its own experts, so every MoE layer computes its tokens x top_k routes once, as the in-memory model does
    (not once per group)."""
    from mlx_lm.models.switch_layers import SwitchGLU

    ids = streaming_model.tokenizer.encode(LONG_PROMPT_TEXT)[:LONG_PROMPT_TOKENS]
    top_k = reference_model.args.num_experts_per_tok
    rows = []
    call = SwitchGLU.__call__
    monkeypatch.setattr(SwitchGLU, "__call__", lambda self, x, indices: rows.append(indices.size) or call(self, x, indices))
    with build_streaming_model(model_dir, StreamingConfig(pool_slots=top_k + 2)) as sm:
        mx.eval(sm.model(mx.array([ids])))
        layers = len(sm.store.index.layers)
        assert sm.store.stats()["grouped"] == layers  # every layer ran in groups
    assert len(rows) > layers and sum(rows) == layers * LONG_PROMPT_TOKENS * top_k
