"""StreamingConfig: every engine knob in one dataclass.

CLI flags, pytest options and the environment names of ``ENV_NAMES`` (``MLX_STREAMING_<NAME>``, and
``STG_VERIFY``) all map onto these fields; code below this module reads the config object, never ``os.environ``.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Union

from .errors import ConfigError

IO_MODES = ("buffered", "direct")
#: The knobs that size the expert pool; at most one may be set (none: every expert resident).
POOL_SIZES = ("pool_slots", "pool_bytes", "memory_budget", "pool_fraction")
COMMIT_MODES = ("direct", "replay")
MISS_CHECKS = ("forward", "layer")

#: Tokens per verify (``k``) at most: a verify of K tokens costs about K decode steps, and the MTP head's
#: acceptance falls with every draft position, so a larger K only burns time (``KChooser`` tries 1 to 4).
MAX_K = 16

#: Memory kept free for KV caches, activations and temporaries when the pool size is derived from a memory
#: budget: the pool gets ``budget - dense weights - allowance``. A budget under four times this keeps a quarter.
DEFAULT_MEMORY_ALLOWANCE = 512 << 20


@dataclass
class StreamingConfig:
    """Engine settings. ``None`` for every pool knob means: one slot per expert (everything resident)."""

    #: Experts each MoE layer keeps resident. At most one of pool_slots / pool_bytes / memory_budget /
    #: pool_fraction.
    pool_slots: Optional[int] = None
    #: Bytes of expert weights all MoE layers together keep resident.
    pool_bytes: Optional[int] = None
    #: Read every expert into the pool at build (the pool must hold every expert): nothing is read while
    #: decoding, and no forward can miss, so none waits for a miss check. Counters start after the fill.
    preload: bool = False
    #: Bytes the whole process may use; the pool gets what the dense weights and the allowance leave.
    memory_budget: Optional[int] = None
    #: The share of each MoE layer's experts kept resident (0.25: a quarter of them, rounded).
    pool_fraction: Optional[float] = None
    #: Bytes a memory budget keeps for caches and activations (None: ``DEFAULT_MEMORY_ALLOWANCE``, or a quarter
    #: of a budget too small for it).
    memory_allowance: Optional[int] = None
    #: ``buffered`` reads through the page cache; ``direct`` bypasses it (O_DIRECT / F_NOCACHE).
    io_mode: str = "buffered"
    #: Read experts from the packed layout in this folder (``mlx-streaming repack``) instead of the shards.
    packed_dir: Optional[str] = None
    #: Count every routed (layer, expert) so that ``store.routed.hot(layer, n)`` can name the hottest experts.
    record: bool = False
    #: Prompt tokens per forward during prefill.
    prefill_chunk: int = 256
    max_tokens: int = 64
    prompt: str = "def fibonacci(n):"
    #: Load the MTP head too (its experts stream through the same pool, as one more layer).
    mtp: bool = False
    #: The MTP weights (default: ``mtp.safetensors`` in the model folder).
    mtp_path: Optional[str] = None
    #: Speculative decoding: tokens per verify (1 + K-1 drafts; 1: none; "auto": chosen while decoding by
    #: ``mtp.autok.KChooser``) and how Gated-DeltaNet state is committed.
    k: Union[int, str] = "auto"
    commit_mode: str = "direct"
    #: Byte-truth verification (STG_VERIFY): check every expert placed into the pool against disk.
    verify: bool = False
    #: Benchmark: warm-up tokens per path, timed runs per path (medians reported), where to dump the ids.
    warmup_tokens: int = 8
    repeat: int = 3
    dump_ids: Optional[str] = None
    #: Pin the ``pin_hot`` hottest experts of every layer, found by a calibration run of ``pin_cal_tokens``.
    pin_hot: int = 0
    pin_cal_tokens: int = 32
    #: Background prefetch of predicted experts: predict from each layer's input the experts of this
    #: layer (``prefetch_ahead`` 0) or the next (1), each token's top ``top_k * prefetch_mult``.
    #: ``"auto"``: on or off, whichever decodes faster, measured while decoding (``prefetch.switch``).
    prefetch: Union[bool, str] = False
    prefetch_ahead: int = 1
    prefetch_mult: int = 1
    prefetch_threads: int = 2
    #: Host bytes the prefetcher may hold in queued and staged reads.
    staging_bytes: int = 64 << 20
    #: At most this many experts submitted per layer / per forward (0: no limit).
    prefetch_layer_budget: int = 0
    prefetch_forward_budget: int = 0
    #: When the engine checks that the routed experts are resident: "forward" runs a forward expected to find
    #: them all with no per-layer host sync and checks once at its end (a miss reruns it layer by layer);
    #: "layer" syncs at every MoE layer.
    miss_check: str = "forward"
    #: Measure prediction recall, miss attribution and main-thread timings (costs time; off by default).
    diagnostics: bool = False

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if not self.prompt:
            raise ConfigError("prompt is empty: give some text to start from")
        if self.io_mode not in IO_MODES:
            raise ConfigError(f"io_mode must be one of {', '.join(IO_MODES)}, got {self.io_mode!r}")
        if self.miss_check not in MISS_CHECKS:
            raise ConfigError(f"miss_check must be one of {', '.join(MISS_CHECKS)}, got {self.miss_check!r}")
        if self.commit_mode not in COMMIT_MODES:
            raise ConfigError(f"commit_mode must be one of {', '.join(COMMIT_MODES)}, got {self.commit_mode!r}")
        if self.k != "auto" and (not isinstance(self.k, int) or not 1 <= self.k <= MAX_K):
            raise ConfigError(f"k must be auto or 1 to {MAX_K} (tokens per verify), got {self.k!r}")
        sizing = [n for n in POOL_SIZES if getattr(self, n) is not None]
        if len(sizing) > 1:
            given = ", ".join(f"{n}={getattr(self, n)}" for n in sizing)
            raise ConfigError(f"set at most one pool size (slots, bytes, memory budget or fraction); got {given}")
        if self.pool_fraction is not None and not 0 < self.pool_fraction <= 1:
            raise ConfigError(f"pool_fraction must be in (0, 1], got {self.pool_fraction}")
        for name in ("pool_slots", "pool_bytes", "memory_budget"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ConfigError(f"{name} must be positive, got {value}")
        for name in ("prefill_chunk", "max_tokens", "pin_cal_tokens", "repeat"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.prefetch not in (True, False, "auto"):
            raise ConfigError(f"prefetch must be on, off or auto, got {self.prefetch!r}")
        if self.prefetch_ahead not in (0, 1):
            raise ConfigError(f"prefetch_ahead must be 0 or 1, got {self.prefetch_ahead}")
        for name in ("prefetch_mult", "prefetch_threads", "staging_bytes"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("pin_hot", "memory_allowance", "warmup_tokens", "prefetch_layer_budget",
                     "prefetch_forward_budget"):
            if (getattr(self, name) or 0) < 0:
                raise ConfigError(f"{name} must not be negative, got {getattr(self, name)}")

    def replace(self, **changes) -> "StreamingConfig":
        return dataclasses.replace(self, **changes)

    def with_pool(self, **size) -> "StreamingConfig":
        """This config with the pool sized by ``size`` alone (e.g. ``pool_fraction=0.25``; nothing: every
        expert resident), whatever sized it before."""
        return self.replace(**{**dict.fromkeys(POOL_SIZES), **size})

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ, defaults: Mapping[str, object] = (),
                 say: Optional[Callable[[str], None]] = None, **overrides) -> "StreamingConfig":
        """The config of ``overrides`` (``None``: not given), over the environment names of ``ENV_NAMES``, over
        ``defaults`` (a caller's own defaults; a pool size among them applies only where no pool size is given).

        Every value taken from the environment is named in one line through ``say`` (default: on stderr), so
        that no setting is silent; an ``MLX_STREAMING_`` name that is no setting is named too, as ignored.
        Bare names of earlier versions (``K``, ``MAXTOK``, ``PROMPT``...) are not read."""
        say = say or _stderr
        given = {k: v for k, v in overrides.items() if v is not None}
        values = {}
        for env_name, (field_name, parse) in ENV_NAMES.items():
            text = environ.get(env_name, "")
            if text == "":
                continue
            try:
                value = parse(text)
            except ValueError as exc:
                raise ConfigError(f"environment variable {env_name}={text!r}: {exc}") from None
            if field_name in given:
                say(f"mlx-streaming: {env_name}={text} in the environment is overridden by the command line")
            else:
                values[field_name] = value
                say(f"mlx-streaming: {env_name}={text} from the environment")
        for env_name in sorted(environ):
            if env_name.startswith(ENV_PREFIX) and env_name not in ENV_NAMES and env_name not in OTHER_ENV_NAMES:
                say(f"mlx-streaming: {env_name} in the environment is not a setting, ignored (settings: "
                    f"{', '.join(ENV_NAMES)})")
        values.update(given)
        for name, value in dict(defaults).items():
            if not any(n in values for n in (POOL_SIZES if name in POOL_SIZES else (name,))):
                values[name] = value
        return cls(**values)


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    """``"8G"``, ``"512M"``, ``"1.5GB"`` or plain bytes -> bytes (binary units)."""
    s = text.strip().upper().removesuffix("B").removesuffix("I")
    try:
        value = float(s[:-1]) * _UNITS[s[-1]] if s and s[-1] in _UNITS else int(s)
    except ValueError:
        raise ValueError(f"{text!r} is not a size: give bytes or a number with K, M, G or T (e.g. 512M, 2G)") from None
    if value < 0:
        raise ValueError(f"{text!r} is not a size: it is negative")
    return int(value)


def format_size(n: int) -> str:
    """Bytes for people: ``"512 B"``, ``"1.0 KB"``, ``"12.3 MB"``, ``"1.50 GB"`` (binary units, as parse_size)."""
    for unit, digits in (("T", 2), ("G", 2), ("M", 1), ("K", 1)):
        if abs(n) >= _UNITS[unit]:
            return f"{n / _UNITS[unit]:.{digits}f} {unit}B"
    return f"{n} B"


def _flag(text: str) -> bool:
    return text.strip().lower() not in ("0", "false", "no", "off", "")


def _prefetch_env(text: str):
    return "auto" if text.strip().lower() == "auto" else _flag(text)


#: Every environment name read is namespaced, so that a ``K`` or ``PROMPT`` left in a shell changes nothing.
ENV_PREFIX = "MLX_STREAMING_"

#: Environment name -> (StreamingConfig field, parser). Each is ``ENV_PREFIX`` and the field's name in capitals,
#: except ``commit_mode``, named after its flag ``--commit-mode`` (``verify`` is the byte check), and
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
    ENV_PREFIX + "PRELOAD": ("preload", _flag),
    "STG_VERIFY": ("verify", _flag),
}

#: ``MLX_STREAMING_`` names read elsewhere, not settings of this config: the native reader switch
#: (``io/native.py``) and the perf suite's planted slowdown (``perf/test_perf.py``).
OTHER_ENV_NAMES = (ENV_PREFIX + "NATIVE", ENV_PREFIX + "PLANT_S")
