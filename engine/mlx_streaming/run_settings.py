"""RunSettings: what a run decodes and how often, beside the engine's knobs (``config.StreamingConfig``).

The commands' prompt and token count, speculation's tokens per verify and commit mode, and the benchmark's
warm-up, repeats and id dump: the runner reads them (the commands, ``bench``, chat and serve); the engine never
does. CLI options and the environment's ``MLX_STREAMING_`` names fill both objects (``cli.environment``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Union

from .errors import ConfigError

DEFAULT_PROMPT = "def fibonacci(n):"
#: How a partial accept commits the Gated-DeltaNet state: install the state captured at the last accepted
#: position, or restore the snapshot taken before the verify and replay the accepted tokens.
COMMIT_MODES = ("direct", "replay")
#: Tokens per verify (``k``) at most: a verify of K tokens costs about K decode steps, and the MTP head's
#: acceptance falls with every draft position, so a larger K only burns time (``KChooser`` tries 1 to 4).
MAX_K = 16


@dataclass
class RunSettings:
    prompt: str = DEFAULT_PROMPT
    #: Tokens to generate.
    max_tokens: int = 64
    #: Speculative decoding: tokens per verify (1 + K-1 drafts; 1: none; "auto": chosen while decoding by
    #: ``mtp.autok.KChooser``), and how a partial accept commits (``COMMIT_MODES``).
    k: Union[int, str] = "auto"
    commit_mode: str = "direct"
    #: Benchmarks: warm-up tokens per path, timed runs per path (medians reported), where to dump the ids.
    warmup_tokens: int = 8
    repeat: int = 3
    dump_ids: Optional[str] = None

    def __post_init__(self) -> None:
        if not self.prompt:
            raise ConfigError("prompt is empty: give some text to start from")
        if self.commit_mode not in COMMIT_MODES:
            raise ConfigError(f"commit_mode must be one of {', '.join(COMMIT_MODES)}, got {self.commit_mode!r}")
        if self.k != "auto" and (not isinstance(self.k, int) or not 1 <= self.k <= MAX_K):
            raise ConfigError(f"k must be auto or 1 to {MAX_K} (tokens per verify), got {self.k!r}")
        for name in ("max_tokens", "repeat"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.warmup_tokens < 0:
            raise ConfigError(f"warmup_tokens must not be negative, got {self.warmup_tokens}")

    def replace(self, **changes) -> "RunSettings":
        return dataclasses.replace(self, **changes)
