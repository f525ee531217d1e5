"""One decode protocol for every loop: the engine's ``generate_step`` (mlx-lm's signature, one step ahead through
the miss check) yields what mlx-lm's own loop yields, token for token and log-probability for log-probability,
seeded sampling, logits processors and a prompt cache carried from call to call included, and leaves the same
caches; the engine's loops wait for the device at most once per token where the routed experts are resident."""

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.generate import generate_step as mlx_generate_step
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_logits_processors, make_sampler

from mlx_streaming.config import StreamingConfig
from mlx_streaming.decode.ahead import run_ahead
from mlx_streaming.decode.greedy import greedy_generate
from mlx_streaming.decode.step import generate_step
from mlx_streaming.integrations import loop
from mlx_streaming.model import build_streaming_model
from mlx_streaming.mtp.drafter import MTPDrafter
from mlx_streaming.mtp.speculative import mtp_generate

TOKENS = 24
COUNTED = ("hits", "misses", "evictions", "demand_loads")


def _two_turns(loop_fn, model, prompts):
    """Two calls sharing one prompt cache, sampled from seed 7 with a repetition penalty: each step's token and
    log-probabilities, per turn."""
    mx.random.seed(7)
    cache, turns = make_prompt_cache(model), []
    for prompt in prompts:
        steps = loop_fn(mx.array(prompt), model, max_tokens=TOKENS, prompt_cache=cache,
                        sampler=make_sampler(temp=0.8, top_p=0.95),
                        logits_processors=make_logits_processors(repetition_penalty=1.1))
        turns.append([(token, logprobs) for token, logprobs in steps])
    return turns


def _same(ours, theirs) -> None:
    for turn_ours, turn_theirs in zip(ours, theirs, strict=True):
        assert [t for t, _ in turn_ours] == [t for t, _ in turn_theirs]
        for (_, a), (_, b) in zip(turn_ours, turn_theirs):
            assert mx.array_equal(a, b).item()


@pytest.mark.parametrize("pool", [None, 12, 4], ids=["full", "25%", "minimum"])
def test_generate_step_yields_what_mlx_lm_s_loop_yields(model_dir, reference_model, prompt_ids, pool):
    """The same streaming model under both loops (so the log-probabilities compare bit for bit at any pool),
    and the tokens against mlx-lm's loop on its in-memory model. At the small pools steps miss and run again:
    the rerun step draws the random key it drew before."""
    prompts = [prompt_ids[1], prompt_ids[2]]
    runs = {}
    for name, loop_fn in (("ours", generate_step), ("mlx-lm", mlx_generate_step)):
        with build_streaming_model(model_dir, StreamingConfig(pool_slots=pool)) as sm:
            runs[name] = _two_turns(loop_fn, sm.model, prompts), sm.store.stats()
    (ours, ours_stats), (theirs, theirs_stats) = runs["ours"], runs["mlx-lm"]
    _same(ours, theirs)
    inmemory = _two_turns(mlx_generate_step, reference_model, prompts)
    assert [[t for t, _ in turn] for turn in ours] == [[t for t, _ in turn] for turn in inmemory]
    assert {k: ours_stats[k] for k in COUNTED} == {k: theirs_stats[k] for k in COUNTED}
    if pool is not None:
        assert ours_stats["misses"] > 0 and ours_stats["deferred_retries"] > 0


def test_stream_generate_runs_the_engine_loop_from_the_draft_slot(model_dir, reference_model, monkeypatch):
    """``stream_generate`` with an ``EngineLoop`` in its draft-model slot (what chat and serve do): mlx-lm's
    responses, from the engine's loop, whose forwards each wait once on a warm pool."""
    from mlx_streaming.decode import step

    monkeypatch.setattr(loop.mlx_generate, "speculative_generate_step", loop.engine_step)
    loops = []
    monkeypatch.setattr(step, "run_ahead", lambda *args, **kwargs: loops.append(args) or run_ahead(*args, **kwargs))

    def sampled(model, tokenizer, **extra):
        mx.random.seed(3)
        return [(r.token, r.text) for r in mlx_lm.stream_generate(
            model, tokenizer, "def fibonacci(n):", max_tokens=TOKENS, sampler=make_sampler(temp=0.8, top_p=0.95),
            **extra)]

    with build_streaming_model(model_dir, StreamingConfig(pool_slots=96, mtp=True)) as sm:  # holds this answer's
        engine = loop.EngineLoop(sm, 3, "direct", speculate=True)
        for _ in range(2):  # warm: the same answer finds its experts resident (and the guard, no miss just before)
            sampled(sm.model, sm.tokenizer, draft_model=engine)
        sm.store.reset_stats()
        ours = sampled(sm.model, sm.tokenizer, draft_model=engine)
        stats = sm.store.stats()
    assert ours == sampled(reference_model, sm.tokenizer) and len(loops) == 3
    assert stats["misses"] == 0 and stats["host_syncs"] == stats["deferred_forwards"] > 0


def test_a_loop_closed_early_leaves_the_caches_mlx_lm_s_loop_leaves(model_dir, prompt_ids):
    """A consumer that stops (a stop word) closes the loop one step ahead: the step it queued is confirmed (and
    run again on a miss), so a prompt cache carried on holds what mlx-lm's loop leaves in it."""
    prompt, follow = mx.array(prompt_ids[1]), mx.array(prompt_ids[3])
    answers = {}
    for name, loop_fn in (("ours", generate_step), ("mlx-lm", mlx_generate_step)):
        with build_streaming_model(model_dir, StreamingConfig(pool_slots=4)) as sm:
            cache = make_prompt_cache(sm.model)
            steps = loop_fn(prompt, sm.model, max_tokens=TOKENS, prompt_cache=cache)
            first = [next(steps)[0] for _ in range(5)]
            steps.close()
            answers[name] = first, [t for t, _ in loop_fn(follow, sm.model, max_tokens=8, prompt_cache=cache)]
    assert answers["ours"] == answers["mlx-lm"]


@pytest.mark.parametrize("pool", ["full", "warm 50%"])
def test_every_loop_waits_once_per_forward_where_the_experts_are_resident(model_dir, prompt_ids, pool):
    """Greedy, the engine's ``generate_step`` and MTP speculation, on a preloaded full pool and on a warm pool of
    half the experts, counted by one counter (``host_syncs``): on the full pool no forward waits (one bulk count
    at ``stats``); on the warm pool each forward of the model waits once, never per layer, none is run again.
    (The MTP head's own forward, one MoE layer, waits once per draft besides.)"""
    prompt = prompt_ids[0]
    config = StreamingConfig(mtp=True, **({"preload": True} if pool == "full" else {"pool_slots": 64}))
    with build_streaming_model(model_dir, config) as sm:
        speculate = lambda: mtp_generate(sm.model, MTPDrafter(sm.mtp, sm.model), prompt, TOKENS, 3)  # noqa: E731
        greedy_generate(sm.model, prompt, 2 * TOKENS)  # warm: what the runs below route is resident
        speculate()
        runs = {
            "greedy": lambda: (greedy_generate(sm.model, prompt, TOKENS), TOKENS),  # prefill + TOKENS - 1 steps
            "generate_step": lambda: ([t for t, _ in generate_step(mx.array(prompt), sm.model, max_tokens=TOKENS)],
                                      TOKENS + 2),  # mlx-lm's: the prompt's last token apart, one step past the end
            "speculative": lambda: (lambda ids, stats: (ids, stats["steps"] + 1))(*speculate()),  # prefill + verifies
        }
        ids = {}
        for name, run in runs.items():
            sm.store.reset_stats()
            ids[name], forwards = run()
            stats = sm.store.stats()
            assert stats["misses"] == stats["deferred_retries"] == 0, name
            assert stats["deferred_forwards"] == forwards, name
            if pool == "full":
                assert stats["host_syncs"] == 1, name
            elif name != "speculative":
                assert stats["host_syncs"] == forwards, name
            else:  # K 3: the head runs once after the prefill, then per step once to draft and once to extend
                assert stats["host_syncs"] == forwards + 1 + 2 * (forwards - 1), name
    assert ids["greedy"] == ids["generate_step"] == ids["speculative"]
