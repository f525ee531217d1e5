"""The perf gate's side-by-side mode: the base revision's engine measured on this machine, round for round beside
the current tree's.

A stored baseline's costs mean something only on the machine profile that recorded them. Elsewhere (a user's
laptop, a hosted CI runner) the gate exports the base revision (``git archive``: the repository and the working
tree are not touched, and uncommitted changes neither block the export nor leak into it) into a temporary
folder, builds its native extension there (nothing is installed), and runs the perf scenarios' base rounds in a
worker process on that tree (``perf_rounds.py --worker``), alternating with the current tree's rounds. The
folder and the worker go when the session ends, Ctrl-C included.

Every way this can fail ends in ``BaseUnavailable`` with one line that says why; the gate then judges the work
counters alone, as it does without a comparable baseline.
"""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Optional

from . import perf_rounds

#: A base worker's answer may take this long (a round of the slowest scenario, or building and warming one up).
ANSWER_TIMEOUT_S = 600


class BaseUnavailable(Exception):
    """The base revision cannot be measured here; the message is the one line the gate prints."""


def _git(repo: Path, *args: str, **kw) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, **kw)
    except FileNotFoundError:
        raise BaseUnavailable("git is not installed: cannot check out the base revision") from None


def _last_line(text) -> str:
    text = text.decode(errors="replace") if isinstance(text, bytes) else text
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    return lines[-1] if lines else "no output"


def resolve(repo: Path, rev: str) -> str:
    """``rev``'s full commit id in the repository holding ``repo``."""
    inside = _git(repo, "rev-parse", "--is-inside-work-tree", text=True)
    if inside.returncode != 0:
        raise BaseUnavailable(f"{repo} is not a git checkout: cannot check out base revision {rev}")
    found = _git(repo, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}", text=True)
    if found.returncode != 0:
        raise BaseUnavailable(f"base revision {rev} is not in the history of {repo} (a shallow clone? fetch it)")
    return found.stdout.strip()


def export(repo: Path, commit: str, into: Path) -> Path:
    """The tree of ``commit`` written under ``into`` (the repository's files, not its working tree)."""
    archive = _git(repo, "archive", "--format=tar", commit)
    if archive.returncode != 0:
        raise BaseUnavailable(f"cannot check out base revision {commit[:10]}: {_last_line(archive.stderr)}")
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        if hasattr(tarfile, "data_filter"):  # Pythons with extraction filters: the safe one
            tar.extractall(into, filter="data")
        else:
            tar.extractall(into)
    return into


def _native_built(engine: Path) -> bool:
    return any((engine / "mlx_streaming").glob("_native*.so")) or any((engine / "mlx_streaming").glob("_native*.pyd"))


def build_native(tree: Path, commit: str) -> None:
    """The base tree's own native extension, built in place (``setup.py build_ext --inplace``), where the current
    install has one: a base on the pure-Python twins would be slower for a reason that is not the change."""
    from ..io import native

    if not (tree / "setup.py").exists() or not native.NATIVE:
        return
    built = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace", "--build-temp",
                            str(tree / ".build")], cwd=tree, capture_output=True, text=True)
    if built.returncode != 0 or not _native_built(tree / "engine"):
        why = _last_line(built.stderr + built.stdout)
        raise BaseUnavailable(f"cannot build the native extension of base revision {commit[:10]}: {why}")


class BaseEngine:
    """The base revision's engine in a worker process, measuring the perf scenarios on request. A context
    manager: ``close()`` stops the worker and removes the exported tree."""

    def __init__(self, repo: Path, rev: str, model_dir: Path, mtp_path: Path, prompt, tokens: int, config: dict,
                 yardstick: dict):
        self.rev = rev
        self.commit = resolve(repo, rev)
        self._folder = Path(tempfile.mkdtemp(prefix="mlx-streaming-base-"))
        self._worker: Optional[subprocess.Popen] = None
        try:
            tree = export(repo, self.commit, self._folder / "tree")
            build_native(tree, self.commit)
            self._start(tree, model_dir, mtp_path, prompt, tokens, config, yardstick)
        except BaseException:
            self.close()
            raise

    def _start(self, tree: Path, model_dir, mtp_path, prompt, tokens, config, yardstick) -> None:
        engine = tree / "engine"
        launcher = (f"import runpy, sys; sys.path.insert(0, {str(engine)!r}); sys.argv = [{perf_rounds.__file__!r}, "
                    f"'--worker']; runpy.run_path(sys.argv[0], run_name='__main__')")
        self._log = open(self._folder / "worker.log", "w+")
        self._worker = subprocess.Popen([sys.executable, "-c", launcher], cwd=engine, stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=self._log, text=True)
        hello = self._ask({"model": str(Path(model_dir).resolve()), "mtp": str(Path(mtp_path).resolve()),
                           "prompt": list(prompt), "tokens": tokens, "config": config, "yardstick": yardstick})
        if not Path(hello["engine"]).resolve().is_relative_to(engine.resolve()):
            raise BaseUnavailable(f"the base worker imported mlx_streaming from {hello['engine']}, not from base "
                                  f"revision {self.commit[:10]}")

    def _ask(self, request: dict) -> dict:
        self._worker.stdin.write(json.dumps(request) + "\n")
        self._worker.stdin.flush()
        line = self._worker.stdout.readline()
        if not line:
            self._worker.wait(timeout=ANSWER_TIMEOUT_S)
            self._log.seek(0)
            raise BaseUnavailable(f"the base revision {self.commit[:10]}'s worker stopped: {_last_line(self._log.read())}")
        answer = json.loads(line)
        if "error" in answer:
            raise BaseUnavailable(f"base revision {self.commit[:10]} cannot run the perf scenarios: {answer['error']}")
        return answer

    def scenario(self, name: str) -> None:
        """Build the base engine's model for scenario ``name`` and warm it up as the suite does."""
        self._ask({"scenario": name})

    def round(self) -> dict:
        """A yardstick round, then a timed round of the current scenario: ``costs``, ``yard_costs``, ``wall``,
        ``counters``."""
        return self._ask({"round": True})

    def close(self) -> None:
        if self._worker is not None:
            if self._worker.poll() is None:
                self._worker.stdin.close()
                try:
                    self._worker.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    self._worker.kill()
                    self._worker.wait()
            self._worker.stdout.close()
            self._log.close()
            self._worker = None
        shutil.rmtree(self._folder, ignore_errors=True)

    def __enter__(self) -> "BaseEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
