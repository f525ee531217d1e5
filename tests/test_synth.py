"""Synthetic checkpoints: the public MLX layout, determinism, and a model that behaves."""

import json

import mlx.core as mx
import numpy as np

from mlx_streaming.checkpoint.safetensors import read_checkpoint_headers
from mlx_streaming.harness.synth import synth_checkpoint
from mlx_streaming.config import StreamingConfig
from mlx_streaming.generate import greedy_generate
from mlx_streaming.model import build_streaming_model
from mlx_streaming.harness.pytest_plugin import TEST_PROMPTS


def test_mlx_layout_files_and_config(tiny_synth):
    model_dir = tiny_synth["mlx"]
    names = sorted(p.name for p in model_dir.iterdir())
    shards = [n for n in names if n.startswith("model-") and n.endswith(".safetensors")]
    assert len(shards) >= 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert {"config.json", "model.safetensors.index.json", "mtp.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(names)
    config = json.loads((model_dir / "config.json").read_text())
    q = config["quantization"]
    assert config["model_type"] == "qwen3_next"
    assert (q["group_size"], q["bits"]) == (64, 4)
    assert q["model.layers.0.mlp.gate"] == {"group_size": 64, "bits": 8}
    assert q["model.layers.0.mlp.shared_expert_gate"] == {"group_size": 64, "bits": 8}
    size = sum(p.stat().st_size for p in model_dir.iterdir())
    assert size <= 30 << 20


def test_every_preset_mixes_deltanet_and_full_attention_and_has_a_shared_expert(reference_model):
    kinds = {layer.is_linear for layer in reference_model.layers}
    assert kinds == {True, False}
    assert all(hasattr(layer.mlp, "shared_expert") for layer in reference_model.layers)


def test_mtp_file_holds_the_head(mtp_path):
    names = set(mx.load(str(mtp_path)))
    for key in ("mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight",
                "mtp.layers.0.self_attn.q_proj.weight", "mtp.layers.0.mlp.switch_mlp.gate_proj.weight", "mtp.layers.0.mlp.gate.weight"):
        assert key in names, key


def test_same_seed_gives_byte_identical_files(tmp_path, tiny_synth):
    model_dir = tiny_synth["mlx"]
    again = synth_checkpoint(tmp_path / "again", preset="tiny", seed=0)
    for path in model_dir.iterdir():
        assert (again / path.name).read_bytes() == path.read_bytes(), path.name
    other = synth_checkpoint(tmp_path / "other", preset="tiny", seed=1)
    assert (other / "mtp.safetensors").read_bytes() != (model_dir / "mtp.safetensors").read_bytes()


def test_hf_layout_has_per_expert_keys_zero_centred_norms_and_mtp_in_the_shards(tiny_synth):
    out = tiny_synth["hf"]
    tensors = read_checkpoint_headers(out)
    assert "model.layers.0.mlp.experts.31.down_proj.weight" in tensors
    assert not any(".switch_mlp." in n for n in tensors)
    assert "mtp.fc.weight" in tensors and not (out / "mtp.safetensors").exists()
    assert all(t.dtype == "BF16" for t in tensors.values())
    weights = mx.load(str(tensors["model.norm.weight"].path))
    norm = np.array(weights["model.norm.weight"].astype(mx.float32))
    assert abs(norm.mean()) < 0.1 and norm.std() > 0.01  # stored as w, applied as 1 + w
    assert tensors["model.layers.0.linear_attn.conv1d.weight"].shape[1] == 1
    assert "quantization" not in json.loads((out / "config.json").read_text())


def test_synthetic_greedy_text_is_not_degenerate(tiny_synth):
    """Random weights, but not a model stuck on a few tokens: its routing and drafts exercise the engine."""
    from mlx_lm import load

    model, tokenizer = load(str(tiny_synth["mlx"]))
    for prompt in TEST_PROMPTS:
        out = greedy_generate(model, tokenizer.encode(prompt), 64)
        assert len(set(out)) >= 32, out


def test_routing_is_not_uniform(model_dir, prompt_ids):
    with build_streaming_model(model_dir, StreamingConfig(record=True)) as sm:
        for ids in prompt_ids:
            greedy_generate(sm.model, ids, 16)
        counts = np.stack([sm.store.routed_counts(layer) for layer in sm.store.recorded_layers()])
    share = np.sort(counts / counts.sum(axis=1, keepdims=True), axis=1)[:, ::-1]
    hottest_quarter = share[:, : counts.shape[1] // 4].sum(axis=1)
    # uniform routing would give the hottest quarter of the experts a quarter of the routes
    assert (hottest_quarter > 0.4).all(), hottest_quarter
