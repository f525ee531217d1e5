"""The mlx-streaming pytest plugin: options, markers and session fixtures.

Fixtures build each model once per session (once per worker under pytest-xdist). Without ``--model`` the
suite runs on the default tiny synthetic checkpoint, made once into the cache folder.
"""

from __future__ import annotations

from pathlib import Path

import pytest

MARKERS = {
    "exact": "speculative or streaming ids against the greedy in-memory oracle, token by token",
    "perf": "benchmarks (pytest-benchmark); not run unless asked with -m perf",
}

TEST_PROMPTS = (
    "def fibonacci(n):",
    "The quick brown fox jumps over",
    "import numpy as np\n\nclass Matrix:",
    "Once upon a time, in a land far away,",
)


def pytest_addoption(parser):
    group = parser.getgroup("mlx-streaming")
    group.addoption("--model", default=None, help="model folder (default: the tiny synthetic checkpoint)")
    group.addoption("--mtp", default=None, help="MTP weights file (default: the model folder's mtp.safetensors)")
    group.addoption("--pool-slots", type=int, default=None, help="expert slots per layer for the streaming model (default: every expert)")
    group.addoption("--io-mode", default="buffered", choices=("buffered", "direct"), help="how the streaming model reads experts")


def pytest_configure(config):
    for name, text in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {text}")


@pytest.fixture(scope="session")
def model_dir(request) -> Path:
    from .defaults import synthetic_model

    chosen = request.config.getoption("--model")
    return Path(chosen) if chosen else synthetic_model()


@pytest.fixture(scope="session")
def mtp_path(request, model_dir) -> Path:
    chosen = request.config.getoption("--mtp")
    return Path(chosen) if chosen else model_dir / "mtp.safetensors"


@pytest.fixture(scope="session")
def streaming_config(request):
    from .config import StreamingConfig

    return StreamingConfig(pool_slots=request.config.getoption("--pool-slots"), io_mode=request.config.getoption("--io-mode"))


@pytest.fixture(scope="session")
def streaming_model(model_dir, streaming_config):
    from .model import build_streaming_model

    with build_streaming_model(model_dir, streaming_config) as sm:
        yield sm


@pytest.fixture(scope="session")
def reference_model(model_dir):
    """mlx-lm's own in-memory model on the same checkpoint: the oracle."""
    import mlx_lm

    model, _ = mlx_lm.load(str(model_dir))
    return model


@pytest.fixture(scope="session")
def prompt_ids(streaming_model):
    """Token ids of the standard test prompts."""
    return [streaming_model.tokenizer.encode(p) for p in TEST_PROMPTS]
