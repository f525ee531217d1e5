"""Every use of mlx-lm's internals, in one module: names it does not promise to keep (its server's private
``_make_sampler`` and ``_run_http_server``) and a function of its own replaced in this process
(``speculative_generate_step``, through which ``stream_generate`` reaches the engine's loops). Only the project's
``chat`` and ``serve`` commands call these; they run on the mlx-lm versions ``require_tested_mlx_lm`` names.
"""

from __future__ import annotations

from mlx_lm import server as mlx_server

from . import loop


def install_engine_step() -> None:
    """``stream_generate``'s draft slot through ``loop.engine_step``, in this process."""
    loop.mlx_generate.speculative_generate_step = loop.engine_step


def _tag_greedy(make_sampler):
    """mlx-lm's request sampler, marked ``greedy`` when the request's temperature is 0."""
    def make(args, tokenizer):
        sampler = make_sampler(args, tokenizer)
        sampler.greedy = args.sampling.temperature == 0
        return sampler
    return make


def tag_greedy_requests() -> None:
    """The server's samplers say whether their request is greedy (``loop.engine_step`` speculates on those): it
    has no hook for that, so its module-level ``_make_sampler`` is replaced, in this process."""
    if not hasattr(mlx_server._make_sampler, "tags_greedy"):
        mlx_server._make_sampler = _tag_greedy(mlx_server._make_sampler)
        mlx_server._make_sampler.tags_greedy = True


def run_http_server(host: str, port: int, generator, handler_class) -> None:
    """mlx-lm's HTTP server with ``handler_class``: ``mlx_lm.server.run`` takes a handler class but does not pass it
    on (mlx-lm 0.32.2), so its private ``_run_http_server`` is called."""
    mlx_server._run_http_server(host, port, generator, handler_class=handler_class)
