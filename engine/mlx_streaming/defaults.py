"""The default model: a synthetic checkpoint made once into a cache folder and reused.

Made into a temporary sibling folder and renamed into place, so concurrent processes (pytest-xdist
workers) never see a half-written checkpoint.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from . import __version__
from .errors import CheckpointError

DEFAULT_PRESET = "tiny"
DEFAULT_SEED = 0


def cache_root() -> Path:
    return Path(os.environ.get("MLX_STREAMING_CACHE", Path.home() / ".cache" / "mlx-streaming"))


def synthetic_model(preset: str = DEFAULT_PRESET, seed: int = DEFAULT_SEED, layout: str = "mlx") -> Path:
    """Path of the cached synthetic checkpoint, made first if absent."""
    from .checkpoint.synth import synth_checkpoint

    target = cache_root() / f"{preset}-seed{seed}-{layout}-v{__version__}"
    if (target / "config.json").exists():
        return target
    scratch = target.with_name(f"{target.name}.tmp-{os.getpid()}")
    synth_checkpoint(scratch, preset=preset, seed=seed, layout=layout)
    try:
        scratch.rename(target)
    except OSError:  # another process finished first, or a stale folder is in the way
        shutil.rmtree(scratch, ignore_errors=True)
        if not (target / "config.json").exists():
            raise CheckpointError(f"{target}: an incomplete cached checkpoint is in the way; delete it") from None
    return target
