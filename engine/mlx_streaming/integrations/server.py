"""``mlx-streaming serve``: mlx-lm's OpenAI-compatible HTTP server on a streaming model.

mlx-lm's server (its request handling, streaming by server-sent events, usage counts, prompt cache, samplers)
runs unchanged; only its model provider is ours: ``StreamingModelProvider`` builds the streaming model with the
engine's options instead of loading every weight. Requests run one at a time (no batching: every request goes
through the one expert pool, token for token as mlx-lm's own path).

Speculation: when the model has an MTP head, greedy requests (temperature 0, no logits processors) run our
self-speculative decoding (``mtp_stream``, K as configured, "auto" by default), whose tokens are greedy's; sampled
requests sample with mlx-lm's sampler and no speculation (exact speculative sampling is not built). The head
takes the server's draft-model slot: mlx-lm's ``stream_generate`` hands a draft model to
``speculative_generate_step``, and ``install_speculation`` puts ``speculative_step`` there, which serves
``MTPDraft`` and passes any other draft model on to mlx-lm's own function. mlx-lm's prompt cache is off then
(size 0): a speculative step commits up to K tokens at once, so the caches can run past the tokens the server
keeps as the cache's key.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
from pathlib import Path

import mlx.core as mx
from mlx_lm import server as mlx_server

from ..config import StreamingConfig
from . import require_tested_mlx_lm

#: The module (``mlx_lm.generate`` as an attribute is the package's ``generate`` function).
mlx_generate = importlib.import_module("mlx_lm.generate")


class MTPDraft:
    """The MTP head in mlx-lm's draft-model slot: what ``speculative_step`` needs to run a greedy request."""

    def __init__(self, streaming, config: StreamingConfig):
        self.streaming, self.k, self.verify_mode = streaming, config.k, config.verify_mode

    def make_cache(self) -> list:
        """mlx-lm's server appends the draft model's caches to the request's; the head keeps its own."""
        return []


def speculative_step(prompt, model, draft_model, stream=mlx_generate.generation_stream, **kwargs):
    """``speculative_generate_step`` for ``stream_generate``: ``(token, logprobs, from_draft)``."""
    if not isinstance(draft_model, MTPDraft):
        return _MLX_SPECULATIVE_STEP(prompt, model, draft_model, stream, **kwargs)
    kwargs.pop("num_draft_tokens", None)
    greedy = getattr(kwargs.get("sampler"), "greedy", False) and not kwargs.get("logits_processors")
    if not greedy:
        return ((token, logprobs, False) for token, logprobs in mlx_generate.generate_step(prompt, model, stream, **kwargs))
    return _mtp_tokens(prompt.tolist(), draft_model, stream, kwargs["max_tokens"])


def _mtp_tokens(prompt, draft: MTPDraft, stream, max_tokens: int):
    from ..mtp.drafter import MTPDrafter
    from ..mtp.speculative import SpecStats, mtp_stream

    sm, stats = draft.streaming, SpecStats(draft.verify_mode, draft.k)
    try:
        with mx.stream(stream):
            for token, logits, from_draft in mtp_stream(sm.model, MTPDrafter(sm.mtp, sm.model), prompt, max_tokens, stats):
                yield token, logits - mx.logsumexp(logits, keepdims=True), from_draft
    finally:  # also when the server stops early (a stop string, a client gone)
        logging.info("speculative: %d steps, %d accepted drafts (K %s)", stats.steps, stats.accepted, draft.k)


def _tag_greedy(make_sampler):
    """mlx-lm's request sampler, marked ``greedy`` when the request's temperature is 0."""
    def make(args, tokenizer):
        sampler = make_sampler(args, tokenizer)
        sampler.greedy = args.sampling.temperature == 0
        return sampler
    return make


_MLX_SPECULATIVE_STEP = mlx_generate.speculative_generate_step


def install_speculation() -> None:
    """mlx-lm's server has no hook for another generator: its module-level ``_make_sampler`` and
    ``mlx_lm.generate.speculative_generate_step`` (looked up at every call) are replaced, in this process."""
    if mlx_generate.speculative_generate_step is not speculative_step:
        mlx_generate.speculative_generate_step = speculative_step
        mlx_server._make_sampler = _tag_greedy(mlx_server._make_sampler)


class StreamingModelProvider(mlx_server.ModelProvider):
    """mlx-lm's model provider, building the one streaming model it serves (``--model`` or the default)."""

    def __init__(self, cli_args: argparse.Namespace, model_dir: Path, config: StreamingConfig):
        self.model_dir, self.config, self.streaming = Path(model_dir), config, None
        super().__init__(cli_args)

    def _load(self, model_path, adapter_path=None, draft_model_path=None):
        from ..errors import ConfigError
        from ..model import build_streaming_model

        if adapter_path is not None or draft_model_path is not None:
            raise ConfigError("serve: adapters and draft models are not supported on a streaming model")
        if model_path not in self.names():
            # mlx-lm answers a failed load with 404 and this message
            raise ConfigError(f"model {model_path!r} is not served here; this server serves {self.served_id()!r}")
        if self.streaming is None:
            self.streaming = build_streaming_model(self.model_dir, self.config)
        self.model_key = (model_path, adapter_path, draft_model_path)
        self.model, self.tokenizer = self.streaming.model, self.streaming.tokenizer
        self.processor, self.is_batchable = None, False
        self.draft_model = MTPDraft(self.streaming, self.config) if self.streaming.mtp is not None else None

    def served_id(self) -> str:
        """The model's id in ``/v1/models``: its folder's absolute path."""
        return str(self.model_dir.resolve())

    def names(self) -> set:
        """What a request's ``model`` may say: the id, the folder as given on the command line, or its name."""
        return {self.served_id(), str(self.model_dir), self.model_dir.name}


class StreamingAPIHandler(mlx_server.APIHandler):
    """mlx-lm's request handler; ``/v1/models`` lists the one model served (mlx-lm's lists the Hugging Face
    download cache, which a streaming server neither uses nor needs)."""

    def handle_models_request(self):
        self._set_completion_headers(200)
        self.end_headers()
        model = self.response_generator.model_provider.served_id()
        body = {"object": "list", "data": [{"id": model, "object": "model", "created": self.created}]}
        self.wfile.write(json.dumps(body).encode())
        self.wfile.flush()


def server_args(model_dir: Path, host: str, port: int, max_tokens: int, temp: float, top_p: float) -> argparse.Namespace:
    """The settings mlx-lm's server reads from its command line, with its own defaults."""
    return argparse.Namespace(
        model=str(model_dir), adapter_path=None, draft_model=None, num_draft_tokens=3, host=host, port=port,
        allowed_origins=["*"], trust_remote_code=False, chat_template="", use_default_chat_template=False,
        temp=temp, top_p=top_p, top_k=0, min_p=0.0, max_tokens=max_tokens, chat_template_args={},
        decode_concurrency=1, prompt_concurrency=1, prefill_step_size=2048, prompt_cache_size=4,
        prompt_cache_bytes=None, kv_bits=None, kv_group_size=64, quantized_kv_start=0, pipeline=False,
        log_level="INFO")


def serve(model_dir: Path, config: StreamingConfig, host: str, port: int, temp: float, top_p: float) -> None:
    require_tested_mlx_lm("mlx-streaming serve")
    args = server_args(model_dir, host, port, config.max_tokens, temp, top_p)
    logging.basicConfig(level=args.log_level, format="%(asctime)s - %(levelname)s - %(message)s")  # as mlx_lm.server's
    provider = StreamingModelProvider(args, model_dir, config)
    provider.load_default()  # build now: a bad option fails here, in one line, not at the first request
    if provider.draft_model is not None:
        install_speculation()
        args.prompt_cache_size = 0
    # mlx_server.run takes a handler_class but does not pass it on (mlx-lm 0.32.2), so its three lines are
    # repeated here with ours; _run_http_server is private to mlx-lm's server.
    generator = mlx_server.ResponseGenerator(provider, mlx_server.LRUPromptCache(args.prompt_cache_size))
    mlx_server._run_http_server(host, port, generator, handler_class=StreamingAPIHandler)
