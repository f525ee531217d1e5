"""extract-mtp on an original-layout checkpoint gives the head that synth writes in the MLX layout."""

import subprocess
import sys

import mlx.core as mx


def test_extracted_head_equals_the_mlx_layout_head(tmp_path, mtp_path):
    hf = tmp_path / "hf"
    out = tmp_path / "mtp.safetensors"
    for args in (["synth", "--preset", "tiny", "--seed", "0", "--layout", "hf", "--out", str(hf)],
                 ["extract-mtp", "--hf", str(hf), "--out", str(out)]):
        done = subprocess.run([sys.executable, "-m", "mlx_streaming", *args], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
    extracted, written = mx.load(str(out)), mx.load(str(mtp_path))
    assert sorted(extracted) == sorted(written)
    for name in written:
        assert extracted[name].dtype == written[name].dtype, name
        assert mx.array_equal(extracted[name], written[name]).item(), name
