"""mlx-lm's own loops and server on a streaming model: ``chat`` (``stream_generate`` and mlx-lm's sampler),
``server`` (mlx-lm's OpenAI-compatible server), ``loop`` (the engine's loops in ``stream_generate``'s draft slot)
and ``internals`` (every use of mlx-lm's private names, the project's only one).

mlx-lm has no public hook for another generator under ``stream_generate`` or its server, so ``chat`` and ``server``
depend on names mlx-lm may change in any release: they run only on the mlx-lm versions they were tested with
(``require_tested_mlx_lm``).
"""

from __future__ import annotations

from ..errors import StreamingError

#: mlx-lm releases (major.minor) the server integration was tested with.
TESTED_MLX_LM = ("0.32",)


class UntestedMlxLmError(StreamingError):
    """The installed mlx-lm is not one a feature that uses its private names was tested with."""


def require_tested_mlx_lm(feature: str, version: str = None) -> None:
    """One clear error where ``feature`` would run on an mlx-lm it was not tested with."""
    if version is None:
        import mlx_lm

        version = mlx_lm.__version__
    if ".".join(version.split(".")[:2]) not in TESTED_MLX_LM:
        raise UntestedMlxLmError(
            f"{feature} uses mlx-lm's internals and was tested with mlx-lm {', '.join(TESTED_MLX_LM)}.x; "
            f"mlx-lm {version} is installed: install mlx-lm=={TESTED_MLX_LM[-1]}.* for it")
