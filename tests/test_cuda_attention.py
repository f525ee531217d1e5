"""MLX's cuDNN attention on CUDA, turned off where a model that speculates is built (a graph per new shape of a
verify's attention cost 41-67 ms a step on an H100): the switch is MLX's own, set once, said on stderr, and a
user's own value is kept. This machine has no CUDA, so the backend's answer is planted."""

import os

import mlx.core as mx
import pytest

from mlx_streaming.config import StreamingConfig
from mlx_streaming.defaults import default_model
from mlx_streaming.model import build_streaming_model
from mlx_streaming.runtime.cuda_attention import CUDNN_ATTENTION, avoid_graph_per_shape


def _unset(monkeypatch):
    """The switch unset for the test, and put back as it was after it (the engine's own setting included)."""
    monkeypatch.setenv(CUDNN_ATTENTION, "")
    monkeypatch.delenv(CUDNN_ATTENTION)


@pytest.fixture
def on_cuda(monkeypatch):
    _unset(monkeypatch)
    monkeypatch.setattr(mx.cuda, "is_available", lambda: True)


def test_on_cuda_the_switch_is_turned_off_once_and_said(on_cuda, capsys):
    assert avoid_graph_per_shape() and os.environ[CUDNN_ATTENTION] == "0"
    assert f"{CUDNN_ATTENTION}=0 (MLX reads it at the process's first attention)" in capsys.readouterr().err
    assert not avoid_graph_per_shape() and capsys.readouterr().err == ""


def test_a_users_own_value_is_kept(on_cuda, monkeypatch, capsys):
    monkeypatch.setenv(CUDNN_ATTENTION, "1")
    assert not avoid_graph_per_shape() and os.environ[CUDNN_ATTENTION] == "1"
    assert capsys.readouterr().err == ""


def test_off_cuda_nothing_changes(monkeypatch):
    _unset(monkeypatch)
    monkeypatch.setattr(mx.cuda, "is_available", lambda: False)
    assert not avoid_graph_per_shape() and CUDNN_ATTENTION not in os.environ


@pytest.mark.parametrize("mtp", [True, False])
def test_a_model_is_built_with_the_switch_set_only_where_it_has_an_mtp_head(on_cuda, mtp):
    with build_streaming_model(default_model(), StreamingConfig(mtp=mtp)) as sm:
        assert (sm.mtp is not None) == mtp
        assert os.environ.get(CUDNN_ATTENTION) == ("0" if mtp else None)
