"""The memory cgroup: a hard limit the kernel enforces, the peak it charged, and the memory a process under a
limit may still take. Where no limit can be set here, the tests say why and skip."""

import sys

import pytest

from mlx_streaming import cgroup

MB = 1 << 20


def _limited(code: str, limit: int):
    try:
        return cgroup.limited_run([sys.executable, "-c", code], limit, timeout=120)
    except cgroup.LimitUnavailable as exc:
        pytest.skip(f"no hard memory limit here: {exc}")


def test_a_process_past_the_limit_is_killed_by_the_kernel_and_said_so():
    run = _limited(f"x = bytearray({300 * MB}); print('survived')", 200 * MB)
    assert run.returncode == -9 and run.killed_for_memory and "survived" not in run.stdout
    assert run.peak_bytes is not None and run.peak_bytes <= 200 * MB


def test_a_process_under_the_limit_runs_and_its_peak_is_measured():
    run = _limited(f"x = bytearray({100 * MB}); x[::4096] = b'1' * len(x[::4096]); print(len(x))", 200 * MB)
    assert run.returncode == 0 and not run.killed_for_memory and run.stdout.strip() == str(100 * MB)
    assert 100 * MB <= run.peak_bytes <= 200 * MB


def test_a_process_under_a_limit_sees_it_as_the_memory_it_may_take():
    run = _limited("from mlx_streaming import cgroup; print(cgroup.available_bytes())", 500 * MB)
    assert run.returncode == 0, run.stderr
    assert 300 * MB < int(run.stdout) <= 500 * MB


def test_no_memory_cgroup_is_said_in_one_line(monkeypatch):
    monkeypatch.setattr(cgroup, "_own_group", lambda: None)
    with pytest.raises(cgroup.LimitUnavailable, match="no memory cgroup here .*the machine's own memory is the limit"):
        cgroup.limited_run(["true"], 100 * MB)


def _cli(*args):
    import subprocess

    return subprocess.run([sys.executable, "-m", "mlx_streaming", *args], capture_output=True, text=True, timeout=120)


def test_the_limit_command_says_the_peak_and_passes_the_exit_status_on():
    killed = _cli("limit", "--memory", "200M", "--", sys.executable, "-c", f"x = bytearray({300 * MB})")
    if "no memory cgroup" in killed.stderr or "cannot create a memory cgroup" in killed.stderr:
        pytest.skip(killed.stderr.strip())
    assert killed.returncode == 137 and "killed by the kernel for memory" in killed.stderr
    ran = _cli("limit", "--memory", "300M", "--", sys.executable, "-c", "print('ran')")
    assert ran.returncode == 0 and ran.stdout == "ran\n"
    assert "peak" in ran.stderr and "under a 300.0 MB limit" in ran.stderr and "exit status 0" in ran.stderr


@pytest.mark.parametrize("args, said", [((), "give the command to run after --"),
                                         (("--", "no-such-command-here"), "no-such-command-here: no such command")])
def test_the_limit_command_refuses_in_one_line(args, said):
    done = _cli("limit", "--memory", "300M", *args)
    assert done.returncode == 2 and said in done.stderr and len(done.stderr.splitlines()) == 1
