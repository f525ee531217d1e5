"""Greedy decoding over any mlx-lm model (in-memory or streaming): the oracle and the engine share it."""

from __future__ import annotations

from typing import Callable, Collection, Iterator, List, Optional, Sequence, Tuple

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache


def prefill_chunked(model, prompt_ids: Sequence[int], cache, chunk: int) -> mx.array:
    """Run the prompt ``chunk`` tokens per forward; return the last position's logits."""
    if not prompt_ids:
        raise ValueError("the prompt must hold at least one token")
    for start in range(0, len(prompt_ids), chunk):
        logits = model(mx.array([list(prompt_ids[start:start + chunk])]), cache=cache)
        mx.eval(logits)
    return logits[0, -1]


def greedy_steps(model, prompt_ids: Sequence[int], max_tokens: int, prefill_chunk: int = 256,
                 after_prefill: Optional[Callable[[], None]] = None) -> Iterator[Tuple[int, mx.array]]:
    """Yield ``(token id, logits it was taken from)`` for each of ``max_tokens`` greedy steps; ``after_prefill()``
    is called once the prompt is prefilled, before the first decode step is queued.

    One step ahead, as mlx-lm's ``generate_step``: the forward of token n+1 is queued on the device before
    token n is read back, so the host builds the next graph while the device computes. A streaming model
    (one with a ``streaming_store``) leaves each forward's check of its routed experts queued; the check of
    step n is confirmed when its token is read back, and on a miss the step runs again, its experts loaded,
    after the forward queued behind it is dropped (``MissGuard.confirm``)."""
    store = getattr(model, "streaming_store", None)
    cache = make_prompt_cache(model)
    logits = prefill_chunked(model, prompt_ids, cache, prefill_chunk)
    if after_prefill is not None:
        after_prefill()
    token, check, previous = mx.argmax(logits), None, None
    try:
        for step in range(max_tokens):
            if step + 1 < max_tokens:
                queued = _queue_step(model, token, cache, store)
            if check is not None and not store.guard.confirm(check):
                logits = model(previous.reshape(1, 1), cache=cache)[0, -1]
                token = mx.argmax(logits)
                if step + 1 < max_tokens:
                    queued = _queue_step(model, token, cache, store)
            yield int(token), logits
            if step + 1 < max_tokens:
                previous, (logits, token, check) = token, queued
    finally:
        if store is not None:
            store.guard.drop_queued()


def _queue_step(model, token: mx.array, cache, store) -> tuple:
    """The logits after ``token`` and their greedy token, queued on the device, and the forward's queued check
    (None where there is none)."""
    if store is None:
        logits, checks = model(token.reshape(1, 1), cache=cache)[0, -1], ()
    else:
        with store.guard.queueing() as checks:
            logits = model(token.reshape(1, 1), cache=cache)[0, -1]
    next_token = mx.argmax(logits)
    # the check's routes too: confirming it then waits for nothing the device has not already been given
    mx.async_eval(next_token, *(check.flat for check in checks))
    return logits, next_token, (checks[0] if checks else None)


def top2_margin(logits: mx.array) -> Tuple[int, int, float, float]:
    """(top-1 id, top-2 id, their logit gap, the top-1 logit) of one position's logits."""
    values = logits.astype(mx.float32)
    top = mx.argsort(-values)[:2]
    a, b = int(top[0]), int(top[1])
    return a, b, float(values[a] - values[b]), float(values[a])


def greedy_generate(model, prompt_ids: Sequence[int], max_tokens: int, prefill_chunk: int = 256,
                    margins: Optional[list] = None, stop_ids: Collection[int] = ()) -> List[int]:
    """Greedy token ids; with ``margins`` given, append each step's ``top2_margin`` to it."""
    ids = []
    for token, logits in greedy_steps(model, prompt_ids, max_tokens, prefill_chunk):
        ids.append(token)
        if margins is not None:
            margins.append(top2_margin(logits))
        if token in stop_ids:
            break
    return ids
