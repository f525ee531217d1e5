"""The installed plugin acts only on runs that ask for it: in a foreign project with its own ``perf`` marker it
deselects nothing, refuses nothing and prints nothing; in this project it reads ``-m`` with pytest's parser."""

import os
import subprocess
import sys

import pytest

FOREIGN_TESTS = """
import pytest

def test_plain():
    pass

@pytest.mark.perf
def test_their_own_perf():
    pass
"""


def _pytest(cwd, *args):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    return subprocess.run([sys.executable, "-m", "pytest", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300, env=env)


@pytest.fixture
def foreign_project(tmp_path):
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    perf: this project's own perf tests\n")
    (tmp_path / "test_theirs.py").write_text(FOREIGN_TESTS)
    return tmp_path


@pytest.mark.parametrize("args", [(), ("-m", "not perf", "-n", "2"), ("-m", "perf")])
def test_a_foreign_project_runs_as_if_the_plugin_were_not_there(foreign_project, args):
    with_plugin = _pytest(foreign_project, "-p", "no:cacheprovider", *args)
    without = _pytest(foreign_project, "-p", "no:cacheprovider", "-p", "no:mlx_streaming", *args)
    assert with_plugin.returncode == without.returncode == 0, with_plugin.stdout + with_plugin.stderr
    summary = [line for line in with_plugin.stdout.splitlines() if " passed" in line]
    assert summary and summary[-1].split(" in ")[0] == [
        line for line in without.stdout.splitlines() if " passed" in line][-1].split(" in ")[0]
    said = [line for line in (with_plugin.stdout + with_plugin.stderr).splitlines()
            if not line.startswith("plugins:")]  # pytest's header lists every installed plugin
    assert not [line for line in said if "mlx-streaming" in line or "mlx_streaming" in line]
    if not args:
        assert "2 passed" in summary[-1] and "deselected" not in summary[-1]


def test_not_perf_under_xdist_runs_here(pytestconfig):
    done = _pytest(pytestconfig.rootpath, "-m", "not perf", "-n", "2", "--collect-only", "-q", "tests/test_triage.py")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "perf tests need a single process" not in done.stdout + done.stderr


def test_an_option_value_pytest_takes_for_its_rootdir_is_said_in_one_line(pytestconfig, tmp_path):
    """pytest picks its root directory before installed plugins' options are known, so the value of
    ``--streaming-model DIR`` looks like a path to it: the project's configuration would go unread."""
    model = tmp_path / "model"
    model.mkdir()
    spaced = _pytest(pytestconfig.rootpath, "--co", "-q", "-m", "exact", "--streaming-model", str(model))
    assert spaced.returncode == pytest.ExitCode.USAGE_ERROR
    assert f"write --streaming-model={model}" in spaced.stderr
    joined = _pytest(pytestconfig.rootpath, "--co", "-q", "-m", "exact", f"--streaming-model={model}")
    assert joined.returncode == 0, joined.stdout + joined.stderr


@pytest.mark.parametrize("tokens", ["8", "65"])
def test_exact_tokens_out_of_range_is_said_in_one_line(pytestconfig, tokens):
    done = _pytest(pytestconfig.rootpath, "--co", "-q", "-m", "exact", f"--streaming-exact-tokens={tokens}")
    assert done.returncode == pytest.ExitCode.USAGE_ERROR
    assert f"--streaming-exact-tokens={tokens}: give 16 to 64" in done.stderr and "Traceback" not in done.stderr
