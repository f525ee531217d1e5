"""The embedded default model against its training run: it is the real architecture, trained, and our
conversion and engine reproduce what PyTorch measured."""

import json

from mlx_lm import load

from mlx_streaming.config import StreamingConfig
from mlx_streaming.defaults import default_model
from mlx_streaming.harness.evaluate import heldout_loss, heldout_sequences, mtp_acceptance, pytorch_losses, training_report
from mlx_streaming.decode.greedy import greedy_generate
from mlx_streaming.model import build_streaming_model

MODEL = default_model()


def test_it_is_the_trained_qwen3_next_in_the_public_mlx_layout():
    config = json.loads((MODEL / "config.json").read_text())
    assert config["model_type"] == "qwen3_next" and config["num_experts"] >= 128
    assert config["num_experts_per_tok"] / config["num_experts"] <= 0.04  # Qwen3-Next-80B: 10 of 512
    assert config["layer_types"][:4] == ["linear_attention"] * 3 + ["full_attention"]
    assert config["norm_topk_prob"] and config["shared_expert_intermediate_size"] > 0
    assert (config["quantization"]["group_size"], config["quantization"]["bits"]) == (32, 4)
    assert config["quantization"]["model.layers.0.mlp.gate"]["bits"] == 8
    assert sum(p.stat().st_size for p in MODEL.iterdir()) <= 25 << 20
    report = training_report(MODEL)
    assert report["epochs"] >= 1 and report["heldout"]["loss_bf16"] < 3.0  # far below ln(4096) = 8.3
    assert min(report["expert_usage"]["min_share"]) > 0  # every expert of every layer is routed to


def test_heldout_loss_in_mlx_is_within_3_percent_of_pytorch():
    """4-bit MLX against the bf16 PyTorch checkpoint on the same held-out sequences (two of them: about 25 s
    each on this CPU backend). `mlx-streaming evaluate` runs more."""
    n = 2
    model, _ = load(str(MODEL))
    mlx_loss = heldout_loss(model, heldout_sequences(MODEL)[:n])
    torch_loss = sum(pytorch_losses(MODEL)[:n]) / n
    assert abs(mlx_loss - torch_loss) / torch_loss < 0.03, (mlx_loss, torch_loss)


def test_engine_mtp_acceptance_is_close_to_pytorchs():
    """Accepted drafts per verify step at K=3 on held-out prompts, against the training script's figure."""
    prompts = heldout_sequences(MODEL)[:4, :64].tolist()
    with build_streaming_model(MODEL, StreamingConfig(pool_fraction=0.25, mtp=True)) as sm:
        engine = mtp_acceptance(sm, prompts, 48, ks=(3,))["3"]
    torch = training_report(MODEL)["mtp_accept_bf16"]["avg_accepted_drafts"]["3"]
    assert abs(engine - torch) / torch < 0.25, (engine, torch)


def test_it_writes_python():
    model, tokenizer = load(str(MODEL))
    text = tokenizer.decode(greedy_generate(model, tokenizer.encode("import os\n\n\ndef "), 24))
    assert "(" in text and ":" in text, text
