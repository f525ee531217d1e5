"""Repo-level test setup. Fixtures, options and markers come from the installed plugin
(``mlx_streaming.harness.pytest_plugin``, registered through the ``pytest11`` entry point); this file only says where
this repository keeps its recorded benchmark baselines: ``baselines/<machine profile>/`` (pytest-benchmark's
own storage, one folder per machine id)."""

from pathlib import Path

import pytest

BASELINES = Path(__file__).parent / "baselines"
PYTEST_BENCHMARK_DEFAULT_STORAGE = "file://./.benchmarks"


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    if config.getoption("benchmark_storage", None) == PYTEST_BENCHMARK_DEFAULT_STORAGE:
        config.option.benchmark_storage = f"file://{BASELINES}"


@pytest.fixture(scope="session")
def tiny_synth(tmp_path_factory):
    """The tiny synthetic checkpoint (seed 0) in both layouts, made once per session: for the tests of the
    synthetic writer and of extract-mtp (the suite's model is the embedded trained one)."""
    from mlx_streaming.harness.synth import synth_checkpoint

    root = tmp_path_factory.mktemp("tiny")
    return {layout: synth_checkpoint(root / layout, preset="tiny", seed=0, layout=layout) for layout in ("mlx", "hf")}
