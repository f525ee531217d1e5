"""``mlx-streaming chat``: an interactive chat on a streaming model, through mlx-lm's own generation.

Each answer streams through ``mlx_lm.stream_generate`` with mlx-lm's sampler, and the prompt cache carries the
conversation from turn to turn, as ``mlx_lm.chat`` does; the tokens come from the engine's ``generate_step``
(``loop``: mlx-lm's semantics, one step ahead through the miss check). A model with a chat template gets each
line as a user turn; one without (the embedded default model is a code model) gets the line as text to continue.
After each answer one line says its tok/s, the pool's hit rate and the megabytes read from disk for it. Ctrl-C ends the
answer, not the session; Ctrl-D (or Ctrl-C at the prompt) ends the session.
"""

from __future__ import annotations

import sys

from ..config import StreamingConfig
from ..run_settings import RunSettings


def _turn_tokens(tokenizer, text: str) -> list:
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return tokenizer.encode(text)


def chat(model_dir, config: StreamingConfig, run: RunSettings, temp: float, top_p: float, seed: int, read=input,
         write=sys.stdout.write) -> None:
    import mlx.core as mx
    from mlx_lm import stream_generate
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.sample_utils import make_sampler

    from ..model import build_streaming_model
    from ..harness.report import counters_line
    from . import internals, loop, require_tested_mlx_lm

    require_tested_mlx_lm("mlx-streaming chat")
    mx.random.seed(seed)
    internals.install_engine_step()
    with build_streaming_model(model_dir, config) as sm:
        engine = loop.EngineLoop(sm, run.k, run.commit_mode, speculate=False)  # the cache ends at the answer
        tokenizer, store = sm.tokenizer, sm.store
        if not getattr(tokenizer, "chat_template", None):
            print("this model has no chat template: each line is text for it to continue", file=sys.stderr)
        cache, sampler = make_prompt_cache(sm.model), make_sampler(temp=temp, top_p=top_p)
        while True:
            try:
                text = read(">> ")
            except (EOFError, KeyboardInterrupt):
                write("\n")
                return
            if not text.strip():
                continue
            store.reset_stats()
            last = None
            try:
                for last in stream_generate(sm.model, tokenizer, _turn_tokens(tokenizer, text), max_tokens=run.max_tokens,
                                            sampler=sampler, prompt_cache=cache, draft_model=engine):
                    write(last.text)
                    sys.stdout.flush()
            except KeyboardInterrupt:
                write(" [interrupted]")
            write("\n")
            stats = store.stats()
            speed = f"{last.generation_tps:.2f} tok/s, " if last is not None else ""
            print(f"[{speed}{counters_line(stats, 'this answer')}]",
                  file=sys.stderr)
