"""Self-speculative decoding: draft with the MTP head, verify ``[x, d1 .. d(K-1)]`` in one forward, commit.

Greedy acceptance: drafts are accepted while they equal the main model's argmax at the position before
them; the accepted drafts plus the main model's next token (the bonus) are committed, so the ids equal
plain greedy decoding. Steps without drafts (K=1) run one step ahead, greedy decoding's own loop, for as long
as K=1 is the choice. Full-attention KV caches are trimmed. Gated-DeltaNet state cannot be trimmed, so:

- ``direct``: during the verify each Gated-DeltaNet layer keeps its conv window and recurrent state after
  every position (its recurrence is sequential anyway; the adapter's ``StateCapture``, installed at build,
  steps it position by position) and
  the commit installs the state at the last accepted position; nothing is replayed.
- ``replay``: the Gated-DeltaNet state is snapshotted before the verify; after a partial accept it is
  restored and the accepted tokens are run again.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from ..runtime.qwen3_next import attention_caches, forward_with_hidden, recurrent_caches, state_captures
from ..run_settings import COMMIT_MODES
from ..decode.ahead import confirm_step, guard_of, queue_step, run_ahead
from ..decode.greedy import prefill_chunked
from .autok import KChooser

#: Steps without drafts keep at most this many of their (token, hidden) pairs for the head: when it drafts
#: again it is fed those, so a long stretch without speculation costs the head a bounded catch-up (the positions
#: before them stay out of its cache: its drafts may be a little worse, the ids are greedy's whatever it drafts).
UNFED_KEPT = 16
#: With K "auto", the head is fed at most this many of the prompt's last positions (with a fixed K, all of them):
#: auto's first probe then costs a bounded catch-up whatever the prompt's length, where speculation may not pay
#: (on this CPU the head's feed of a 600-token prompt took 0.72 s, as long as 18 decode steps, and auto decoded 32
#: tokens at 7-16 tok/s against K=1's 25). Drafts over a longer prompt may be a little worse (fixed K=3 on two
#: 600-token prompts: 1.07 and 1.79 drafts accepted per step against 1.21 and 1.82 with the whole prompt fed).
PROMPT_FED_AUTO = 64

PHASES = ("prefill", "catch_up", "draft", "snapshot", "verify", "sync", "commit", "replay", "finalize")


@dataclass
class SpecStats:
    commit_mode: str
    k: Union[int, str]
    tokens: int = 0  #: tokens produced (the prefill's first one included)
    steps: int = 0  #: verify forwards
    accepted: int = 0  #: drafts accepted, over every step
    full_accepts: int = 0  #: steps whose every draft was accepted
    direct_commits: int = 0  #: partial accepts committed by installing a captured state (direct mode)
    fallback_replays: int = 0  #: partial accepts committed by restoring a snapshot and replaying (replay mode)
    replayed_tokens: int = 0  #: tokens those replays ran again
    accept_hist: List[int] = field(default_factory=list)
    k_hist: List[int] = field(default_factory=list)  #: K of every step (they differ with "auto")
    times: Dict[str, float] = field(default_factory=lambda: {p: 0.0 for p in PHASES})
    chooser: Optional[KChooser] = None  #: the run's K chooser, with K "auto" (one kept from earlier runs, if given)

    def as_dict(self) -> dict:
        wall = sum(self.times.values())
        decode = wall - self.times["prefill"]
        return {
            "commit_mode": self.commit_mode, "K": self.k, "tokens": self.tokens, "steps": self.steps,
            "accepted_drafts": self.accepted, "avg_accept_len": self.accepted / self.steps if self.steps else 0.0,
            "tokens_per_step": (self.tokens - 1) / self.steps if self.steps else 0.0,
            "full_accepts": self.full_accepts, "direct_commits": self.direct_commits,
            "fallback_replays": self.fallback_replays, "replayed_tokens": self.replayed_tokens,
            "accept_hist": list(self.accept_hist), "k_hist": list(self.k_hist), "wall_s": wall,
            "time_s": dict(self.times),
            "decode_tok_s": (self.tokens - 1) / decode if decode > 0 else 0.0,
            "projected_tok_s_free_replay": (self.tokens - 1) / (decode - self.times["replay"]) if decode > self.times["replay"] else 0.0,
        }


class _Clock:
    def __init__(self, times: Dict[str, float]):
        self.times, self.t = times, time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.times[phase] += now - self.t
        self.t = now


def mtp_generate(model, drafter, prompt_ids: Sequence[int], max_tokens: int, K: Union[int, str] = 3,
                 commit_mode: str = "direct", prefill_chunk: int = 256,
                 on_decode: Optional[Callable[[], None]] = None,
                 chooser: Optional[KChooser] = None) -> Tuple[List[int], dict]:
    """``max_tokens`` ids equal to greedy decoding's, and the run's statistics. ``K`` tokens per verify (1: no
    drafts), or "auto": a ``KChooser`` picks K at every step from what it measures (``chooser``: one kept from
    earlier runs of this model, which starts from what it measured there; else a new one). ``on_decode()`` is
    called once the prompt is prefilled (a benchmark starts its counters there)."""
    stats = SpecStats(commit_mode, K, chooser=chooser)
    out = [token for token, _, _ in mtp_stream(model, drafter, prompt_ids, max_tokens, stats, prefill_chunk, on_decode)]
    result = stats.as_dict()
    if stats.chooser:
        result["k_choice"] = stats.chooser.summary()
    return out, result


def mtp_stream(model, drafter, prompt_ids: Sequence[int], max_tokens: int, stats: SpecStats,
               prefill_chunk: int = 256, on_decode: Optional[Callable[[], None]] = None
               ) -> Iterator[Tuple[int, mx.array, bool]]:
    """``mtp_generate``'s tokens as they are committed: ``(token, logits, from_draft)``, where ``logits`` is
    the main model's row that chose the token and ``from_draft`` says that the head had drafted it (and the
    verify accepted it). ``stats`` (its verify mode and K) is filled as the steps run. A step commits up to K
    tokens at once, so a consumer that stops early leaves the caches past the last token it took."""
    commit_mode, K = stats.commit_mode, stats.k
    if commit_mode not in COMMIT_MODES:
        raise ValueError(f"commit_mode must be one of {COMMIT_MODES}, got {commit_mode!r}")
    if K != "auto" and (not isinstance(K, int) or K < 1):
        raise ValueError(f"K must be a positive integer or 'auto', got {K!r}")
    chooser = stats.chooser = (stats.chooser or KChooser()) if K == "auto" else None
    if chooser:
        chooser.begin()
    clock = _Clock(stats.times)
    captures = state_captures(model) if commit_mode == "direct" else []
    cache = make_prompt_cache(model)

    hiddens = []

    def prefill(ids: mx.array) -> Tuple[mx.array, mx.array]:
        logits, hidden = forward_with_hidden(model, ids, cache)
        hiddens.append(hidden)
        return logits, hidden

    logits, _ = prefill_chunked(prefill, prompt_ids, prefill_chunk)
    x = int(mx.argmax(logits[0, -1]))
    produced = 1
    if on_decode is not None:
        on_decode()
    clock.lap("prefill")
    yield x, logits[0, -1], False
    # The head is fed the prompt's positions when it first drafts, not here: at a bounded pool a feed computes at
    # once (its MoE layer waits for its routes and loads its experts), which a run that never drafts would pay.
    fed = min(len(prompt_ids), PROMPT_FED_AUTO) if chooser else len(prompt_ids)  # the prompt's positions the head gets
    prompt_feed = None if K == 1 else ((list(prompt_ids[1:]) + [x])[-fed:], _last_positions(hiddens, fed))
    hiddens.clear()  # the prefill's hidden states: only the feed's positions are kept

    unfed: List[Tuple[int, mx.array]] = []  # (token, hidden) pairs of steps without drafts, not yet fed
    while produced < max_tokens:
        k = chooser.choose() if chooser else K
        if k == 1:  # no drafts for as long as the choice holds: greedy's steps, one ahead
            stretch = []  # the steps' seconds
            for token, row, hidden, seconds in _steps_ahead(model, cache, x, min(
                    max_tokens - produced, chooser.hold() if chooser else max_tokens), clock):
                stats.steps += 1
                stats.full_accepts += 1
                stats.accept_hist.append(0)
                stats.k_hist.append(1)
                unfed = (unfed + [(token, hidden)])[-UNFED_KEPT:]
                stretch.append(seconds)
                yield token, row, False
                produced += 1
                x = token
            if chooser:
                chooser.record_ahead(stretch)
            continue
        if prompt_feed or unfed:  # the head drafts: feed it the prompt, at its first draft, and the positions it missed
            clock.lap("draft")
            if prompt_feed:
                drafter.extend(*prompt_feed)
                prompt_feed = None
            _catch_up(drafter, unfed)
            clock.lap("catch_up")
            unfed = []
        step_start = time.perf_counter()  # the chooser weighs K's steady step, not the catch-up of a switch to it
        proposed = drafter.propose(k - 1)
        clock.lap("draft")
        snapshot = [list(c.cache) for c in recurrent_caches(cache)] if commit_mode == "replay" else None
        clock.lap("snapshot")
        logits, hidden = _verify(model, mx.concatenate([mx.array([x], proposed.dtype), proposed])[None], cache,
                                 captures)
        clock.lap("verify")
        targets = mx.argmax(logits[0], axis=-1).tolist()
        drafts = proposed.tolist()  # computed with the verify, which took them
        clock.lap("sync")
        a = 0
        while a < k - 1 and drafts[a] == targets[a]:
            a += 1
        committed = drafts[:a] + [targets[a]]
        stats.steps += 1
        stats.accepted += a
        stats.accept_hist.append(a)
        stats.k_hist.append(k)
        if a == k - 1:
            stats.full_accepts += 1
        elif commit_mode == "direct":
            for c in attention_caches(cache):
                c.trim(k - 1 - a)
            for capture, c in zip(captures, recurrent_caches(cache)):
                c.cache = list(capture.states[a])
            stats.direct_commits += 1
            clock.lap("commit")
        else:
            for c in attention_caches(cache):
                c.trim(k)
            for saved, c in zip(snapshot, recurrent_caches(cache)):
                c.cache = saved
            clock.lap("commit")
            _, replayed = forward_with_hidden(model, mx.array([[x] + drafts[:a]]), cache)
            mx.eval(replayed)
            stats.fallback_replays += 1
            stats.replayed_tokens += a + 1
            clock.lap("replay")
        x = committed[-1]
        drafter.extend(committed, hidden[:, : a + 1])
        clock.lap("draft")
        if chooser:
            chooser.record(k, time.perf_counter() - step_start, a)
        for i, token in enumerate(committed[: max_tokens - produced]):  # after the step's clocks: the
            yield token, logits[0, i], i < a                              # consumer's time is not the step's
        produced += len(committed)

    stats.tokens = min(produced, max_tokens)
    clock.lap("finalize")


def _steps_ahead(model, cache, x: int, n: int, clock: _Clock) -> Iterator[Tuple[int, mx.array, mx.array, float]]:
    """``n`` steps without drafts after token ``x``, each queued on the device before the one before it is read
    back (``run_ahead``, greedy decoding's protocol, its miss checks included): per step, the token, the logits row
    it was taken from, the hidden state at the position fed (the head's catch-up takes it) and the step's seconds
    (the consumer's time between steps not counted)."""
    def step(token: mx.array) -> tuple:
        logits, hidden = forward_with_hidden(model, token.reshape(1, 1), cache)
        return mx.argmax(logits[0, -1]), logits[0, -1], hidden

    start = time.perf_counter()
    logits, hidden = _verify(model, mx.array([[x]]), cache, [])  # the first step, checked, before any is queued
    for token, row, hidden in run_ahead(model, step, (mx.argmax(logits[0, -1]), logits[0, -1], hidden), n):
        token = int(token)
        clock.lap("verify")
        yield token, row, hidden, time.perf_counter() - start
        start = time.perf_counter()


def _last_positions(chunks: List[mx.array], n: int) -> mx.array:
    """The last ``n`` positions of hidden states given in chunks along axis 1, from the chunks that hold them."""
    tail, held = [], 0
    for chunk in reversed(chunks):
        tail.insert(0, chunk)
        held += chunk.shape[1]
        if held >= n:
            break
    return mx.concatenate(tail, axis=1)[:, -n:]


def _catch_up(drafter, unfed: List[Tuple[int, mx.array]]) -> None:
    """Feed the head the (token, hidden) pairs of steps it did not draft for, in chunks whose sizes are powers of
    two (11 pairs: 8, 2, 1), the same entries in its cache as one feed of them all: a backend that compiles kernels
    per shape (MLX's CUDA backend does for some) then meets at most log2(UNFED_KEPT) + 1 new shapes here, not one
    per count of missed positions. The head's work is done here (``settle``), so that the step after it, which the
    K chooser times, does not carry it."""
    at = 0
    while at < len(unfed):
        chunk = unfed[at:at + (1 << ((len(unfed) - at).bit_length() - 1))]
        drafter.extend([t for t, _ in chunk], mx.concatenate([h for _, h in chunk], axis=1))
        at += len(chunk)
    drafter.settle()


def _verify(model, ids: mx.array, cache, captures) -> Tuple[mx.array, mx.array]:
    """The verify forward's logits and hidden states, evaluated, the Gated-DeltaNet states kept per position. On
    a streaming model its miss check is queued with it and confirmed while the output layer still runs (the loop
    waits once, not once inside the model call and again for the logits); on a miss the caches are back to
    before it (``MissGuard.confirm``) and it runs again, its experts loaded."""
    guard = guard_of(model)
    for c in captures:
        c.capturing = True
    try:
        queued = queue_step(guard, lambda _: forward_with_hidden(model, ids, cache), ids)
        logits, hidden = queued.result if confirm_step(guard, queued) else forward_with_hidden(model, ids, cache)
        mx.eval(logits, hidden)
        return logits, hidden
    finally:
        for c in captures:
            c.capturing = False
