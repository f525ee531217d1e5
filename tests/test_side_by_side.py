"""The side-by-side gate's base revision: each refusal in one line, the export untouched by uncommitted changes,
nothing left behind (Ctrl-C included), and the base engine measuring the suite's scenarios in its worker."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from mlx_streaming.harness import side_by_side
from mlx_streaming.harness.side_by_side import BaseEngine, BaseUnavailable


def _git(repo, *args):
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True)


@pytest.fixture
def tiny_repo(tmp_path, pytestconfig):
    """A repository of one commit holding this project's setup.py and a native source that cannot compile."""
    repo = tmp_path / "repo"
    (repo / "native").mkdir(parents=True)
    (repo / "engine" / "mlx_streaming").mkdir(parents=True)
    (repo / "setup.py").write_text((pytestconfig.rootpath / "setup.py").read_text())
    (repo / "native" / "_native.c").write_text("#error this revision does not compile\n")
    (repo / "engine" / "mlx_streaming" / "__init__.py").write_text("")
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "broken native")
    return repo


@pytest.fixture
def private_tmp(tmp_path, monkeypatch):
    """A temp folder of the test's own for the exported trees, to see that none is left behind."""
    folder = tmp_path / "tmp"
    folder.mkdir()
    monkeypatch.setattr(side_by_side.tempfile, "tempdir", str(folder))
    return folder


def test_a_revision_not_in_the_history_is_refused_in_one_line(pytestconfig):
    with pytest.raises(BaseUnavailable, match=r"^base revision 0{12} is not in the history of .*fetch it\)$"):
        side_by_side.resolve(pytestconfig.rootpath, "0" * 12)


def test_a_folder_outside_git_is_refused_in_one_line(tmp_path):
    with pytest.raises(BaseUnavailable, match=r"is not a git checkout: cannot check out base revision HEAD$"):
        side_by_side.resolve(tmp_path, "HEAD")


def test_a_base_whose_native_extension_does_not_build_is_refused_and_leaves_nothing(tiny_repo, private_tmp,
                                                                                     pytestconfig):
    from mlx_streaming.io import native

    if not native.NATIVE:
        pytest.skip("this install runs the pure-Python twins, so the base's extension is not built either")
    with pytest.raises(BaseUnavailable, match=r"^cannot build the native extension of base revision [0-9a-f]{10}: "):
        BaseEngine(tiny_repo, "HEAD", Path("."), Path("."), [1], 4, {}, {})
    assert list(private_tmp.iterdir()) == []


def test_uncommitted_changes_neither_block_the_export_nor_leak_into_it(tiny_repo, tmp_path):
    init = tiny_repo / "engine" / "mlx_streaming" / "__init__.py"
    init.write_text("UNCOMMITTED = True\n")
    (tiny_repo / "untracked.txt").write_text("mine")
    before = subprocess.run(["git", "-C", str(tiny_repo), "status", "--porcelain"], capture_output=True, text=True)
    tree = side_by_side.export(tiny_repo, side_by_side.resolve(tiny_repo, "HEAD"), tmp_path / "out")
    assert (tree / "engine" / "mlx_streaming" / "__init__.py").read_text() == ""
    assert not (tree / "untracked.txt").exists()
    assert init.read_text() == "UNCOMMITTED = True\n"  # the working tree is as it was
    after = subprocess.run(["git", "-C", str(tiny_repo), "status", "--porcelain"], capture_output=True, text=True)
    assert after.stdout == before.stdout and before.stdout.strip()


def test_the_base_engine_measures_a_scenario_from_its_own_tree_and_goes_on_ctrl_c(pytestconfig, model_dir,
                                                                                   mtp_path, tmp_path):
    """Started in a child process, which prints once the worker measured a round; SIGINT there leaves no
    exported tree behind."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    code = f"""
import sys
from pathlib import Path
from mlx_streaming.harness.side_by_side import BaseEngine
with BaseEngine(Path({str(pytestconfig.rootpath)!r}), "HEAD", Path({str(model_dir)!r}), Path({str(mtp_path)!r}),
                [1, 2, 3], 4, {{"io_mode": "buffered"}}, {{"model": {str(model_dir)!r}, "prompt": [1, 2, 3]}}) as base:
    base.scenario("greedy_quarter_pool_direct")
    r = base.round()
    assert len(r["costs"]) == 2 and len(r["yard_costs"]) == 2 and r["counters"]["routed"] > 0, r
    print("measured", flush=True)
    sys.stdin.readline()
"""
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env={**os.environ, "TMPDIR": str(tmp)})
    try:
        assert child.stdout.readline().strip() == "measured", child.stderr.read()
        ours = [p for p in tmp.iterdir() if p.name.startswith("mlx-streaming-base-")]
        assert len(ours) == 1, list(tmp.iterdir())
        child.send_signal(signal.SIGINT)
        child.communicate(timeout=120)  # drains its pipes while it stops: a full one cannot hold it up
    finally:
        child.kill()
    assert not ours[0].exists(), list(tmp.iterdir())
