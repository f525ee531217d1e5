"""Accept paths with an oracle drafter: it proposes the known greedy continuation with planted errors, so
every accept length from 0 to K-1 occurs, in both commit modes, and the statistics are known exactly. The
greedy continuation is the in-memory oracle's (computed once per prompt for the whole session)."""

import itertools

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from mlx_streaming.mtp.autok import CLIMB_AFTER
from mlx_streaming.mtp.drafter import MTPDrafter
from mlx_streaming.mtp import speculative
from mlx_streaming.mtp.speculative import _catch_up, mtp_generate
from mlx_streaming.runtime.qwen3_next import forward_with_hidden

pytestmark = pytest.mark.exact
MAX_TOKENS = 40


class OracleDrafter:
    """Drafts ``greedy[pos:pos+n]``, with the draft at index ``plan[step]`` made wrong (none if >= n)."""

    def __init__(self, greedy, plan, prompt_len, vocab):
        self.greedy, self.plan, self.vocab = greedy, iter(plan), vocab
        self.generated = -(prompt_len - 1)  # the first extend carries prompt[1:] + the first token

    def extend(self, next_tokens, hiddens):
        assert hiddens.shape[1] == len(next_tokens)
        self.generated += len(next_tokens)

    def settle(self):
        """Nothing queued to compute: the oracle keeps no cache."""

    def propose(self, n):
        drafts = list(self.greedy[self.generated:self.generated + n])
        wrong_at = next(self.plan)
        if wrong_at < n:
            drafts[wrong_at] = (drafts[wrong_at] + 1) % self.vocab
        return mx.array(drafts, mx.uint32)


def expected(plan, K, max_tokens):
    """Statistics the plan implies: steps until ``max_tokens`` ids exist, and what each commit mode does."""
    tokens, used = 1, []
    for a in plan:
        if tokens >= max_tokens:
            break
        used.append(a)
        tokens += a + 1
    partial = [a for a in used if a < K - 1]
    return {"steps": len(used), "accepted_drafts": sum(used), "accept_hist": used,
            "full_accepts": len(used) - len(partial), "partial": len(partial), "replayed": sum(a + 1 for a in partial)}


@pytest.mark.parametrize("commit_mode", ["direct", "replay"])
@pytest.mark.parametrize("K", [2, 3, 4])
def test_every_accept_length_commits_exactly(mtp_model, oracle, prompt_ids, exact_tokens, K, commit_mode):
    sm = mtp_model
    ids = prompt_ids[1]
    n = min(MAX_TOKENS, exact_tokens - K)  # the drafter reads up to K ids past the last
    greedy = oracle.ids(1, n + K)
    plan = list(itertools.islice(itertools.cycle(range(K)), 64))  # accept 0, 1, .., K-1, 0, 1, ..
    drafter = OracleDrafter(greedy, plan, len(ids), sm.model.args.vocab_size)
    out, stats = mtp_generate(sm.model, drafter, ids, n, K, commit_mode)
    want = expected(plan, K, n)
    assert out == greedy[:n]
    assert set(want["accept_hist"]) == set(range(K))
    assert stats["steps"] == want["steps"]
    assert stats["accept_hist"] == want["accept_hist"]
    assert stats["accepted_drafts"] == want["accepted_drafts"]
    assert stats["full_accepts"] == want["full_accepts"]
    if commit_mode == "direct":
        assert (stats["direct_commits"], stats["fallback_replays"], stats["replayed_tokens"]) == (want["partial"], 0, 0)
    else:
        assert (stats["direct_commits"], stats["fallback_replays"], stats["replayed_tokens"]) == (0, want["partial"], want["replayed"])


def test_a_catch_up_feeds_the_head_in_power_of_two_chunks_leaving_the_same_cache(mtp_model):
    """Positions the head did not draft for are fed in chunks of 8, 2 and 1 (11 of them): a backend that compiles
    kernels per shape meets a few shapes, not one per count. The head ends where one feed of all 11 leaves it,
    bit for bit on this CPU (a forward over K positions equals K single steps here)."""
    sm = mtp_model
    tokens = list(range(100, 112))
    cache = make_prompt_cache(sm.model)
    _, hidden = forward_with_hidden(sm.model, mx.array([tokens]), cache)
    pairs = [(tokens[i + 1], hidden[:, i:i + 1]) for i in range(11)]
    once, chunked = MTPDrafter(sm.mtp, sm.model), MTPDrafter(sm.mtp, sm.model)
    once.extend([t for t, _ in pairs], mx.concatenate([h for _, h in pairs], axis=1))
    sizes = []
    real_extend = chunked.extend
    chunked.extend = lambda next_tokens, hiddens: sizes.append(len(next_tokens)) or real_extend(next_tokens, hiddens)
    _catch_up(chunked, pairs)
    assert sizes == [8, 2, 1]
    assert once.cache.offset == chunked.cache.offset == 11
    assert all(mx.array_equal(a, b).item() for a, b in zip(once.cache.state, chunked.cache.state))
    assert mx.array_equal(once._last, chunked._last).item()
    assert once.propose(3).tolist() == chunked.propose(3).tolist()


def test_the_catch_up_of_a_switch_to_drafting_is_done_before_the_k_chooser_times_the_step(
        mtp_model, oracle, prompt_ids, exact_tokens, monkeypatch):
    """auto starts at K=1 and probes K=2 after a few steps: the head first catches up on the positions it missed,
    and that work (``settle``: the drafter computes what the feeds queued) is done and counted as the run's
    ``catch_up`` time, outside the step the K chooser weighs. A fake clock ticks 1 ms per reading and 100 s per
    settle, so where the head's work lands is exact."""
    class Clock:
        now = 0.0

        @staticmethod
        def perf_counter():
            Clock.now += 0.001
            return Clock.now

    class Settling(OracleDrafter):
        settled = 0

        def settle(self):
            self.settled += 1
            Clock.now += 100.0

    monkeypatch.setattr(speculative, "time", Clock)
    sm, ids = mtp_model, prompt_ids[1]
    n = min(MAX_TOKENS, exact_tokens - 4)  # auto's largest K is 4
    greedy = oracle.ids(1, n + 4)
    drafter = Settling(greedy, itertools.repeat(99), len(ids), sm.model.args.vocab_size)  # no wrong draft
    out, stats = mtp_generate(sm.model, drafter, ids, n, "auto")
    assert out == greedy[:n]
    assert stats["k_hist"][:CLIMB_AFTER + 1] == [1] * CLIMB_AFTER + [2]  # steps without drafts, then K=2's probe
    assert drafter.settled >= 1
    assert 100 * drafter.settled <= stats["time_s"]["catch_up"] < 100 * drafter.settled + 1
    assert all(row["ms_per_step"] < 1000 for row in stats["k_choice"] if row["ms_per_step"] is not None)


def test_steps_without_drafts_run_one_ahead_for_as_long_as_k_1_holds(mtp_model, oracle, prompt_ids, monkeypatch):
    """Fixed K=1 decodes as greedy decoding does, one step ahead through ``run_ahead``, in one stretch; auto runs
    its first step alone (the prefill's transition, not weighed), its next CLIMB_AFTER - 1 as one stretch, then
    probes K=2. Ids equal greedy's either way."""
    stretches = []
    real = speculative.run_ahead

    def counted(model, step, first, n):
        stretches.append(n)
        return real(model, step, first, n)

    monkeypatch.setattr(speculative, "run_ahead", counted)
    sm, ids = mtp_model, prompt_ids[1]
    out, stats = mtp_generate(sm.model, MTPDrafter(sm.mtp, sm.model), ids, 12, 1)
    assert out == oracle.ids(1, 12) and stretches == [11] and stats["steps"] == 11
    stretches.clear()
    out, stats = mtp_generate(sm.model, MTPDrafter(sm.mtp, sm.model), ids, 12, "auto")
    assert out == oracle.ids(1, 12) and stretches[:2] == [1, CLIMB_AFTER - 1]
    assert stats["k_hist"][CLIMB_AFTER] == 2


def test_auto_feeds_the_head_only_the_prompts_last_positions(mtp_model, oracle, prompt_ids, monkeypatch):
    """With K "auto" the head's first feed is the prompt's last PROMPT_FED_AUTO positions, so auto's first probe
    catches up a bounded number of positions whatever the prompt's length; with a fixed K the whole prompt. The ids
    are greedy's either way."""
    monkeypatch.setattr(speculative, "PROMPT_FED_AUTO", 3)
    sm, ids = mtp_model, prompt_ids[1]
    assert len(ids) > 3
    greedy = oracle.ids(1, 12)
    for k, fed in (("auto", 3), (3, len(ids))):
        drafter = MTPDrafter(sm.mtp, sm.model)
        feeds, real_extend = [], drafter.extend
        drafter.extend = lambda tokens, hiddens: feeds.append((len(tokens), hiddens.shape[1])) or real_extend(tokens, hiddens)
        out, _ = mtp_generate(sm.model, drafter, ids, 12, k)
        assert out == greedy and feeds[0] == (fed, fed), (k, feeds[:2])
