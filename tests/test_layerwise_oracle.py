"""The layerwise oracle (harness/layerwise_oracle.py): mlx-lm's own model computed one part at a time from disk.

Exactness: its greedy ids, the logits they were taken from and their top-2 margins are mlx-lm's in-memory ones
bit for bit (no tolerance: the same mlx-lm modules run the same MLX ops on the same bytes, only evaluated in
more, smaller graphs, and on this backend no op's result depends on where a graph is cut). Memory: at most one
part's weights are materialized at a time, measured by MLX's own allocator (``mx.get_peak_memory``), and no
weight is ever materialized outside its part's load (each placeholder is probed).
"""

from __future__ import annotations

import gc
import json
import os
import time

import mlx.core as mx
import pytest

from mlx_streaming.errors import CheckpointError, UnsupportedModelError
from mlx_streaming.decode.greedy import greedy_steps, top2_margin
from mlx_streaming.harness.layerwise_oracle import SUPPORTED_MODEL_TYPES, LayerwiseOracle, greedy

TOKENS = 12
PROMPTS = (0, 1)


def _materialized_placeholders(oracle: LayerwiseOracle) -> list:
    """The tensors whose placeholder had been materialized: evaluating an unmaterialized lazy load allocates at
    least its bytes, evaluating a materialized array allocates nothing. Evaluates every placeholder, so the
    oracle is spent afterwards."""
    seen, found = set(), []
    for part in oracle.parts.values():
        for name, array in zip(part.names, part.placeholders):
            if id(array) in seen:
                continue
            seen.add(id(array))
            before = mx.get_active_memory()
            mx.eval(array)
            if mx.get_active_memory() - before < array.nbytes:
                found.append(name)
    return found


@pytest.mark.parametrize("prompt", PROMPTS)
def test_ids_logits_and_margins_equal_in_memory_greedy(model_dir, oracle, prompt_ids, prompt):
    steps = list(LayerwiseOracle(model_dir).steps(prompt_ids[prompt], TOKENS))
    assert [token for token, _ in steps] == oracle.ids(prompt, TOKENS)
    for step, ((_, logits), expected) in enumerate(zip(steps, oracle.logits(prompt, TOKENS))):
        assert logits.dtype == expected.dtype and logits.shape == expected.shape, step
        assert mx.array_equal(logits, expected).item(), f"step {step}: logits differ from mlx-lm's in-memory ones"
    assert [top2_margin(logits) for _, logits in steps] == oracle.margins(prompt, TOKENS)


def test_greedy_entry_point(model_dir, oracle, prompt_ids):
    ids, margins = greedy(model_dir, prompt_ids[0], TOKENS)
    assert ids == oracle.ids(0, TOKENS)
    assert margins == oracle.margins(0, TOKENS)
    assert all(gap >= 0 and top1 == token for (top1, _, gap, _), token in zip(margins, ids))


def test_one_part_materialized_at_a_time(model_dir, reference_model, prompt_ids, record_property):
    layerwise = LayerwiseOracle(model_dir)
    stats = layerwise.stats
    parts = stats.part_bytes
    assert sum(name.startswith("model.layers.") for name in parts) == 8
    assert {"model.embed_tokens", "model.norm", "lm_head"} <= set(parts)
    assert stats.model_bytes == sum(parts.values())

    gc.collect()
    baseline = mx.get_active_memory()  # what the session holds already (the in-memory reference model...)
    mx.reset_peak_memory()
    start = time.perf_counter()
    ids, _ = layerwise.greedy(prompt_ids[0], TOKENS)
    layerwise_s = time.perf_counter() - start
    peak = mx.get_peak_memory() - baseline
    start = time.perf_counter()
    in_memory_ids = [token for token, _ in greedy_steps(reference_model, prompt_ids[0], TOKENS)]
    in_memory_s = time.perf_counter() - start
    assert ids == in_memory_ids

    # the bookkeeping: one part at a time, every part read once per forward
    assert stats.max_materialized_bytes == stats.largest_part_bytes
    assert stats.forwards == TOKENS  # the prompt's one prefill forward, then one per further token
    assert stats.bytes_read == stats.forwards * stats.model_bytes
    # MLX's allocator: weights, activations, caches and logits together
    bound = 2 * stats.largest_part_bytes + parts["model.embed_tokens"] + parts["lm_head"]
    assert peak < bound, f"peak {peak} bytes above the bound {bound}"
    assert peak < stats.model_bytes / 4
    # and no weight was materialized outside its part's load
    assert _materialized_placeholders(layerwise) == []

    figures = {
        "model_bytes": stats.model_bytes, "largest_part_bytes": stats.largest_part_bytes,
        "max_materialized_bytes": stats.max_materialized_bytes, "peak_active_bytes_above_baseline": peak,
        "layerwise_ms_per_token": round(1e3 * layerwise_s / TOKENS, 1),
        "in_memory_ms_per_token": round(1e3 * in_memory_s / TOKENS, 1),
        "read_ms_per_token": round(1e3 * stats.read_seconds / TOKENS, 1),
    }
    record_property("layerwise_oracle", figures)
    print(f"\nlayerwise oracle: {figures}")


def test_the_placeholder_probe_sees_a_materialized_weight(model_dir):
    layerwise = LayerwiseOracle(model_dir)
    part = layerwise.parts["model.norm"]
    mx.eval(part.placeholders[0])
    assert _materialized_placeholders(layerwise) == ["model.norm.weight"]


# Other architectures: tiny checkpoints written by mlx-lm itself (harness/arch_synth.py). A few each run (tied
# embeddings through as_linear, a rotating sliding-window cache, MLA, a hybrid Mamba, Gated DeltaNet inside a
# VLM wrapper); every supported one with MLX_STREAMING_LAYERWISE_ALL_ARCHS=1.
SOME_ARCHS = ("gemma4_text", "afmoe", "deepseek_v3", "nemotron_h", "qwen3_5_moe")
ALL_ARCHS = os.environ.get("MLX_STREAMING_LAYERWISE_ALL_ARCHS") == "1"


@pytest.mark.parametrize("arch", [a for a in SUPPORTED_MODEL_TYPES if a != "qwen3_next"] if ALL_ARCHS else SOME_ARCHS)
def test_other_architectures_equal_in_memory(tmp_path, arch):
    from mlx_lm.utils import load_model

    from mlx_streaming.harness.arch_synth import synth_arch

    path = synth_arch(tmp_path / arch, arch)
    prompt = [3, 17, 99, 42, 7, 200, 5, 61, 12, 250, 33]
    in_memory, _ = load_model(path)
    expected = list(greedy_steps(in_memory, prompt, 8))
    layerwise = LayerwiseOracle(path)
    steps = list(layerwise.steps(prompt, 8))
    assert [t for t, _ in steps] == [t for t, _ in expected]
    assert all(mx.array_equal(a, b).item() for (_, a), (_, b) in zip(steps, expected))
    assert layerwise.stats.max_materialized_bytes == layerwise.stats.largest_part_bytes
    assert _materialized_placeholders(layerwise) == []


def _model_copy(model_dir, folder, skip=()):
    """``folder`` with links to the model's files but those in ``skip``."""
    folder.mkdir()
    for f in model_dir.iterdir():
        if f.name not in skip:
            (folder / f.name).symlink_to(f)
    return folder


def _one_line(exc_info) -> str:
    text = str(exc_info.value)
    assert "\n" not in text and len(text) < 400, text
    return text


def test_refuses_an_unsupported_model_type(model_dir, tmp_path):
    folder = _model_copy(model_dir, tmp_path / "m", skip=("config.json",))
    config = json.loads((model_dir / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    with pytest.raises(UnsupportedModelError) as exc:
        LayerwiseOracle(folder)
    assert "model_type 'llama'" in _one_line(exc)


def test_refuses_missing_files(model_dir, tmp_path):
    with pytest.raises(CheckpointError) as exc:
        LayerwiseOracle(tmp_path / "nowhere")
    assert "config.json: missing" in _one_line(exc)
    folder = _model_copy(model_dir, tmp_path / "m", skip=("model.safetensors",))
    with pytest.raises(CheckpointError) as exc:
        LayerwiseOracle(folder)
    assert "model.safetensors: shard named in model.safetensors.index.json is missing" in _one_line(exc)


def test_refuses_a_missing_tensor(model_dir, tmp_path):
    folder = _model_copy(model_dir, tmp_path / "m", skip=("model.safetensors", "model.safetensors.index.json"))
    weights = mx.load(str(model_dir / "model.safetensors"))
    del weights["model.layers.5.post_attention_layernorm.weight"]
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    with pytest.raises(CheckpointError) as exc:
        LayerwiseOracle(folder)
    assert "model.layers.5.post_attention_layernorm.weight" in _one_line(exc)
