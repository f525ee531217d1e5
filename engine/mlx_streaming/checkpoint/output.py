"""Where the project writes: never over what it did not write, and never a half-written result.

A folder the project writes (``synth --out``, ``repack --out``) gets a marker file naming the command. A
target folder must be absent, empty, or hold that marker; anything else is refused with one line. The new
content is written into a hidden sibling first and swapped into place only once complete, so an error or
Ctrl-C leaves the old folder (or nothing) behind. A single file the project writes (``extract-mtp --out``)
carries the same claim in its safetensors metadata and is replaced the same way.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from ..errors import OutputError

MARKER_FILE = ".mlx-streaming-output.json"
#: The safetensors metadata key that says which command of this project wrote a file.
WRITER_KEY = "written_by"


def _note(text: str) -> None:
    print(f"mlx-streaming: {text}", file=sys.stderr, flush=True)


def folder_writer(folder: Path) -> str:
    """The command that wrote ``folder`` (from its marker), or '' when the project did not write it."""
    try:
        return json.loads((Path(folder) / MARKER_FILE).read_text())[WRITER_KEY]
    except (OSError, ValueError, KeyError, TypeError):
        return ""


def file_writer(path: Path) -> str:
    """The command that wrote safetensors file ``path`` (from its metadata), or ''."""
    from ..errors import CheckpointError
    from .safetensors import read_metadata

    try:
        return read_metadata(path).get(WRITER_KEY, "")
    except CheckpointError:  # not a safetensors file at all: certainly not ours
        return ""


def _check_folder_target(out: Path, option: str, command: str) -> bool:
    """Whether ``out`` exists (and may be replaced); raise when it must not be touched."""
    if not out.exists():
        return False
    if not out.is_dir():
        raise OutputError(f"{option} {out}: is a file, not a folder; give a new or empty folder")
    if any(out.iterdir()) and not folder_writer(out):
        raise OutputError(f"{option} {out}: the folder is not empty and was not written by mlx-streaming; "
                          f"give a new or empty folder (nothing was changed)")
    return True


@contextmanager
def fresh_folder(out: Path, command: str, option: str = "--out") -> Iterator[Path]:
    """Yield a hidden sibling of ``out`` to write into; when the block ends without error it replaces
    ``out`` (absent, empty, or written by this project); on error or interrupt it is removed."""
    out = Path(out).absolute()
    replacing = _check_folder_target(out, option, command)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.parent / f".{out.name}.partial-{os.getpid()}"
    partial.mkdir()
    try:
        yield partial
        (partial / MARKER_FILE).write_text(json.dumps({WRITER_KEY: f"mlx-streaming {command}"}))
        if replacing:
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            previous = folder_writer(out)
            out.rename(old)
            partial.rename(out)
            shutil.rmtree(old)
            if previous:
                _note(f"replaced {out} (written earlier by {previous})")
        else:
            partial.rename(out)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise


@contextmanager
def fresh_file(out: Path, command: str, option: str = "--out") -> Iterator[Path]:
    """Yield a hidden sibling path of ``out`` to write a safetensors file into; it replaces ``out`` (absent,
    or a file this project wrote) when the block ends without error, and is removed otherwise."""
    out = Path(out).absolute()
    if out.is_dir():
        raise OutputError(f"{option} {out}: is a folder; give the name of the file to write")
    if out.suffix != ".safetensors":
        raise OutputError(f"{option} {out}: name the file to write *.safetensors")
    previous = file_writer(out) if out.exists() else ""
    if out.exists() and not previous:
        raise OutputError(f"{option} {out}: the file exists and was not written by mlx-streaming; "
                          f"give a new file name (nothing was changed)")
    if not out.parent.is_dir():
        raise OutputError(f"{option} {out}: folder {out.parent} does not exist")
    # The suffix stays last: mx.save_safetensors appends ".safetensors" to a name that does not end in it.
    partial = out.parent / f".{out.stem}.partial-{os.getpid()}{out.suffix}"
    try:
        yield partial
        os.replace(partial, out)
        if previous:
            _note(f"replaced {out} (written earlier by {previous})")
    except BaseException:
        partial.unlink(missing_ok=True)
        raise


def writer_metadata(command: str) -> dict:
    """safetensors metadata for a file this project writes."""
    return {"format": "mlx", WRITER_KEY: f"mlx-streaming {command}"}
