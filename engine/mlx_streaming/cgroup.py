"""The memory cgroup: how much memory this process may use, and a hard limit for a command.

"Larger than memory" is a fact only where memory is limited and measured. On Linux the kernel's memory cgroup
does both: a child group with ``memory.limit_in_bytes`` (v1) or ``memory.max`` (v2) kills what grows past the
limit, and its ``memory.max_usage_in_bytes`` / ``memory.peak`` is the peak the kernel charged (resident memory and
the page cache the process filled). Creating a group needs a writable cgroup hierarchy (root, or a delegated
subtree); where there is none (macOS, a locked-down container) ``limited_run`` raises ``LimitUnavailable`` with
the reason, and the machine's own memory is the limit.
"""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

#: Where the kernel mounts the cgroup hierarchies.
MOUNT = Path("/sys/fs/cgroup")
#: A v1 limit this large means "no limit".
UNLIMITED = 1 << 60
_groups = itertools.count()


class LimitUnavailable(Exception):
    """No hard memory limit can be set here; the message says why, in one line."""


@dataclass(frozen=True)
class Files:
    """One cgroup's memory files, by version."""
    folder: Path
    limit: str
    usage: str
    peak: Optional[str]

    @classmethod
    def of(cls, folder: Path, version: int) -> "Files":
        if version == 1:
            return cls(folder, "memory.limit_in_bytes", "memory.usage_in_bytes", "memory.max_usage_in_bytes")
        return cls(folder, "memory.max", "memory.current", "memory.peak")

    def read(self, name: Optional[str]) -> Optional[int]:
        try:
            text = (self.folder / name).read_text().strip() if name else ""
        except OSError:
            return None
        return None if text in ("", "max") or int(text) >= UNLIMITED else int(text)


def _own_group() -> Optional[tuple]:
    """(this process's memory cgroup folder, the hierarchy's root folder, its version), or None where there is
    no memory cgroup."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            folder = MOUNT / "memory" / path.lstrip("/")
            if folder.is_dir():
                return folder, MOUNT / "memory", 1
        elif controllers == "" and path:
            for root in (MOUNT, MOUNT / "unified"):
                folder = root / path.lstrip("/")
                if (root / "cgroup.controllers").exists() and "memory" in (root / "cgroup.controllers").read_text().split():
                    return folder, root, 2
    return None


def available_bytes() -> int:
    """The memory this process may still take: what the machine has available, or what is left under the limit
    of its memory cgroup and of each cgroup above it, whichever is least."""
    import psutil

    available = psutil.virtual_memory().available
    own = _own_group()
    if own is None:
        return available
    folder, root, version = own
    while True:
        files = Files.of(folder, version)
        limit, usage = files.read(files.limit), files.read(files.usage)
        if limit is not None and usage is not None:
            available = min(available, max(limit - usage, 0))
        if folder == root or root not in folder.parents:
            return available
        folder = folder.parent


@dataclass(frozen=True)
class LimitedRun:
    """A command's run under a hard memory limit: how it ended and the peak memory the kernel charged it."""
    returncode: int
    limit_bytes: int
    peak_bytes: Optional[int]
    killed_for_memory: bool
    stdout: str
    stderr: str


def _make_group(limit_bytes: int) -> Files:
    own = _own_group()
    if own is None:
        raise LimitUnavailable("no memory cgroup here (only Linux has one): the machine's own memory is the limit")
    parent, _, version = own
    files = Files.of(parent / f"mlx-streaming-{os.getpid()}-{next(_groups)}", version)
    try:
        files.folder.mkdir()
    except OSError as exc:
        raise LimitUnavailable(f"cannot create a memory cgroup under {parent} ({exc.strerror}): run as root, or in "
                               "a delegated cgroup") from None
    try:
        (files.folder / files.limit).write_text(str(limit_bytes))
    except OSError as exc:
        files.folder.rmdir()
        raise LimitUnavailable(f"cannot set {files.folder / files.limit} ({exc.strerror})") from None
    return files


def _remove(files: Files) -> None:
    """Kill what is left in the group, then remove it (the kernel moves its charges to the parent)."""
    try:
        for pid in (files.folder / "cgroup.procs").read_text().split():
            os.kill(int(pid), signal.SIGKILL)
    except OSError:
        pass
    for _ in range(100):
        try:
            files.folder.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            import time

            time.sleep(0.05)


def limited_run(argv: Sequence[str], limit_bytes: int, timeout: Optional[float] = None, capture: bool = True,
                **popen) -> LimitedRun:
    """Run ``argv`` in a new memory cgroup of ``limit_bytes`` (its own child of this process's group) and wait:
    the kernel kills it if it grows past the limit. ``capture``: keep its output (else it goes where this
    process's goes). Raises ``LimitUnavailable`` where no limit can be set."""
    files = _make_group(limit_bytes)
    procs = str(files.folder / "cgroup.procs")

    def enter() -> None:  # in the child, before exec: everything it runs is charged to the group
        with open(procs, "w") as f:
            f.write(str(os.getpid()))

    try:
        done = subprocess.run(list(argv), preexec_fn=enter, capture_output=capture, text=True, timeout=timeout,
                              **popen)
        peak = files.read(files.peak)
        killed = done.returncode == -signal.SIGKILL and _oom_killed(files)
        return LimitedRun(done.returncode, limit_bytes, peak, killed, done.stdout, done.stderr)
    finally:
        _remove(files)


def _oom_killed(files: Files) -> bool:
    """Whether the kernel's out-of-memory killer killed something in the group."""
    name = "memory.oom_control" if files.limit == "memory.limit_in_bytes" else "memory.events"
    try:
        fields = dict(line.split() for line in (files.folder / name).read_text().splitlines())
    except (OSError, ValueError):
        return False
    return int(fields.get("oom_kill", 0)) > 0
