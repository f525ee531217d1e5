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


# ----------------------------------------------------------------------------- the command line, before any work
#
# Every case runs the console script's main() in this process: exit status 2, exactly one line on stderr that
# names the option or file, nothing on stdout (no memory plan: nothing was loaded), no file written, in seconds.

import socket
import time

from mlx_streaming import cli


def _refused(capsys, tmp_path, args, *needles):
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    start = time.perf_counter()
    try:
        code = cli.main([str(a) for a in args])
    except SystemExit as exc:  # argparse's own refusals
        code = exc.code
    seconds = time.perf_counter() - start
    out, err = capsys.readouterr()
    assert code == 2, err
    lines = err.splitlines()
    assert len(lines) == 1 and "error:" in lines[0] and "Traceback" not in err, err
    for needle in needles:
        assert str(needle) in lines[0], lines[0]
    assert out == ""
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before  # nothing written
    assert seconds < 10, seconds


@pytest.fixture(autouse=True)
def _no_settings_in_the_environment(monkeypatch):
    import os

    for name in [n for n in os.environ if n.startswith("MLX_STREAMING_") or n == "STG_VERIFY"]:
        monkeypatch.delenv(name)


@pytest.fixture
def a_file(tmp_path):
    path = tmp_path / "a-file"
    path.write_text("not a model")
    return path


@pytest.mark.parametrize("args,needles", [
    (["generate", "--model", "{file}"], ["--model {file}", "is a file, not a folder"]),
    (["bench", "--model", "{tmp}/nowhere"], ["--model {tmp}/nowhere", "no such folder"]),
    (["generate", "--packed", "{file}"], ["--packed {file}", "is a file"]),
    (["plan", "--trace", "{tmp}"], ["--trace {tmp}", "is a folder, not a file"]),
    (["extract-mtp", "--hf", "{file}", "--out", "{tmp}/mtp.safetensors"], ["--hf {file}", "is a file"]),
    (["bench", "--gate-power-replay", "{tmp}"], ["--gate-power-replay {tmp}", "is a folder"]),
])
def test_a_path_of_the_wrong_kind_is_refused(capsys, tmp_path, a_file, args, needles):
    fill = {"file": a_file, "tmp": tmp_path}
    _refused(capsys, tmp_path, [a.format(**fill) for a in args], *(n.format(**fill) for n in needles))


def test_a_checkpoint_file_that_is_a_folder_is_refused(capsys, broken, tmp_path):
    (broken / "mtp.safetensors").unlink()
    (broken / "mtp.safetensors").mkdir()
    _refused(capsys, tmp_path, ["bench", "--model", broken], f"--model {broken}", "mtp.safetensors is a folder")


@pytest.mark.parametrize("args,needles", [
    (["bench", "--json", "{tmp}/missing/result.json"], ["--json {tmp}/missing/result.json", "does not exist"]),
    (["bench", "--json", "{tmp}"], ["--json {tmp}", "is a folder"]),
    (["bench", "--dump-ids", "{tmp}/missing/ids.json"], ["--dump-ids", "does not exist"]),
    (["bench", "--sweep", "--dump-ids", "{tmp}/ids.json"], ["--dump-ids", "only in the default benchmark"]),
    (["generate", "--record-trace", "{tmp}/missing/trace.json"], ["--record-trace", "does not exist"]),
    (["evaluate", "--json", "{tmp}/missing/eval.json"], ["--json", "does not exist"]),
    (["plan", "--json", "{tmp}/curve.json"], ["--json", "only with --trace"]),
    (["plan", "--trace", "{file}", "--plot", "{tmp}/missing/curve.png"], ["--plot", "does not exist"]),
    (["synth", "--out", "{file}/model"], ["--out", "is a file, not a folder"]),
    (["extract-mtp", "--hf", "{tmp}", "--out", "{tmp}"], ["--out", "is a folder"]),
])
def test_an_output_that_cannot_be_written_is_refused_before_the_work(capsys, tmp_path, a_file, args, needles):
    fill = {"file": a_file, "tmp": tmp_path}
    _refused(capsys, tmp_path, [a.format(**fill) for a in args], *(n.format(**fill) for n in needles))


@pytest.mark.parametrize("args,needles", [
    (["bench", "--k", "1000"], ["--k must be auto or 1 to 16", "1000"]),
    (["bench", "--k", "0"], ["--k must be auto or 1 to 16"]),
    (["bench", "--k", "many"], ["--k", "'many'"]),
    (["bench", "--max-tokens", "0"], ["--max-tokens must be positive"]),
    (["generate", "--max-tokens", "100000"], ["--max-tokens 100000", "max_position_embeddings=4096"]),
    (["bench", "--repeat", "0"], ["--repeat must be positive"]),
    (["bench", "--warmup", "-1"], ["--warmup must not be negative"]),
    (["bench", "--processes", "0"], ["--processes 0", "at least 1"]),
    (["bench", "--pin-hot", "200"], ["--pin-hot 200", "at most 28"]),
    (["bench", "--prefetch", "--mult", "1000"], ["--mult 1000", "at most 32"]),
    (["generate", "--pool-fraction", "1.5"], ["--pool-fraction must be in (0, 1]"]),
    (["generate", "--pool-slots", "0"], ["--pool-slots must be positive"]),
    (["generate", "--read-threads", "0"], ["--read-threads must be at least 1", "got 0"]),
    (["generate", "--memory-budget", "1000T"], ["--memory-budget", "more than this machine's memory"]),
    (["chat", "--temp", "-1"], ["--temp -1.0"]),
    (["serve", "--top-p", "0"], ["--top-p 0.0"]),
    (["evaluate", "--prompts", "1000"], ["--prompts 1000", "held-out sequences"]),
    (["evaluate", "--loss-sequences", "0"], ["--loss-sequences 0", "at least 1"]),
    (["synth", "--seed", "-1", "--out", "{tmp}/m"], ["--seed -1"]),
    (["plan", "--trace", "{file}", "--disk-gbps", "0"], ["--disk-gbps 0.0"]),
])
def test_a_number_the_model_or_machine_does_not_allow_is_refused(capsys, tmp_path, a_file, args, needles):
    fill = {"file": a_file, "tmp": tmp_path}
    _refused(capsys, tmp_path, [a.format(**fill) for a in args], *needles)


@pytest.mark.parametrize("args,needles", [
    (["--port", "0"], ["--port 0", "1 to 65535"]),
    (["--port", "70000"], ["--port 70000", "1 to 65535"]),
    (["--port", "-5"], ["--port -5"]),
    (["--host", "no-such-host.invalid"], ["--host no-such-host.invalid"]),
    (["--host", "192.0.2.1"], ["--host 192.0.2.1", "cannot listen there"]),  # TEST-NET-1: not this machine's
])
def test_serve_refuses_an_address_it_cannot_listen_on_before_loading(capsys, tmp_path, args, needles):
    _refused(capsys, tmp_path, ["serve", *args], *needles)


def test_serve_refuses_a_port_in_use_before_loading(capsys, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        _refused(capsys, tmp_path, ["serve", "--host", "127.0.0.1", "--port", port], f"--port {port}",
                 "cannot listen there")
