"""The deferred miss check: one host sync per forward when the routed experts are resident, the same ids and
the same counters as checking at every MoE layer, and a correct rerun when an expert was missing."""

import collections
import io
import json
import re

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from mlx_streaming.config import StreamingConfig
from mlx_streaming.decode.ahead import guard_of
from mlx_streaming.decode.greedy import greedy_generate, greedy_steps
from mlx_streaming.model import build_streaming_model
from mlx_streaming.mtp.drafter import MTPDrafter
from mlx_streaming.mtp.speculative import mtp_generate
from mlx_streaming.residency.guard import TRIAL_FAILURES, TRIAL_WINDOW

TOKENS = 24
COUNTED = ("hits", "misses", "evictions", "demand_loads", "fastpath", "fallback", "grouped")


def _run(model_dir, prompt, miss_check, warm=0, **config):
    with build_streaming_model(model_dir, StreamingConfig(miss_check=miss_check, **config)) as sm:
        if warm:
            greedy_generate(sm.model, prompt, warm)
            sm.store.reset_stats()
        ids = greedy_generate(sm.model, prompt, TOKENS)
        return ids, sm.store.stats()


@pytest.mark.parametrize("pool", [None, 16, 4], ids=["full", "16 slots", "minimum"])
def test_same_ids_and_counters_as_the_per_layer_check(model_dir, reference_model, prompt_ids, pool):
    prompt = prompt_ids[1]
    layer_ids, layer_stats = _run(model_dir, prompt, "layer", pool_slots=pool)
    token_ids, token_stats = _run(model_dir, prompt, "forward", pool_slots=pool)
    assert token_ids == layer_ids == greedy_generate(reference_model, prompt, TOKENS)
    assert {k: token_stats[k] for k in COUNTED} == {k: layer_stats[k] for k in COUNTED}
    assert token_stats["deferred_forwards"] > 0 and layer_stats["deferred_forwards"] == 0
    assert token_stats["deferred_retries"] > 0  # it tried, found a miss, reran layer by layer
    # each failed check threw away the forward's every MoE layer call (all the model's layers are MoE layers)
    moe_layers = json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]
    assert token_stats["rerun_layer_calls"] == moe_layers * token_stats["deferred_retries"]
    assert layer_stats["rerun_layer_calls"] == 0
    # greedy_steps runs one step ahead: the step queued behind a miss is dropped, unchecked (at 16 slots a
    # deferred forward misses while the next is queued)
    assert token_stats["dropped_forwards"] <= token_stats["deferred_retries"]
    if pool != 4:  # (at the minimum pool the forwards after the prefill's miss keep missing: none defers)
        assert token_stats["dropped_forwards"] > 0


def test_a_miss_costs_syncs_only_where_it_is(model_dir, reference_model, prompt_ids):
    """A warm pool that misses now and then: a forward whose check finds one layer's experts missing loads that
    layer and runs again deferred (two waits, not one per MoE layer), with the per-layer path's ids and counters;
    on a cold pool of 12 slots (of 128), which runs layer by layer, a layer call that loads waits once (its routes), not twice."""
    prompt = prompt_ids[0]
    for pool, warm in ((96, 16), (12, 0)):
        layer_ids, layer_stats = _run(model_dir, prompt, "layer", warm=warm, pool_slots=pool)
        token_ids, token_stats = _run(model_dir, prompt, "forward", warm=warm, pool_slots=pool)
        assert token_ids == layer_ids == greedy_generate(reference_model, prompt, TOKENS)
        assert {k: token_stats[k] for k in COUNTED} == {k: layer_stats[k] for k in COUNTED}
        # layer by layer: a wait per MoE layer call for its routes (and per group of a call split in groups: the
        # prefill's), none for a load's pool writes (which cost one more per loading call)
        calls = layer_stats["fastpath"] + layer_stats["fallback"]
        assert 0 <= layer_stats["host_syncs"] - calls < layer_stats["fallback"]
        if warm:
            assert token_stats["resumed_forwards"] > 0 and token_stats["misses"] > 0
            assert token_stats["host_syncs"] < layer_stats["host_syncs"] / 2


def test_a_pool_whose_deferred_checks_often_fail_checks_layer_by_layer(model_dir, reference_model, streaming_model):
    """At 16 slots (of 128) this prompt's forwards after an all-resident one often miss: with deferral tried on
    every such forward (the rule off), its checks fail again and again; with the rule, forwards go back to the
    per-layer path once more than TRIAL_FAILURES of the recent trials failed. Same ids, same residency counters."""
    prompt = streaming_model.tokenizer.encode("import os\nimport sys\n")
    tokens = 64
    runs = {}
    for rule in (True, False):
        with build_streaming_model(model_dir, StreamingConfig(miss_check="forward", pool_slots=16)) as sm:
            if not rule:
                sm.store.guard.deferring_pays = lambda: True
            runs[rule] = greedy_generate(sm.model, prompt, tokens), sm.store.stats()
    (ids, stats), (ids_off, stats_off) = runs[True], runs[False]
    assert ids == ids_off == greedy_generate(reference_model, prompt, tokens)
    assert {k: stats[k] for k in COUNTED} == {k: stats_off[k] for k in COUNTED}
    assert stats_off["deferred_retries"] > 2 * TRIAL_FAILURES
    assert stats["deferred_retries"] < stats_off["deferred_retries"]
    assert stats["deferred_forwards"] < stats_off["deferred_forwards"]


def test_a_pool_that_holds_its_working_set_defers_again_after_failed_trials(model_dir, prompt_ids):
    """A warm pool (nothing misses) whose last trials failed, as at a pool that has just grown to hold its working
    set: forwards check layer by layer, each a passing trial, until no more than TRIAL_FAILURES of the last
    TRIAL_WINDOW failed; from then on every forward defers."""
    prompt = prompt_ids[0]
    with build_streaming_model(model_dir, StreamingConfig(miss_check="forward")) as sm:
        greedy_generate(sm.model, prompt, 64)
        sm.store.reset_stats()
        sm.store.guard._trials.extend([False] * (TRIAL_FAILURES + 1))  # planted: the last trials failed
        greedy_generate(sm.model, prompt, TOKENS)
        stats = sm.store.stats()
    by_layer = TRIAL_WINDOW - TRIAL_FAILURES  # passing trials that push all but TRIAL_FAILURES failures out
    assert stats["misses"] == 0 and stats["deferred_retries"] == 0
    assert stats["deferred_forwards"] == TOKENS - by_layer  # the prompt's prefill and TOKENS - 1 decode steps
    assert stats["host_syncs"] == by_layer * 8 + stats["deferred_forwards"]  # 8 MoE layers


def test_a_warm_full_pool_syncs_once_per_forward(model_dir, prompt_ids):
    prompt = prompt_ids[0]
    _, layer_stats = _run(model_dir, prompt, "layer", warm=64)
    _, token_stats = _run(model_dir, prompt, "forward", warm=64)
    forwards = TOKENS  # the prompt's prefill (one chunk) and TOKENS - 1 decode steps
    assert token_stats["misses"] == 0 and token_stats["deferred_retries"] == token_stats["dropped_forwards"] == 0
    assert token_stats["host_syncs"] == token_stats["deferred_forwards"] == forwards
    assert layer_stats["host_syncs"] == forwards * 8  # one per MoE layer call: 8 MoE layers


def test_a_loop_stopped_early_drops_the_step_it_queued(model_dir, reference_model, prompt_ids):
    prompt = prompt_ids[0]
    with build_streaming_model(model_dir, StreamingConfig(miss_check="forward")) as sm:
        greedy_generate(sm.model, prompt, 8)  # warm: the steps below find their experts resident
        sm.store.reset_stats()
        steps = greedy_steps(sm.model, prompt, 8)
        first = [next(steps)[0] for _ in range(3)]
        steps.close()
        assert sm.store.stats()["dropped_forwards"] == 1
        assert greedy_generate(sm.model, prompt, 6) == greedy_generate(reference_model, prompt, 6)[:6]
    assert first == greedy_generate(reference_model, prompt, 3)


@pytest.mark.parametrize("commit_mode", ["direct", "replay"])
def test_speculation_with_the_deferred_check_equals_greedy(model_dir, reference_model, prompt_ids, commit_mode):
    prompt = prompt_ids[1]
    with build_streaming_model(model_dir, StreamingConfig(mtp=True, pool_slots=12, miss_check="forward")) as sm:
        ids, stats = mtp_generate(sm.model, MTPDrafter(sm.mtp, sm.model), prompt, TOKENS, 3, commit_mode)
        assert sm.store.stats()["deferred_forwards"] > 0
    assert ids == greedy_generate(reference_model, prompt, TOKENS) and stats["steps"] > 0


def test_a_preloaded_pool_is_counted_in_bulk_as_the_per_layer_path_counts(model_dir, reference_model, prompt_ids):
    """Every expert resident from the build: no forward can miss, so none waits for a check; the hits of the
    forwards are counted together, in one wait for the device per ``COUNT_EVERY`` forwards or at ``stats``."""
    prompt = prompt_ids[0]
    layer_ids, layer_stats = _run(model_dir, prompt, "layer", preload=True)
    token_ids, token_stats = _run(model_dir, prompt, "forward", preload=True)
    assert token_ids == layer_ids == greedy_generate(reference_model, prompt, TOKENS)
    assert {k: token_stats[k] for k in COUNTED} == {k: layer_stats[k] for k in COUNTED}
    assert token_stats["misses"] == token_stats["bytes_read"] == 0 and token_stats["hits"] > 0
    assert token_stats["deferred_forwards"] == TOKENS and token_stats["host_syncs"] == 1


def _two_token_forwards(model, prompt, n):
    """``n`` forwards of two tokens each after a prefill of ``prompt``, on one cache."""
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array(prompt)[None], cache=cache))
    for i in range(n):
        mx.eval(model(mx.array(prompt[i % 8:i % 8 + 2])[None], cache=cache))


def test_bulk_counts_wait_once_per_count_every_forwards_and_a_reset_drops_them(model_dir, prompt_ids):
    """A preloaded pool counts a one-token forward at once (its router's k experts, distinct) and a longer one in
    bulk: one wait per ``COUNT_EVERY`` such forwards, and one at ``stats``; the hits are the per-layer path's."""
    from mlx_streaming.residency.bulk import COUNT_EVERY

    prompt = prompt_ids[0]
    runs = {}
    for miss_check in ("forward", "layer"):
        with build_streaming_model(model_dir, StreamingConfig(preload=True, miss_check=miss_check)) as sm:
            greedy_generate(sm.model, prompt, 8)
            sm.store.reset_stats()  # the 8 forwards above are not counted
            greedy_generate(sm.model, prompt, COUNT_EVERY + 2)  # a prefill, then COUNT_EVERY + 1 one-token forwards
            decoded = sm.store.stats()
            sm.store.reset_stats()
            _two_token_forwards(sm.model, prompt, COUNT_EVERY)  # with the prefill, COUNT_EVERY + 1 longer forwards
            runs[miss_check] = decoded, sm.store.stats()
    (decoded, longer), (layer_decoded, layer_longer) = runs["forward"], runs["layer"]
    assert decoded["host_syncs"] == 1 and decoded["fastpath"] == (COUNT_EVERY + 2) * 8  # the prefill's, at stats
    assert longer["host_syncs"] == 2 and longer["fastpath"] == (COUNT_EVERY + 1) * 8
    assert decoded["hits"] == layer_decoded["hits"] > 0 and longer["hits"] == layer_longer["hits"] > 0


def test_preload_needs_a_pool_that_holds_every_expert(model_dir):
    from mlx_streaming.errors import PoolTooSmallError

    with pytest.raises(PoolTooSmallError, match="preload needs a pool that holds every expert: pool_slots=12 of"):
        build_streaming_model(model_dir, StreamingConfig(preload=True, pool_slots=12))


def test_speculation_on_a_preloaded_pool_equals_greedy(model_dir, reference_model, prompt_ids):
    prompt = prompt_ids[1]
    with build_streaming_model(model_dir, StreamingConfig(mtp=True, preload=True)) as sm:
        ids, stats = mtp_generate(sm.model, MTPDrafter(sm.mtp, sm.model), prompt, TOKENS, 3, "direct")
        counted = sm.store.stats()
    assert ids == greedy_generate(reference_model, prompt, TOKENS) and stats["steps"] > 0
    assert counted["misses"] == counted["deferred_retries"] == 0 and counted["hits"] > 0
    assert counted["host_syncs"] == 1  # the bulk hit count at stats(): no forward waited for a check


def _graph_ops(*arrays) -> collections.Counter:
    """The operations of the graph that computes ``arrays``, by primitive (MLX's DOT export of it)."""
    dot = io.StringIO()
    mx.export_to_dot(dot, *arrays)
    return collections.Counter(re.findall(r'label\s*=\s*"(\w+)', dot.getvalue()))


def _decode_step_ops(model, prompt) -> collections.Counter:
    """The operations of one decode step after ``prompt``, as a one-step-ahead loop queues it (with its check,
    where the model streams)."""
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([prompt]), cache=cache))
    guard = guard_of(model)
    if guard is None:
        return _graph_ops(model(mx.array([[prompt[-1]]]), cache=cache))
    with guard.queueing() as checks:
        out = model(mx.array([[prompt[-1]]]), cache=cache)
    assert len(checks) == 1, "the step was not deferred"
    try:
        return _graph_ops(out, checks[0].flat)
    finally:
        guard.drop_queued()


def test_a_hit_adds_one_slot_gather_per_moe_layer_and_nothing_else(model_dir, reference_model, streaming_model,
                                                                   prompt_ids):
    """What the host builds and submits for a step whose experts are resident at a bounded pool: the in-memory
    step's operations, one gather of slots per MoE layer, and the routes' concatenation for the check. A GPU's
    host launches every operation one by one (there a decode of the default model is bound by the host), so an
    operation more is a cost more; slots in a dtype other than the router's cost a cast per expert matmul."""
    prompt = prompt_ids[1]
    experts = streaming_model.store.index.num_experts
    with build_streaming_model(model_dir, StreamingConfig(pool_slots=experts - 1)) as sm:
        greedy_generate(sm.model, prompt, 4)  # the step's experts resident, and the forward before it a hit
        streaming = _decode_step_ops(sm.model, prompt)
        moe_layers = len(sm.store.index.layers)
    inmemory = _decode_step_ops(reference_model, prompt)
    assert streaming - inmemory == collections.Counter({"GatherAxis": moe_layers, "Concatenate": 1})
    assert set(inmemory - streaming) <= {"AsType"}  # at most fewer casts, where a router's ids come in another dtype
