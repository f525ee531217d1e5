"""What a careless new user does: nothing of theirs is lost, every mistake gets one line and no traceback,
corruption on disk is caught against the checksums taken when the checkpoint was written."""

import json
import shutil
import signal
import subprocess
import sys

import pytest

from mlx_streaming.residency.checksums import ExpertVerifyError
from mlx_streaming.checkpoint.manifest import MANIFEST_FILE
from mlx_streaming.checkpoint.output import MARKER_FILE
from mlx_streaming.harness.synth import synth_checkpoint
from mlx_streaming.config import StreamingConfig, format_size, parse_size
from mlx_streaming.errors import CheckpointError, OutputError
from mlx_streaming.model import build_streaming_model


def _cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "mlx_streaming", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout)


def _one_line_error(done, *needles):
    """Exit 2, no traceback, and one ``error:`` line that says each of ``needles``."""
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr + done.stdout
    errors = [line for line in done.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1, done.stderr
    for needle in needles:
        assert needle in errors[0], errors[0]
    return errors[0]


@pytest.fixture
def model_copy(tmp_path, model_dir):
    copy = tmp_path / "model"
    shutil.copytree(model_dir, copy)
    return copy


# ----------------------------------------------------------------------------- nothing lost

def _user_folder(tmp_path):
    folder = tmp_path / "mine"
    (folder / "sub").mkdir(parents=True)
    (folder / "notes.txt").write_text("my notes")
    (folder / "sub" / "keep.py").write_text("x = 1")
    return folder


def test_synth_refuses_a_folder_it_did_not_write_and_leaves_it_whole(tmp_path):
    folder = _user_folder(tmp_path)
    _one_line_error(_cli("synth", "--out", folder), str(folder), "not written by mlx-streaming")
    assert (folder / "notes.txt").read_text() == "my notes" and (folder / "sub" / "keep.py").read_text() == "x = 1"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]  # no partial output beside it


def test_synth_onto_a_regular_file_is_refused(tmp_path):
    target = tmp_path / "a-file"
    target.write_text("keep me")
    _one_line_error(_cli("synth", "--out", target), str(target), "is a file")
    assert target.read_text() == "keep me"


def test_synth_replaces_its_own_output_whole(tmp_path, tiny_synth):
    out = synth_checkpoint(tmp_path / "m", preset="tiny", seed=1)
    (out / "stale.bin").write_bytes(b"left over")
    synth_checkpoint(out, preset="tiny", seed=0)
    assert not (out / "stale.bin").exists() and (out / MARKER_FILE).exists()
    assert (out / "mtp.safetensors").read_bytes() == (tiny_synth["mlx"] / "mtp.safetensors").read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def test_synth_into_an_empty_folder_is_fine(tmp_path):
    (tmp_path / "empty").mkdir()
    assert (synth_checkpoint(tmp_path / "empty", preset="tiny") / "config.json").exists()


def test_repack_refuses_the_model_folder_and_replaces_its_own_output(model_copy, tmp_path):
    before = sorted(p.name for p in model_copy.iterdir())
    _one_line_error(_cli("repack", "--model", model_copy, "--out", model_copy), "not written by mlx-streaming")
    assert sorted(p.name for p in model_copy.iterdir()) == before
    packed = tmp_path / "packed"
    for _ in range(2):
        done = _cli("repack", "--model", model_copy, "--out", packed)
        assert done.returncode == 0, done.stderr
    assert "replaced" in done.stderr and (packed / MANIFEST_FILE).exists()


def test_extract_mtp_refuses_a_file_it_did_not_write(tmp_path, tiny_synth):
    target = tmp_path / "weights.safetensors"
    target.write_bytes(b"someone else's")
    _one_line_error(_cli("extract-mtp", "--hf", tiny_synth["hf"], "--out", target), str(target), "not written by")
    assert target.read_bytes() == b"someone else's"
    done = _cli("extract-mtp", "--hf", tiny_synth["hf"], "--out", tmp_path)
    _one_line_error(done, "is a folder")


def _interrupt(args):
    """SIGINT once the command has printed its first generated text (an event, not a clock: it is decoding)."""
    # an xdist worker ignores SIGINT and a child inherits that: give the command the default a terminal gives
    process = subprocess.Popen([sys.executable, "-m", "mlx_streaming", *map(str, args)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    first = process.stdout.read(1)
    assert first and process.poll() is None, "the command ended before it was interrupted"
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=120)
    return process.returncode, first + out + err


def test_ctrl_c_in_generate_exits_130_in_one_line():
    code, output = _interrupt(["generate", "--max-tokens", "500", "--prefetch", "--pool-slots", "8"])
    assert code == 130 and "Traceback" not in output and "interrupted" in output


# ----------------------------------------------------------------------------- corruption on disk

def _corrupt(path, offset, nbytes=4096):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(b"\xff" * nbytes)


def test_corruption_before_the_build_is_caught_against_the_manifest(model_copy):
    with build_streaming_model(model_copy, StreamingConfig(pool_slots=4)) as sm:
        target = sm.store.index.slices(2, 5)[0]  # layer 2, expert 5: gate_proj.weight
    _corrupt(target.path, target.offset, min(4096, target.nbytes))
    with build_streaming_model(model_copy, StreamingConfig(pool_slots=4, verify=True)) as sm:
        assert sm.store.verifier.from_manifest > 0
        sm.store.acquire(2, [4])  # an intact expert passes
        with pytest.raises(ExpertVerifyError, match=rf"layer 2 expert 5 tensor gate_proj.weight: .*{target.path.name}"
                                                    r".*checksum manifest"):
            sm.store.acquire(2, [5])
        assert sm.store.stats()["verify_bad"] == 1 and sm.store.stats()["verify_calls"] == 2


def test_without_a_manifest_corruption_before_the_build_is_not_seen(model_copy):
    """What disk-only verification can prove, and what it cannot: the README says so."""
    (model_copy / MANIFEST_FILE).unlink()
    with build_streaming_model(model_copy, StreamingConfig(pool_slots=4)) as sm:
        target = sm.store.index.slices(2, 5)[0]
    _corrupt(target.path, target.offset, min(4096, target.nbytes))
    with build_streaming_model(model_copy, StreamingConfig(pool_slots=4, verify=True)) as sm:
        sm.store.acquire(2, [5])
        stats = sm.store.stats()
    assert stats["verify_calls"] == 1 and stats["verify_bad"] == 0 and stats["verify_from_manifest"] == 0


def test_checksum_command_writes_a_manifest_then_guards_it(model_copy):
    (model_copy / MANIFEST_FILE).unlink()
    done = _cli("checksum", "--model", model_copy)
    assert done.returncode == 0, done.stderr
    manifest = json.loads((model_copy / MANIFEST_FILE).read_text())
    assert manifest["written_by"] == "mlx-streaming checksum" and "mtp.safetensors" in manifest["files"]
    _one_line_error(_cli("checksum", "--model", model_copy), "already there", "--replace")
    assert _cli("checksum", "--model", model_copy, "--replace").returncode == 0


def test_a_file_whose_size_changed_since_the_manifest_is_refused_at_build(model_copy):
    with open(model_copy / "mtp.safetensors", "ab") as f:
        f.write(b"\0" * 16)
    with pytest.raises(CheckpointError, match="mtp.safetensors: .*changed after it was checksummed"):
        build_streaming_model(model_copy, StreamingConfig(mtp=True, verify=True))


# ----------------------------------------------------------------------------- readable errors

def test_an_empty_prompt_is_one_line():
    _one_line_error(_cli("generate", "--prompt", ""), "--prompt is empty")


@pytest.mark.parametrize("args,needles", [
    (["--pool-bytes", "1K"], ["--pool-bytes 1.0 KB gives 0 expert slots", "at least 480.0 KB (8 MoE layers x 15.0 KB per expert)", "num_experts_per_tok=4"]),
    (["--memory-budget", "abc"], ["--memory-budget", "'abc' is not a size"]),
    (["--memory-budget", "4M"], ["--memory-budget 4.0 MB is below the dense weights"]),
    (["--pool-slots", "2", "--pool-bytes", "1G"], ["at most one pool size", "--pool-slots 2", "--pool-bytes"]),
])
def test_errors_name_the_flag_the_user_typed(args, needles):
    _one_line_error(_cli("generate", *args), *needles)


def test_a_bench_mode_with_processes_is_refused_up_front():
    _one_line_error(_cli("bench", "--sweep", "--processes", "2"), "--processes", "not allowed with", "--sweep")


def test_a_dense_model_names_its_model_type(tmp_path):
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    config = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
              "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "vocab_size": 256}
    mx.save_safetensors(str(tmp_path / "model.safetensors"),
                        dict(tree_flatten(llama.Model(llama.ModelArgs.from_dict(config)).parameters())))
    (tmp_path / "config.json").write_text(json.dumps(config))
    _one_line_error(_cli("generate", "--model", tmp_path), "model_type 'llama' has no routed experts", "SwitchGLU")


def test_a_folder_without_weights_says_so(model_copy):
    for shard in model_copy.glob("model*.safetensors*"):
        shard.unlink()
    _one_line_error(_cli("generate", "--model", model_copy), "no weights")


def test_the_pool_says_what_it_became_and_cuts_an_oversized_one(model_dir):
    experts = json.loads((model_dir / "config.json").read_text())["num_experts"]
    done = _cli("generate", "--max-tokens", "2", "--pool-slots", str(experts + 16))
    assert done.returncode == 0, done.stderr
    assert f"pool: {experts} of {experts} experts per MoE layer" in done.stderr
    assert f"--pool-slots {experts + 16}, more than the model has" in done.stderr
    done = _cli("generate", "--max-tokens", "2", "--pool-bytes", "1M")
    assert done.returncode == 0 and f"pool: 8 of {experts} experts per MoE layer" in done.stderr, done.stderr


def test_sizes_parse_and_print_in_binary_units():
    assert parse_size("1.5G") == 3 << 29 and parse_size("512M") == 512 << 20 and parse_size("2048") == 2048
    assert format_size(1024) == "1.0 KB" and format_size(3 << 29) == "1.50 GB" and format_size(12) == "12 B"
    with pytest.raises(ValueError, match="not a size"):
        parse_size("-1G")


def test_output_refusals_are_streaming_errors(tmp_path):
    folder = _user_folder(tmp_path)
    with pytest.raises(OutputError):
        synth_checkpoint(folder)


# ----------------------------------------------------------------------------- what the output says

def test_generate_reports_counters_with_what_they_cover_and_diagnostics():
    done = _cli("generate", "--max-tokens", "6", "--pool-slots", "12", "--prefetch", "--diagnostics", "--verify")
    assert done.returncode == 0, done.stderr
    assert "counters over the prompt's prefill and" in done.stderr
    assert "recall" in done.stderr and "B not predicted" in done.stderr and "demand reads" in done.stderr
    stats = json.loads(done.stderr.strip().splitlines()[-1])
    assert stats["prefetch_loads"] > 0 and stats["verify_calls"] > 0 and stats["verify_from_manifest"] > 0
    assert stats["bytes_read"] == stats["demand_bytes"] + stats["prefetch_bytes"] > stats["demand_bytes"]


def test_bench_prints_diagnostics_and_what_counters_cover():
    done = _cli("bench", "--max-tokens", "3", "--warmup", "0", "--repeat", "1", "--pool-slots", "12", "--prefetch",
                "--diagnostics")
    assert done.returncode == 0, done.stderr
    assert "hit rate, disk loads, MB read: the last timed run" in done.stdout and "recall" in done.stdout


def test_help_shows_defaults_version_and_only_the_options_a_command_takes():
    top = _cli("--help").stdout
    assert "evaluate" in top and "checksum" in top and "``" not in top
    assert _cli("--version").stdout.startswith("mlx-streaming ")
    bench = _cli("bench", "--help").stdout
    assert "--commit-mode" in bench and "--verify-mode" not in bench and "default 'def fibonacci(n):'" in bench
    evaluate = _cli("evaluate", "--help").stdout
    assert "--prompt " not in evaluate and "--max-tokens" not in evaluate and "(default 8)" in evaluate
    from mlx_streaming.cli import build_parser

    commands = next(a for a in build_parser()._actions if a.dest == "command").choices
    for name, command in commands.items():
        undocumented = [a.dest for a in command._actions if a.option_strings and not a.help]
        assert undocumented == [], name


@pytest.mark.parametrize("content,needle", [(None, "cannot read it"), ("{not json", "not valid JSON"),
                                            ('{"pools": {}}', "not a `bench --gate-power --json` file")])
def test_gate_power_replay_of_a_bad_file_says_which_and_why(tmp_path, content, needle):
    recorded = tmp_path / "pools.json"
    if content is not None:
        recorded.write_text(content)
    _one_line_error(_cli("bench", "--gate-power-replay", recorded), str(recorded), needle)
    assert content is None or recorded.read_text() == content  # the user's file is left as it was


@pytest.mark.parametrize("content,needle", [(None, "cannot read it"), ('{"benchmarks": []}', "not a perf suite baseline"),
                                            ("unit", "its costs are in wall_s_per_token")])
def test_gate_power_baseline_that_is_not_a_suite_baseline_says_which_and_why(tmp_path, content, needle):
    from mlx_streaming.harness.gate_power import SUITE_TESTS

    recorded = tmp_path / "pools.json"
    recorded.write_text(json.dumps({"unit": "cpu_s_per_token", "cost_per_token": {}, "tokens": 4, "baseline": {},
                                    "pools": {}}))
    baseline = tmp_path / "0001_baseline.json"
    if content == "unit":
        content = json.dumps({"benchmarks": [{"name": t, "extra_info": {"unit": "wall_s_per_token", "costs": [[1.0]],
                                                                         "yard_costs": [[1.0]]}}
                                             for t in SUITE_TESTS.values()]})
    if content is not None:
        baseline.write_text(content)
    done = _cli("bench", "--gate-power-replay", recorded, "--gate-power-baseline", baseline)
    _one_line_error(done, str(baseline), needle)
    assert content is None or baseline.read_text() == content  # the user's file is left as it was


def test_gate_power_baseline_without_a_replay_says_so(tmp_path):
    _one_line_error(_cli("bench", "--gate-power-baseline", tmp_path / "b.json"), "only with --gate-power-replay")
