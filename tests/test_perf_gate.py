"""The perf gate bites: a planted regression fails with the right message, an improvement passes.

The end-to-end test runs a real perf scenario under pytest (a subprocess, single process as pytest-benchmark
needs) against a baseline file that holds the same run with its numbers planted."""

import json
import os
import subprocess
import sys

import pytest

from mlx_streaming import perf_gate

BASE = {"spec": {"tok_s": 10.0, "speedup": 1.5, "disk_load_ratio": 1.2, "disk_loads": 100, "hits": 50, "accepted_drafts": 7, "steps": 9}}


def _with(**changes):
    return {"spec": {**BASE["spec"], **changes}}


def test_unchanged_run_passes():
    assert perf_gate.check(BASE, BASE, same_machine=True) == []


def test_any_counter_change_fails_even_an_improvement():
    (v,) = perf_gate.check(_with(disk_loads=99), BASE, same_machine=False)
    assert (v.metric, v.rule) == ("disk_loads", "deterministic counter moved")


def test_ratio_falls_and_disk_load_ratio_rises_beyond_tolerance():
    got = perf_gate.check(_with(speedup=1.2, disk_load_ratio=1.5), BASE, same_machine=False, ratio_tolerance=0.1)
    assert {(v.metric, v.rule) for v in got} == {("speedup", "ratio fell by more than 10%"), ("disk_load_ratio", "ratio rose by more than 10%")}
    assert perf_gate.check(_with(speedup=1.4, disk_load_ratio=1.25), BASE, same_machine=False, ratio_tolerance=0.1) == []
    assert perf_gate.check(_with(speedup=3.0, disk_load_ratio=0.5), BASE, same_machine=False) == []  # improvements pass


def test_absolute_toks_only_on_the_same_machine_profile():
    slow = _with(tok_s=5.0)
    assert perf_gate.check(slow, BASE, same_machine=False) == []
    (v,) = perf_gate.check(slow, BASE, same_machine=True, toks_tolerance=0.2)
    assert v.metric == "tok_s" and "same machine profile" in v.rule
    assert "PERF" not in perf_gate.report([v]) and "tok_s" in perf_gate.report([v])


def test_machine_profile_ignores_what_does_not_matter():
    a = {"cpu": {"brand_raw": "X", "count": 2}, "system": "Linux", "mlx_version": "0.32.4", "node": "host-a"}
    b = {**a, "node": "host-b"}
    assert perf_gate.machine_profile(a) == perf_gate.machine_profile(b)
    assert perf_gate.machine_profile(a) != perf_gate.machine_profile({**a, "mlx_version": "0.33.0"})


def _run_perf(root, tmp_path, *extra):
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-m", "perf", "-p", "no:xdist", "-q", "perf/test_perf.py::test_speculative_k3",
         "--perf-max-tokens", "6", "--perf-repeat", "1", f"--benchmark-storage=file://{tmp_path}", *extra],
        capture_output=True, text=True, timeout=600, cwd=root,
        # inside an xdist worker: pytest-benchmark would see the worker's variables and disable itself
        env={k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")},
    )


def _plant(path, **changes):
    data = json.loads(path.read_text())
    data["benchmarks"][0]["extra_info"].update(changes)
    path.write_text(json.dumps(data))


def test_gate_fails_a_planted_regression_and_passes_an_improvement(tmp_path, pytestconfig):
    root = pytestconfig.rootpath
    recorded = _run_perf(root, tmp_path, "--benchmark-save=base")
    assert recorded.returncode == 0, recorded.stdout + recorded.stderr
    (saved,) = tmp_path.rglob("*_base.json")
    info = json.loads(saved.read_text())["benchmarks"][0]["extra_info"]

    # planted: the baseline read less from disk and sped up more, so this run looks like a regression
    _plant(saved, disk_loads=info["disk_loads"] - 1, speedup=info["speedup"] * 10, tok_s=info["tok_s"] * 100)
    regressed = _run_perf(root, tmp_path, "--benchmark-compare=0001")
    assert regressed.returncode == 1, regressed.stdout
    assert "PERF GATE FAILED" in regressed.stdout
    for rule in ("disk_loads", "deterministic counter moved", "speedup", "ratio fell by more than 35%", "tok/s fell by more than 30%"):
        assert rule in regressed.stdout, rule

    # planted: the baseline was slower with a lower speedup, so this run is an improvement
    _plant(saved, disk_loads=info["disk_loads"], speedup=info["speedup"] / 10, tok_s=info["tok_s"] / 100)
    improved = _run_perf(root, tmp_path, "--benchmark-compare=0001")
    assert improved.returncode == 0, improved.stdout
    assert "perf gate passed" in improved.stdout


def test_perf_run_under_xdist_says_so_instead_of_recording_nothing(pytestconfig):
    done = subprocess.run([sys.executable, "-m", "pytest", "-m", "perf", "-n", "2", "-q", "perf"], capture_output=True,
                          text=True, timeout=300, cwd=pytestconfig.rootpath,
                          env={k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")})
    assert done.returncode == pytest.ExitCode.USAGE_ERROR
    assert "perf tests need a single process" in done.stderr
