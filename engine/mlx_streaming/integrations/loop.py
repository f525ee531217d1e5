"""mlx-lm's ``stream_generate`` driving the engine's loops, through its draft-model slot.

``stream_generate`` takes no generator of its own; given a draft model it calls
``mlx_lm.generate.speculative_generate_step``, looked up at every call. ``internals.install_engine_step`` puts
``engine_step`` there, in this process (the project's ``chat`` and ``serve`` commands call it; importing the
package does not). With an
``EngineLoop`` in the draft slot a request runs the engine's loops: greedy requests on a model with an MTP head
the engine's speculation (``mtp_stream``, whose tokens are greedy's), every other request the engine's
``generate_step`` (mlx-lm's semantics, one step ahead through the miss check). Any other draft model goes to
mlx-lm's own function. In the draft slot ``stream_generate`` drops ``prompt_progress_callback`` and
``max_kv_size`` before the call.
"""

from __future__ import annotations

import logging

import mlx.core as mx

from ..decode.step import generate_step, mlx_generate
from ..mtp.autok import KChooser

_MLX_SPECULATIVE_STEP = mlx_generate.speculative_generate_step


class EngineLoop:
    """What stands in mlx-lm's draft-model slot: the streaming model, and how greedy requests speculate
    (``k``, ``commit_mode``; ``speculate`` False: never, as where the prompt cache must end at the last token).
    With ``k`` "auto" one K chooser serves every request (mlx-lm's server runs requests with a draft model one at a
    time): a request starts from the K the earlier ones measured best, with no climb."""

    def __init__(self, streaming, k, commit_mode: str, speculate: bool):
        self.streaming, self.k, self.commit_mode = streaming, k, commit_mode
        self.speculate = speculate and streaming.mtp is not None
        self.chooser = KChooser() if k == "auto" and self.speculate else None

    def make_cache(self) -> list:
        """mlx-lm's server appends the draft model's caches to the request's: the engine keeps none there."""
        return []


def engine_step(prompt, model, draft_model, stream=mlx_generate.generation_stream, **kwargs):
    """``speculative_generate_step`` for ``stream_generate``: ``(token, logprobs, from_draft)``."""
    if not isinstance(draft_model, EngineLoop):
        return _MLX_SPECULATIVE_STEP(prompt, model, draft_model, stream, **kwargs)
    kwargs.pop("num_draft_tokens", None)
    greedy = getattr(kwargs.get("sampler"), "greedy", False) and not kwargs.get("logits_processors")
    if not (greedy and draft_model.speculate):
        return ((token, logprobs, False) for token, logprobs in generate_step(prompt, model, stream, **kwargs))
    return _mtp_tokens(prompt.tolist(), draft_model, stream, kwargs["max_tokens"])


def _mtp_tokens(prompt, loop: EngineLoop, stream, max_tokens: int):
    from ..mtp.drafter import MTPDrafter
    from ..mtp.speculative import SpecStats, mtp_stream

    sm, stats = loop.streaming, SpecStats(loop.commit_mode, loop.k, chooser=loop.chooser)
    try:
        with mx.stream(stream):
            for token, logits, from_draft in mtp_stream(sm.model, MTPDrafter(sm.mtp, sm.model), prompt, max_tokens, stats):
                yield token, logits - mx.logsumexp(logits, keepdims=True), from_draft
    finally:  # also when the consumer stops early (a stop string, a client gone)
        logging.info("speculative: %d steps, %d accepted drafts (K %s)", stats.steps, stats.accepted, loop.k)
