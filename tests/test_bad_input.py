"""Bad input gets a StreamingError that names the file, tensor or option, before anything is half-built."""

import json
import shutil

import pytest

from mlx_streaming.config import StreamingConfig
from mlx_streaming.errors import CheckpointError, ConfigMismatchError, PoolTooSmallError, StreamingError
from mlx_streaming.model import build_streaming_model


@pytest.fixture
def broken(tmp_path, model_dir):
    """A private copy of the tiny checkpoint to damage."""
    copy = tmp_path / "model"
    shutil.copytree(model_dir, copy)
    return copy


def _edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def _expert_shard(path, tensor="model.layers.0.mlp.switch_mlp.gate_proj.weight"):
    index = json.loads((path / "model.safetensors.index.json").read_text())
    return path / index["weight_map"][tensor]


def test_missing_config(broken):
    (broken / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"config\.json: missing"):
        build_streaming_model(broken)


@pytest.mark.parametrize("key,value", [("num_experts", 64), ("hidden_size", 512)])
def test_config_that_does_not_match_the_tensors(broken, key, value):
    _edit_config(broken, **{key: value})
    with pytest.raises(ConfigMismatchError, match=r"do not match config\.json.*model\.layers"):
        build_streaming_model(broken)


def test_shard_named_in_the_index_but_missing(broken):
    shard = _expert_shard(broken)
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"{shard.name}: shard named in model.safetensors.index.json is missing"):
        build_streaming_model(broken)


def test_truncated_shard(broken):
    shard = _expert_shard(broken)
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 1000])
    with pytest.raises(CheckpointError, match=f"{shard.name}: truncated shard: tensor "):
        build_streaming_model(broken)


def test_corrupt_safetensors_header(broken):
    shard = _expert_shard(broken)
    data = bytearray(shard.read_bytes())
    data[10:20] = b"\x00garbage\x00\x00"
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"{shard.name}: corrupt safetensors header"):
        build_streaming_model(broken)


def test_expert_tensor_with_the_wrong_dtype(broken):
    name = "model.layers.1.mlp.switch_mlp.up_proj.weight"
    shard = _expert_shard(broken, name)
    data = shard.read_bytes()
    at = data.index(name.encode())
    patched = data[:at] + data[at:].replace(b'"dtype":"U32"', b'"dtype":"I32"', 1)
    assert patched != data
    shard.write_bytes(patched)
    with pytest.raises(ConfigMismatchError, match=f"{shard.name}: tensor {name} has dtype I32"):
        build_streaming_model(broken)


def test_pool_slots_below_top_k(model_dir):
    with pytest.raises(PoolTooSmallError, match="pool_slots=3 gives 3 expert slots per MoE layer, below num_experts_per_tok=4"):
        build_streaming_model(model_dir, StreamingConfig(pool_slots=3))


def test_memory_budget_below_the_dense_weights(model_dir):
    with pytest.raises(PoolTooSmallError, match="memory_budget=1000 B is below the dense weights"):
        build_streaming_model(model_dir, StreamingConfig(memory_budget=1000))


def test_every_error_is_a_streaming_error():
    assert issubclass(PoolTooSmallError, StreamingError) and issubclass(ConfigMismatchError, StreamingError)
