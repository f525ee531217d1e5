"""StreamingConfig: every engine knob in one dataclass (what a run decodes and how often is
``run_settings.RunSettings``).

CLI flags, pytest options and the environment's ``MLX_STREAMING_`` names (``cli.environment``) map onto these
fields; code below the CLI reads the config object, never ``os.environ``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Union

from .errors import ConfigError
from .residency.policy import EVICTIONS
from .run_settings import DEFAULT_PROMPT

IO_MODES = ("buffered", "direct")
#: Native read threads per read call, unless ``read_threads`` says otherwise.
READ_THREADS = 4
#: The knobs that size the expert pool; at most one may be set (none: every expert resident).
POOL_SIZES = ("pool_slots", "pool_bytes", "memory_budget", "pool_fraction")
MISS_CHECKS = ("forward", "layer")

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
    #: Native read threads per read call: a demand load's ranges are all issued at once, this many in flight
    #: (``bench --io`` names the disk's best).
    read_threads: int = READ_THREADS
    #: Read experts from the packed layout in this folder (``mlx-streaming repack``) instead of the shards.
    packed_dir: Optional[str] = None
    #: Count every routed (layer, expert) so that ``store.routed.hot(layer, n)`` can name the hottest experts.
    record: bool = False
    #: Prompt tokens per forward during prefill.
    prefill_chunk: int = 256
    #: Load the MTP head too (its experts stream through the same pool, as one more layer).
    mtp: bool = False
    #: The MTP weights (default: ``mtp.safetensors`` in the model folder).
    mtp_path: Optional[str] = None
    #: Byte-truth verification (STG_VERIFY): check every expert placed into the pool against disk.
    verify: bool = False
    #: Pin the ``pin_hot`` hottest experts of every layer, found by a greedy calibration run of ``pin_cal_tokens``
    #: tokens of ``calibration_prompt`` at build (the commands pass their prompt).
    pin_hot: int = 0
    pin_cal_tokens: int = 32
    calibration_prompt: str = DEFAULT_PROMPT
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
    #: Which resident expert a full layer pool evicts (``residency.policy``): the least frequently routed
    #: ("lfu") or the least recently routed ("lru").
    eviction: str = "lfu"
    #: Measure prediction recall, miss attribution and main-thread timings (costs time; off by default).
    diagnostics: bool = False

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if not self.calibration_prompt:
            raise ConfigError("prompt is empty: give some text to start from")
        if self.io_mode not in IO_MODES:
            raise ConfigError(f"io_mode must be one of {', '.join(IO_MODES)}, got {self.io_mode!r}")
        if self.miss_check not in MISS_CHECKS:
            raise ConfigError(f"miss_check must be one of {', '.join(MISS_CHECKS)}, got {self.miss_check!r}")
        if self.eviction not in EVICTIONS:
            raise ConfigError(f"eviction must be one of {', '.join(EVICTIONS)}, got {self.eviction!r}")
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
        for name in ("prefill_chunk", "pin_cal_tokens"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.prefetch not in (True, False, "auto"):
            raise ConfigError(f"prefetch must be on, off or auto, got {self.prefetch!r}")
        if self.prefetch_ahead not in (0, 1):
            raise ConfigError(f"prefetch_ahead must be 0 or 1, got {self.prefetch_ahead}")
        for name in ("read_threads", "prefetch_mult", "prefetch_threads", "staging_bytes"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("pin_hot", "memory_allowance", "prefetch_layer_budget", "prefetch_forward_budget"):
            if (getattr(self, name) or 0) < 0:
                raise ConfigError(f"{name} must not be negative, got {getattr(self, name)}")

    def replace(self, **changes) -> "StreamingConfig":
        return dataclasses.replace(self, **changes)

    def with_pool(self, **size) -> "StreamingConfig":
        """This config with the pool sized by ``size`` alone (e.g. ``pool_fraction=0.25``; nothing: every
        expert resident), whatever sized it before."""
        return self.replace(**{**dict.fromkeys(POOL_SIZES), **size})


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
