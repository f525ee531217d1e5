"""extract-mtp on an original-layout checkpoint gives the head that synth writes in the MLX layout."""

import subprocess
import sys

import mlx.core as mx


def test_extracted_head_equals_the_mlx_layout_head(tmp_path, tiny_synth):
    hf = tmp_path / "hf"
    out = tmp_path / "mtp.safetensors"
    for args in (["synth", "--preset", "tiny", "--seed", "0", "--layout", "hf", "--out", str(hf)],
                 ["extract-mtp", "--hf", str(hf), "--out", str(out)]):
        done = subprocess.run([sys.executable, "-m", "mlx_streaming", *args], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
    extracted, written = mx.load(str(out)), mx.load(str(tiny_synth["mlx"] / "mtp.safetensors"))
    assert sorted(extracted) == sorted(written)
    for name in written:
        assert extracted[name].dtype == written[name].dtype, name
        assert mx.array_equal(extracted[name], written[name]).item(), name


def test_load_mtp_reads_bf16_and_quantized_files_alike(tmp_path, tiny_synth):
    """A bf16 MLX-layout head quantized on load equals the head written quantized; quantize=False keeps bf16.
    The zero-centred norms were turned into 1 + w exactly once."""
    import json

    from mlx.utils import tree_flatten
    from mlx_lm.models.qwen3_next import ModelArgs

    from mlx_streaming.checkpoint.mtp_extract import convert_mtp
    from mlx_streaming.mtp.load import load_mtp

    config = json.loads((tiny_synth["mlx"] / "config.json").read_text())
    hf, mtp_path = tiny_synth["hf"], tiny_synth["mlx"] / "mtp.safetensors"
    hf_mtp = {}
    for shard in hf.glob("model-*.safetensors"):
        hf_mtp.update({k: v for k, v in mx.load(str(shard)).items() if k.startswith("mtp.")})
    bf16_file = tmp_path / "mtp-bf16.safetensors"
    mx.save_safetensors(str(bf16_file), convert_mtp(hf_mtp, ModelArgs.from_dict(config), bits=None))

    quantized_on_load = dict(tree_flatten(load_mtp(config, bf16_file).parameters()))
    written = dict(tree_flatten(load_mtp(config, mtp_path).parameters()))
    assert sorted(quantized_on_load) == sorted(written)
    for name, value in written.items():
        assert mx.array_equal(quantized_on_load[name], value).item(), name

    kept = load_mtp(config, bf16_file, quantize=False)
    assert kept.fc.weight.dtype == mx.bfloat16 and "scales" not in kept.fc
    stored = hf_mtp["mtp.norm.weight"].astype(mx.float32)
    assert mx.allclose(kept.norm.weight.astype(mx.float32), stored + 1.0, atol=1e-2).item()
    assert abs(float(stored.mean())) < 0.1 and abs(float(kept.norm.weight.astype(mx.float32).mean()) - 1.0) < 0.1


def test_group_size_is_the_converters_option(tiny_synth):
    """``--q-group-size 32`` (what a model with 32-wide experts needs) quantizes the head in groups of 32, the
    router gates 8-bit in groups of 64, as ``mlx_lm.convert -q --q-group-size 32`` does the main model."""
    import json

    from mlx_lm.models.qwen3_next import ModelArgs

    from mlx_streaming.checkpoint.mtp_extract import convert_mtp

    config = json.loads((tiny_synth["mlx"] / "config.json").read_text())
    hf_mtp = {}
    for shard in tiny_synth["hf"].glob("model-*.safetensors"):
        hf_mtp.update({k: v for k, v in mx.load(str(shard)).items() if k.startswith("mtp.")})
    weights = convert_mtp(hf_mtp, ModelArgs.from_dict(config), bits=4, group_size=32)
    groups = {}
    for name, scales in weights.items():
        if name.endswith(".scales"):
            base = name.removesuffix(".scales")
            bits = 8 if base.endswith(("mlp.gate", "shared_expert_gate")) else 4
            groups[base] = (weights[f"{base}.weight"].shape[-1] * 32 // bits) // scales.shape[-1]
    assert groups and all(g == (64 if b.endswith(("mlp.gate", "shared_expert_gate")) else 32) for b, g in groups.items())
    assert any(b.endswith("switch_mlp.down_proj") for b in groups)
