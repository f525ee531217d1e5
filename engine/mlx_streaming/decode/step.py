"""``generate_step`` with mlx-lm's signature and semantics, one step ahead through the streaming store's check.

mlx-lm's own ``generate_step`` runs on a streaming model unchanged, but there each forward's miss check waits
inside the model call (a token is read right after the next step is queued, so a miss found one step late could
not be taken back). This loop yields the same tokens and log-probabilities (samplers, logits processors, prompt
cache, seeded sampling: the same random keys in the same order) and leaves the same caches, with each check
confirmed one step late (``ahead.run_ahead``): a step rerun after a miss draws the random key it drew before.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any, Callable, Generator, List, Optional, Tuple

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import greedy_sampler

from .ahead import run_ahead

#: The module (``mlx_lm.generate`` as an attribute is the package's ``generate`` function).
mlx_generate = importlib.import_module("mlx_lm.generate")


def _random_key_rewind() -> Callable[[], None]:
    """What puts MLX's global random key back to now (lazy: the key is read only on a rewind). MLX exposes no
    setter for the key; ``mx.random.seed(s)`` sets it to ``[s >> 32, s & 0xffffffff]``."""
    key = mx.random.state[0]

    def rewind():
        hi, lo = (int(v) for v in np.array(key))
        mx.random.seed((hi << 32) | lo)

    return rewind


def generate_step(prompt: mx.array, model, stream=mlx_generate.generation_stream, *, max_tokens: int = 256,
                  sampler: Optional[Callable] = None, logits_processors: Optional[List[Callable]] = None,
                  max_kv_size: Optional[int] = None, prompt_cache: Optional[Any] = None,
                  prefill_step_size: int = 2048, kv_bits: Optional[int] = None, kv_group_size: int = 64,
                  quantized_kv_start: int = mlx_generate.DEFAULT_QUANTIZED_KV_START,
                  prompt_progress_callback: Optional[Callable[[int, int], None]] = None,
                  input_embeddings: Optional[mx.array] = None) -> Generator[Tuple[int, mx.array], None, None]:
    """mlx-lm's ``generate_step``: ``(token, log-probabilities)`` per step. With ``input_embeddings`` it is
    mlx-lm's own loop (no text model of this project takes them)."""
    if input_embeddings is not None:
        yield from mlx_generate.generate_step(
            prompt, model, stream, max_tokens=max_tokens, sampler=sampler, logits_processors=logits_processors,
            max_kv_size=max_kv_size, prompt_cache=prompt_cache, prefill_step_size=prefill_step_size,
            kv_bits=kv_bits, kv_group_size=kv_group_size, quantized_kv_start=quantized_kv_start,
            prompt_progress_callback=prompt_progress_callback, input_embeddings=input_embeddings)
        return
    if len(prompt) == 0:
        raise ValueError("Either input_embeddings or prompt (or both) must be provided.")
    if prompt_cache is None:
        prompt_cache = make_prompt_cache(model, max_kv_size=max_kv_size)
    progress = prompt_progress_callback or (lambda *_: None)
    quantize_cache = functools.partial(mlx_generate.maybe_quantize_kv_cache, quantized_kv_start=quantized_kv_start,
                                       kv_group_size=kv_group_size, kv_bits=kv_bits)
    sampler = sampler or greedy_sampler
    history = [None]  # the tokens the logits processors see (mlx-lm's ``tokens``)

    def step(input_tokens: mx.array) -> Tuple[mx.array, mx.array]:
        with mx.stream(stream):
            logits = model(input_tokens[None], cache=prompt_cache)[:, -1, :]
            if logits_processors and len(input_tokens) > 0:
                history[0] = input_tokens if history[0] is None else mx.concat([history[0], input_tokens])
                for processor in logits_processors:
                    logits = processor(history[0], logits)
            quantize_cache(prompt_cache)
            logprobs = logits - mx.logsumexp(logits, keepdims=True)
            return sampler(logprobs), logprobs.squeeze(0)

    def rewind() -> Callable[[], None]:
        tokens, key = history[0], _random_key_rewind()

        def undo():
            history[0] = tokens
            key()

        return undo

    with mx.stream(stream):
        total, done = len(prompt), 0
        progress(done, total)
        while total - done > 1:
            n = min(prefill_step_size, total - done - 1)
            model(prompt[:n][None], cache=prompt_cache)
            quantize_cache(prompt_cache)
            mx.eval([c.state for c in prompt_cache])
            if logits_processors:
                history[0] = prompt[:n] if history[0] is None else mx.concat([history[0], prompt[:n]])
            done += n
            progress(done, total)
            prompt = prompt[n:]
            mx.clear_cache()
        first = step(prompt)
        mx.async_eval(*first)
        for n, (token, logprobs) in enumerate(run_ahead(model, step, first, max_tokens, rewind, feed_last=True)):
            if n == 0:
                progress(total, total)
            yield token.item(), logprobs
            if n % 256 == 0:
                mx.clear_cache()
