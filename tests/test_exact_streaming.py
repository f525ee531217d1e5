"""The streaming model against mlx-lm's in-memory model on the same checkpoint (the oracle)."""

import mlx.core as mx
import pytest

from mlx_streaming.config import StreamingConfig
from mlx_streaming.generate import greedy_generate, greedy_steps
from mlx_streaming.model import build_streaming_model

pytestmark = pytest.mark.exact


def test_full_pool_logits_are_bit_identical(streaming_model, reference_model, prompt_ids):
    assert streaming_model.store.capacity == streaming_model.store.index.num_experts
    pairs = zip(greedy_steps(reference_model, prompt_ids[0], 33), greedy_steps(streaming_model.model, prompt_ids[0], 33))
    steps = 0
    for (ref_id, ref_logits), (id_, logits) in pairs:
        assert id_ == ref_id
        assert mx.array_equal(logits, ref_logits).item(), f"logits differ at step {steps}"
        steps += 1
    assert steps == 33  # the prompt's last position, then 32 decode steps


@pytest.mark.parametrize("io_mode", ["buffered", "direct"])
def test_minimum_pool_greedy_ids_match(model_dir, reference_model, prompt_ids, io_mode):
    top_k = reference_model.args.num_experts_per_tok
    with build_streaming_model(model_dir, StreamingConfig(pool_slots=top_k, io_mode=io_mode)) as sm:
        for ids in prompt_ids[:3]:
            assert greedy_generate(sm.model, ids, 64) == greedy_generate(reference_model, ids, 64)
        assert sm.store.evictions > 0 and sm.store.misses > 0
        assert set(sm.store.reader.effective_modes.values()) == {io_mode}


def test_long_prompt_with_pool_below_one_layers_union_runs_in_groups(model_dir, reference_model, streaming_model):
    tokenizer = streaming_model.tokenizer
    text = "def f(x):\n    return x * 2 + 1\n" * 40
    ids = tokenizer.encode(text)[:512]
    assert len(ids) == 512
    top_k = reference_model.args.num_experts_per_tok
    with build_streaming_model(model_dir, StreamingConfig(pool_slots=top_k + 2)) as sm:
        got = greedy_generate(sm.model, ids, 16, prefill_chunk=512)
        assert sm.store.grouped > 0  # the prefill routed to more experts than the pool holds
    assert got == greedy_generate(reference_model, ids, 16, prefill_chunk=512)
