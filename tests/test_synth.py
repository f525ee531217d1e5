"""Synthetic checkpoints: the public MLX layout, determinism, and a model that behaves."""

import json

import mlx.core as mx
import numpy as np

from mlx_streaming.checkpoint.safetensors import read_checkpoint_headers
from mlx_streaming.harness.synth import synth_checkpoint
from mlx_streaming.config import StreamingConfig
from mlx_streaming.decode.greedy import greedy_generate
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
        counts = np.stack([sm.store.routed.of(layer) for layer in sm.store.routed.layers()])
    share = np.sort(counts / counts.sum(axis=1, keepdims=True), axis=1)[:, ::-1]
    hottest_quarter = share[:, : counts.shape[1] // 4].sum(axis=1)
    # uniform routing would give the hottest quarter of the experts a quarter of the routes
    assert (hottest_quarter > 0.4).all(), hottest_quarter


# ----------------------------------------------------------------------------- qwen3-next-80b, streamed

import signal
import subprocess
import sys
import threading
import tracemalloc

import pytest

from mlx_streaming.errors import ConfigError
from mlx_streaming.harness import synth_plan, synth_values
from mlx_streaming.harness.synth import STARTED, preset_config
from mlx_streaming.harness.synth_plan import plan_checkpoint
from mlx_streaming.harness.synth_stream import write_checkpoint
from mlx_streaming.harness.synth_values import tensor_blocks

#: A few layers of Qwen3-Next at a reduced width, for what must write in a test's time.
NARROW = dict(hidden_size=256, num_experts=64, num_experts_per_tok=8, moe_intermediate_size=256,
              shared_expert_intermediate_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
              head_dim=64, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=64,
              linear_value_head_dim=64, vocab_size=4096)


def _cli(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "mlx_streaming", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout)


def test_qwen3_next_80b_plan_is_the_published_model_at_about_45_gb():
    """From shapes alone (nothing written): the published config, mlx-lm's names and shapes, 4-bit group 64 with
    8-bit routers, shards as mlx_lm.convert cuts them, and the size of the public 4-bit conversion."""
    config = preset_config("qwen3-next-80b")
    published = dict(model_type="qwen3_next", num_hidden_layers=48, full_attention_interval=4, hidden_size=2048,
                     num_experts=512, num_experts_per_tok=10, moe_intermediate_size=512,
                     shared_expert_intermediate_size=512, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
                     linear_num_value_heads=32, linear_num_key_heads=16, linear_key_head_dim=128,
                     linear_value_head_dim=128, linear_conv_kernel_dim=4, vocab_size=151936, intermediate_size=5120,
                     rope_theta=10000000, partial_rotary_factor=0.25, max_position_embeddings=262144,
                     norm_topk_prob=True, mtp_num_hidden_layers=1, tie_word_embeddings=False)
    assert {k: config[k] for k in published} == published
    assert config["layer_types"].count("full_attention") == 12 and config["layer_types"][3] == "full_attention"
    plan = plan_checkpoint(config)
    assert plan.shards == [f"model-{i:05d}-of-00009.safetensors" for i in range(1, 10)]
    assert all(sum(s.nbytes for s in plan.files[n]) <= 5 << 30 for n in plan.shards)
    main = sum(s.nbytes for n in plan.shards for s in plan.files[n])
    assert 44.5e9 < main < 45.2e9 and 0.8e9 < plan.total_bytes - main < 1.0e9  # the MTP head: one more MoE layer
    q = plan.config["quantization"]
    assert (q["group_size"], q["bits"], q["mode"]) == (64, 4, "affine")
    assert all(q[f"model.layers.{i}.mlp.{g}"] == {"group_size": 64, "bits": 8}
               for i in range(48) for g in ("gate", "shared_expert_gate"))
    t = plan.tensor
    assert t("model.layers.47.mlp.switch_mlp.down_proj.weight").shape == (512, 2048, 64)
    assert t("model.layers.47.mlp.switch_mlp.gate_proj.scales").shape == (512, 512, 32)
    assert t("model.layers.0.mlp.gate.weight").shape == (512, 512)  # 8-bit: 4 values a word
    assert t("model.layers.3.self_attn.q_proj.weight").shape == (8192, 256)  # 16 heads x 256 x 2 (gate)
    assert t("model.layers.0.linear_attn.in_proj_qkvz.weight").shape == (12288, 256)
    assert t("model.layers.0.linear_attn.conv1d.weight").shape == (8192, 4, 1)
    assert t("model.embed_tokens.weight").shape == (151936, 256) and t("lm_head.scales").dtype == "BF16"
    assert t("mtp.layers.0.mlp.switch_mlp.up_proj.weight").shape == (512, 512, 256)
    # --layers keeps every per-layer shape
    four = plan_checkpoint(preset_config("qwen3-next-80b", layers=4))
    assert four.shards == ["model.safetensors"]  # under 5 GB: one file, as mlx_lm.convert names it
    assert {s.name: s for s in four.files["model.safetensors"]} == \
        {s.name: s for n in plan.shards for s in plan.files[n]
         if not s.name.startswith("model.layers.") or int(s.name.split(".")[2]) < 4}


def test_layers_without_a_full_attention_layer_are_refused_in_one_line(tmp_path):
    done = _cli("synth", "--preset", "qwen3-next-80b", "--layers", "3", "--out", tmp_path / "m")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "--layers 3" in errors[0] and "full attention" in errors[0], done.stderr
    assert not (tmp_path / "m").exists()
    for preset in ("qwen3-next-80b", "tiny"):
        with pytest.raises(ConfigError, match="--layers 1"):
            preset_config(preset, layers=1)
    with pytest.raises(ConfigError, match="only the mlx layout"):
        from mlx_streaming.harness.synth import synth_checkpoint

        synth_checkpoint(tmp_path / "hf", preset="qwen3-next-80b", layout="hf")
    assert not (tmp_path / "hf").exists()


def test_blocks_are_deterministic_and_dequantize_to_zero_mean_and_the_planned_spread():
    plan = plan_checkpoint(preset_config("qwen3-next-80b", layers=4))
    base = "model.layers.0.mlp.switch_mlp.up_proj"
    first = [next(tensor_blocks(plan.tensor(f"{base}.{p}"), 0)) for p in ("weight", "scales", "biases")]
    again = [next(tensor_blocks(plan.tensor(f"{base}.{p}"), 0)) for p in ("weight", "scales", "biases")]
    assert all((a == b).all() for a, b in zip(first, again))
    assert (next(tensor_blocks(plan.tensor(f"{base}.weight"), 1)) != first[0]).any()
    rows = len(first[0])  # a block of weights holds fewer experts than one of scales
    words, scales, biases = (mx.array(a[:rows]) for a in first)
    w = mx.dequantize(words, scales.view(mx.bfloat16), biases.view(mx.bfloat16), 64, 4)
    w = np.array(w.astype(mx.float32))
    assert abs(w.mean()) < 1e-3 and abs(w.std() * np.sqrt(2048) - 1) < 0.05


def test_streamed_writer_holds_a_few_blocks_and_writes_a_model_mlx_lm_runs(tmp_path):
    """tracemalloc sees every numpy buffer the writer draws: its peak stays near a few 4 MB blocks however big
    the layers are, and mlx-lm loads the result and gives finite, varied logits; the routers prefer some experts."""
    from mlx_lm import load

    config = synth_plan.sized_config({**NARROW, "num_experts": 512}, layers=4)  # big layers, cheap tokens
    out = tmp_path / "narrow"
    out.mkdir()
    plan = plan_checkpoint(config)
    layer = sum(s.nbytes for s in plan.files["model.safetensors"] if s.name.startswith("model.layers.0."))
    tracemalloc.start()
    try:
        stats = write_checkpoint(out, config, seed=0, manifest=False)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert plan.total_bytes < stats.bytes < plan.total_bytes + (1 << 20)  # the headers
    assert plan.total_bytes > 4 * layer > 50 << 20
    print(f"tracemalloc peak {peak / 2**20:.1f} MiB, one layer {layer / 2**20:.1f} MiB")
    assert peak < min(layer, 8 * synth_values.BLOCK_BYTES), (peak, layer)

    model, tokenizer = load(str(out))
    logits = np.array(model(mx.array([tokenizer.encode("def fibonacci(n):")]))[0].astype(mx.float32))
    assert np.isfinite(logits).all() and len(set(logits.argmax(-1))) >= 15  # of 17 positions
    gate = model.model.layers[0].mlp.gate
    rows = np.array(mx.dequantize(gate.weight, gate.scales, gate.biases, 64, 8).astype(mx.float32))
    norms = np.linalg.norm(rows, axis=1)
    hot = synth_values.popularity(0, "model.layers.0.mlp.gate", len(norms))
    assert np.corrcoef(norms, hot)[0, 1] > 0.9 and norms.max() / norms.min() > 1.5


def test_float32_variant_stores_what_is_not_packed_as_float32_and_streams_exactly(tmp_path):
    """``--dtype float32`` (for MLX's CPU backend): the same packed weights, scales, biases and norms in float32;
    mlx-lm computes in float32 and the streaming model at a small pool gives its greedy ids."""
    from mlx_lm import load

    config = synth_plan.sized_config({**NARROW, "num_experts": 512}, layers=4, dtype="float32")
    out = tmp_path / "narrow32"
    out.mkdir()
    write_checkpoint(out, config, seed=0)
    plan = plan_checkpoint(config)
    dtypes = {s.name.rpartition(".")[2]: s.dtype for s in plan.files["model.safetensors"] if s.is_expert}
    assert dtypes == {"weight": "U32", "scales": "F32", "biases": "F32"}
    assert {t.dtype for t in read_checkpoint_headers(out).values()} == {"U32", "F32"}
    model, tokenizer = load(str(out))
    prompt = tokenizer.encode("def fibonacci(n):")
    assert model(mx.array([prompt])).dtype == mx.float32
    expected = greedy_generate(model, prompt, 8)
    with build_streaming_model(out, StreamingConfig(pool_slots=16)) as sm:
        assert greedy_generate(sm.model, prompt, 8) == expected and sm.store.stats()["misses"] > 0
    done = _cli("synth", "--preset", "small", "--dtype", "float32", "--out", tmp_path / "s")
    errors = [line for line in done.stderr.splitlines() if "error:" in line]
    assert done.returncode == 2 and len(errors) == 1 and "--dtype float32" in errors[0], done.stderr
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize("args", [["--preset", "small"], ["--preset", "qwen3-next-80b", "--layers", "4"]],
                         ids=["small", "qwen3-next-80b"])
def test_ctrl_c_in_synth_exits_130_in_one_line_and_leaves_nothing_half_written(tmp_path, args):
    """SIGINT once synth says it has begun writing (an event, not a clock: the write cannot finish first)."""
    # an xdist worker ignores SIGINT and a child inherits that: give the command the default a terminal gives
    process = subprocess.Popen([sys.executable, "-m", "mlx_streaming", "synth", *args, "--out", str(tmp_path / "m")],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    lines, started = [], threading.Event()

    def read_stderr():
        for line in process.stderr:
            lines.append(line)
            if line.startswith(STARTED):
                started.set()

    reader = threading.Thread(target=read_stderr, daemon=True)
    reader.start()
    try:
        assert started.wait(120), "".join(lines)
        assert process.poll() is None, "".join(lines)  # still writing
        process.send_signal(signal.SIGINT)
        out = process.stdout.read()
        code = process.wait(timeout=120)
    finally:
        process.kill()
    reader.join(timeout=10)
    output = out + "".join(lines)
    assert code == 130 and "Traceback" not in output and "interrupted" in output, output
    assert list(tmp_path.iterdir()) == []
