"""Greedy decoding over any mlx-lm model (in-memory or streaming): the oracle and the engine share it."""

from __future__ import annotations

from typing import Collection, Iterator, List, Optional, Sequence, Tuple

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


def greedy_steps(model, prompt_ids: Sequence[int], max_tokens: int, prefill_chunk: int = 256) -> Iterator[Tuple[int, mx.array]]:
    """Yield ``(token id, logits it was taken from)`` for each of ``max_tokens`` greedy steps."""
    cache = make_prompt_cache(model)
    logits = prefill_chunked(model, prompt_ids, cache, prefill_chunk)
    for step in range(max_tokens):
        token = int(mx.argmax(logits))
        yield token, logits
        if step + 1 < max_tokens:
            logits = model(mx.array([[token]]), cache=cache)[0, -1]
            mx.eval(logits)


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
