"""Greedy decoding over any mlx-lm model (in-memory or streaming): the oracle and the engine share it."""

from __future__ import annotations

from typing import Any, Callable, Collection, Iterator, List, Optional, Sequence, Tuple

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from .ahead import run_ahead


def prefill_chunked(forward: Callable[[mx.array], Any], prompt_ids: Sequence[int], chunk: int) -> Any:
    """Run the prompt ``chunk`` tokens per call of ``forward(ids of shape [1, n])``, each call's outputs
    evaluated before the next; return the last call's."""
    if not prompt_ids:
        raise ValueError("the prompt must hold at least one token")
    for start in range(0, len(prompt_ids), chunk):
        out = forward(mx.array([list(prompt_ids[start:start + chunk])]))
        mx.eval(out)
    return out


def greedy_steps(model, prompt_ids: Sequence[int], max_tokens: int, prefill_chunk: int = 256,
                 after_prefill: Optional[Callable[[], None]] = None) -> Iterator[Tuple[int, mx.array]]:
    """Yield ``(token id, logits it was taken from)`` for each of ``max_tokens`` greedy steps, one step ahead
    (``ahead.run_ahead``); ``after_prefill()`` is called once the prompt is prefilled, before the first decode
    step is queued."""
    cache = make_prompt_cache(model)
    logits = prefill_chunked(lambda ids: model(ids, cache=cache), prompt_ids, prefill_chunk)[0, -1]
    if after_prefill is not None:
        after_prefill()

    def step(token: mx.array) -> Tuple[mx.array, mx.array]:
        logits = model(token.reshape(1, 1), cache=cache)[0, -1]
        return mx.argmax(logits), logits

    for token, logits in run_ahead(model, step, (mx.argmax(logits), logits), max_tokens):
        yield int(token), logits


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
