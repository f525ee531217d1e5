"""``mlx-streaming serve``: mlx-lm's OpenAI-compatible HTTP server on a streaming model.

mlx-lm's server (its request handling, streaming by server-sent events, usage counts, prompt cache, samplers)
runs unchanged; only its model provider is ours: ``StreamingModelProvider`` builds the streaming model with the
engine's options instead of loading every weight. Requests run one at a time (no batching: every request goes
through the one expert pool, token for token as mlx-lm's own path).

Every request runs the engine's loops (``loop``: the model provider puts an ``EngineLoop`` in the server's
draft-model slot): a greedy request (temperature 0, no logits processors) on a model with an MTP head runs the
engine's self-speculative decoding (K as configured, "auto" by default), whose tokens are greedy's; any other
request the engine's ``generate_step``, mlx-lm's sampling one step ahead through the miss check (exact
speculative sampling is not built). With an MTP head mlx-lm's prompt cache is off (size 0): a speculative step
commits up to K tokens at once, so the caches can run past the tokens the server keeps as the cache's key.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from mlx_lm import server as mlx_server

from ..config import StreamingConfig
from ..run_settings import RunSettings
from . import internals, loop, require_tested_mlx_lm


class StreamingModelProvider(mlx_server.ModelProvider):
    """mlx-lm's model provider, building the one streaming model it serves (``--model`` or the default)."""

    def __init__(self, cli_args: argparse.Namespace, model_dir: Path, config: StreamingConfig, run: RunSettings):
        self.model_dir, self.config, self.run, self.streaming = Path(model_dir), config, run, None
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
        self.draft_model = loop.EngineLoop(self.streaming, self.run.k, self.run.commit_mode, speculate=True)

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


def serve(model_dir: Path, config: StreamingConfig, run: RunSettings, host: str, port: int, temp: float,
          top_p: float) -> None:
    require_tested_mlx_lm("mlx-streaming serve")
    args = server_args(model_dir, host, port, run.max_tokens, temp, top_p)
    logging.basicConfig(level=args.log_level, format="%(asctime)s - %(levelname)s - %(message)s")  # as mlx_lm.server's
    provider = StreamingModelProvider(args, model_dir, config, run)
    provider.load_default()  # build now: a bad option fails here, in one line, not at the first request
    internals.install_engine_step()
    internals.tag_greedy_requests()
    if provider.draft_model.speculate:  # a speculative step commits up to K tokens: caches may run past the key
        args.prompt_cache_size = 0
    # mlx_server.run's three lines, with our handler class
    generator = mlx_server.ResponseGenerator(provider, mlx_server.LRUPromptCache(args.prompt_cache_size))
    internals.run_http_server(host, port, generator, StreamingAPIHandler)
