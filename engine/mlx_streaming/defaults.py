"""The default model: the small Qwen3-Next trained by ``training/train_small.py``, embedded in the package.

It is in the public MLX 4-bit layout (converted by mlx-lm's converter, MTP head by ``extract-mtp``) and
carries its held-out tokens and training report, so every figure can be checked against the training run.
"""

from __future__ import annotations

from pathlib import Path

from .errors import CheckpointError

DEFAULT_MODEL_NAME = "qwen3-next-code-35m"


def default_model() -> Path:
    """The embedded trained model: what every command and test uses when no model is named."""
    path = Path(__file__).parent / "models" / DEFAULT_MODEL_NAME
    if not (path / "config.json").exists():
        raise CheckpointError(f"{path}: the embedded default model is missing from this installation")
    return path
