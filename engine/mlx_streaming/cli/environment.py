"""The settings a command runs with: its options, over the environment's ``MLX_STREAMING_`` names, over the
command's own defaults, split into the engine's knobs (``config.StreamingConfig``) and the runner's settings
(``run_settings.RunSettings``).

Every environment name read is namespaced (``ENV_PREFIX``), so that a ``K`` or ``PROMPT`` left in a shell changes
nothing; each one used is named in one line, and an ``MLX_STREAMING_`` name that is no setting is named too, as
ignored. Code below the CLI reads the two objects, never ``os.environ``.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Callable, Mapping, Optional, Tuple

from ..config import POOL_SIZES, StreamingConfig, parse_size
from ..errors import ConfigError
from ..run_settings import RunSettings

ENV_PREFIX = "MLX_STREAMING_"


def _flag(text: str) -> bool:
    return text.strip().lower() not in ("0", "false", "no", "off", "")


def _prefetch_env(text: str):
    return "auto" if text.strip().lower() == "auto" else _flag(text)


#: Environment name -> (setting, parser). Each is ``ENV_PREFIX`` and the setting's name in capitals, and
#: ``STG_VERIFY``, kept as users know it.
ENV_NAMES = {
    ENV_PREFIX + "MAX_TOKENS": ("max_tokens", int),
    ENV_PREFIX + "K": ("k", lambda text: text if text == "auto" else int(text)),
    ENV_PREFIX + "MTP_PATH": ("mtp_path", str),
    ENV_PREFIX + "COMMIT_MODE": ("commit_mode", str),
    ENV_PREFIX + "PROMPT": ("prompt", str),
    ENV_PREFIX + "POOL_SLOTS": ("pool_slots", int),
    ENV_PREFIX + "POOL_BYTES": ("pool_bytes", parse_size),
    ENV_PREFIX + "MEMORY_BUDGET": ("memory_budget", parse_size),
    ENV_PREFIX + "POOL_FRACTION": ("pool_fraction", float),
    ENV_PREFIX + "IO_MODE": ("io_mode", str),
    ENV_PREFIX + "READ_THREADS": ("read_threads", int),
    ENV_PREFIX + "PREFILL_CHUNK": ("prefill_chunk", int),
    ENV_PREFIX + "PIN_HOT": ("pin_hot", int),
    ENV_PREFIX + "PIN_CAL_TOKENS": ("pin_cal_tokens", int),
    ENV_PREFIX + "RECORD": ("record", _flag),
    ENV_PREFIX + "WARMUP_TOKENS": ("warmup_tokens", int),
    ENV_PREFIX + "REPEAT": ("repeat", int),
    ENV_PREFIX + "DUMP_IDS": ("dump_ids", str),
    ENV_PREFIX + "PREFETCH": ("prefetch", _prefetch_env),
    ENV_PREFIX + "PREFETCH_AHEAD": ("prefetch_ahead", int),
    ENV_PREFIX + "PREFETCH_MULT": ("prefetch_mult", int),
    ENV_PREFIX + "STAGING_BYTES": ("staging_bytes", parse_size),
    ENV_PREFIX + "MISS_CHECK": ("miss_check", str),
    ENV_PREFIX + "EVICTION": ("eviction", str),
    ENV_PREFIX + "PRELOAD": ("preload", _flag),
    "STG_VERIFY": ("verify", _flag),
}

#: ``MLX_STREAMING_`` names read elsewhere, not settings: the native reader switch (``io/native.py``) and the
#: perf suite's planted slowdown (``perf/test_perf.py``).
OTHER_ENV_NAMES = (ENV_PREFIX + "NATIVE", ENV_PREFIX + "PLANT_S")

ENGINE_FIELDS = frozenset(f.name for f in dataclasses.fields(StreamingConfig))
RUN_FIELDS = frozenset(f.name for f in dataclasses.fields(RunSettings))


def settings(environ: Mapping[str, str] = os.environ, defaults: Mapping[str, object] = (),
             say: Optional[Callable[[str], None]] = None, **overrides) -> Tuple[StreamingConfig, RunSettings]:
    """The settings of ``overrides`` (``None``: not given), over the environment names of ``ENV_NAMES``, over
    ``defaults`` (a command's own; a pool size among them applies only where no pool size is given). Every value
    taken from the environment is named in one line through ``say`` (default: on stderr)."""
    say = say or _stderr
    given = {k: v for k, v in overrides.items() if v is not None}
    values = {}
    for env_name, (name, parse) in ENV_NAMES.items():
        text = environ.get(env_name, "")
        if text == "":
            continue
        try:
            value = parse(text)
        except ValueError as exc:
            raise ConfigError(f"environment variable {env_name}={text!r}: {exc}") from None
        if name in given:
            say(f"mlx-streaming: {env_name}={text} in the environment is overridden by the command line")
        else:
            values[name] = value
            say(f"mlx-streaming: {env_name}={text} from the environment")
    for env_name in sorted(environ):
        if env_name.startswith(ENV_PREFIX) and env_name not in ENV_NAMES and env_name not in OTHER_ENV_NAMES:
            say(f"mlx-streaming: {env_name} in the environment is not a setting, ignored (settings: "
                f"{', '.join(ENV_NAMES)})")
    values.update(given)
    for name, value in dict(defaults).items():
        if not any(n in values for n in (POOL_SIZES if name in POOL_SIZES else (name,))):
            values[name] = value
    run = RunSettings(**{k: v for k, v in values.items() if k in RUN_FIELDS})
    engine = {k: v for k, v in values.items() if k in ENGINE_FIELDS}
    return StreamingConfig(**{"calibration_prompt": run.prompt, **engine}), run


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
