"""mlx-streaming: run Mixture-of-Experts LLMs larger than memory on MLX.

Dense weights stay resident; expert weights stream from disk into a bounded pool. Importing the package
imports no MLX: the pool policy and the config are usable (and tested) without it.
"""

__version__ = "0.1.0"

_EXPORTS = {
    "StreamingConfig": "mlx_streaming.config",
    "StreamingError": "mlx_streaming.errors",
    "build_streaming_model": "mlx_streaming.model",
    "StreamingModel": "mlx_streaming.model",
    "greedy_generate": "mlx_streaming.decode.greedy",
    "generate_step": "mlx_streaming.decode.step",
}


def __getattr__(name):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'mlx_streaming' has no attribute {name!r}")
