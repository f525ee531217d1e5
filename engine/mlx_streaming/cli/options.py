"""The options every command shares, their types and defaults, and the engine config they make."""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from pathlib import Path

from ..config import DEFAULT_MEMORY_ALLOWANCE, StreamingConfig, format_size, parse_size
from ..residency.policy import EVICTIONS
from ..run_settings import RunSettings
from . import environment
from .environment import ENV_NAMES


DESCRIPTION = """Run Mixture-of-Experts models larger than memory on MLX: dense weights resident, experts
streamed from disk into a bounded pool, output equal to mlx-lm's in-memory model token for token.
Without --model every command uses the embedded default model (a small trained Qwen3-Next)."""

DEFAULTS = StreamingConfig()
RUN_DEFAULTS = RunSettings()

ENV_HELP = ("environment: settings may also come from " + ", ".join(ENV_NAMES) + ". Each one used is named on "
            "stderr; an option on the command line wins. Other names (K, PROMPT, MAXTOK...) are not read.")


class _Parser(argparse.ArgumentParser):
    """argparse's parser whose usage errors are one line (the option and what is wrong), exit status 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _prefetch(text: str):
    if text != "auto":
        raise argparse.ArgumentTypeError(f"expected auto or nothing, got {text!r}")
    return text


def _k(text: str):
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number or auto, got {text!r}") from None


def _budget(text: str) -> int:
    from ..plan import auto_memory_budget

    return auto_memory_budget() if text == "auto" else _size(text)


def _default(field: str) -> str:
    value = getattr(DEFAULTS, field)
    return format_size(value) if field == "staging_bytes" else repr(value)


def _add_model_options(p: argparse.ArgumentParser) -> None:
    """What every command that builds a streaming model takes: the model, the pool, the reads."""
    p.epilog = ENV_HELP
    g = p.add_argument_group("model and expert pool (at most one of --pool-slots, --pool-bytes, --pool-fraction, "
                             "--memory-budget; none: every expert resident where the whole model fits in memory, "
                             "else the pool --memory-budget auto gives)")
    g.add_argument("--model", type=Path, metavar="DIR", help="model folder (default: the embedded default model)")
    g.add_argument("--pool-slots", type=int, metavar="N", help="resident experts per MoE layer")
    g.add_argument("--pool-bytes", type=_size, metavar="SIZE", help="bytes of resident experts, all layers together, e.g. 2G")
    g.add_argument("--pool-fraction", type=float, metavar="F",
                   help="the share of each MoE layer's experts kept resident, e.g. 0.25")
    g.add_argument("--memory-budget", type=_budget, metavar="SIZE",
                   help="bytes for the whole process, e.g. 24G, or auto (80%% of the memory available now); the pool "
                        f"gets what the dense weights, {format_size(DEFAULT_MEMORY_ALLOWANCE)} for caches (a quarter "
                        "of a budget under four times that) and prefetch staging leave")
    g.add_argument("--preload", action="store_true", default=None,
                   help="read every expert into the pool at build (needs a pool that holds every expert): nothing "
                        "is read while decoding and no forward waits for a miss check (MLX_STREAMING_PRELOAD=1)")
    g.add_argument("--io-mode", choices=("buffered", "direct"),
                   help=f"read experts through the page cache or bypass it (default {DEFAULTS.io_mode})")
    g.add_argument("--read-threads", type=int, metavar="N",
                   help="reads in flight per read call: every range a MoE layer call misses is issued at once, N at "
                        f"a time (default {DEFAULTS.read_threads}; bench --io names the disk's best)")
    g.add_argument("--packed", dest="packed_dir", metavar="DIR", help="read experts from this packed layout (mlx-streaming repack)")
    g.add_argument("--verify", action="store_true", default=None,
                   help="byte truth: check every expert placed into the pool against its checksum (STG_VERIFY=1)")
    g.add_argument("--miss-check", choices=("forward", "layer"),
                   help="check that routed experts are resident once per forward, rerunning it layer by layer "
                        "after a miss (forward), or at every MoE layer (layer) (default forward)")
    g.add_argument("--eviction", choices=EVICTIONS,
                   help="which expert a full layer pool evicts: the least frequently (lfu) or least recently (lru) "
                        f"routed (default {DEFAULTS.eviction}; plan --trace compares them on a recorded trace)")
    g = p.add_argument_group("prefetch")
    g.add_argument("--prefetch", nargs="?", const=True, default=None, type=_prefetch, metavar="auto",
                   help="read predicted experts in the background; --prefetch auto: on or off, whichever decodes "
                        "faster, measured while decoding")
    g.add_argument("--ahead", dest="prefetch_ahead", type=int, choices=(0, 1),
                   help=f"predict this layer's (0) or the next layer's (1) experts (default {DEFAULTS.prefetch_ahead})")
    g.add_argument("--mult", dest="prefetch_mult", type=int, metavar="M",
                   help=f"predict top_k x MULT experts per token (default {DEFAULTS.prefetch_mult})")
    g.add_argument("--staging-bytes", type=_size, metavar="SIZE",
                   help=f"host bytes the prefetcher may hold, e.g. 64M (default {_default('staging_bytes')})")
    g.add_argument("--diagnostics", action="store_true", default=None,
                   help="print read and place times, and with --prefetch the predictor's recall and miss attribution")


def _add_generation_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("generation")
    g.add_argument("--prompt", metavar="TEXT", help=f"prompt text (default {RUN_DEFAULTS.prompt!r})")
    g.add_argument("--max-tokens", type=int, metavar="N", help=f"tokens to generate (default {RUN_DEFAULTS.max_tokens})")


def _settings(args):
    """(engine config, run settings): every option whose destination is a field of either, over the
    environment's ``MLX_STREAMING_`` names (each named on stderr when used), over the command's own defaults
    (``config_defaults``). Made once per command: the environment is announced once."""
    if getattr(args, "settings", None) is None:
        fields = environment.ENGINE_FIELDS | environment.RUN_FIELDS
        given = {name: getattr(args, name) for name in fields if hasattr(args, name)}
        args.settings = environment.settings(defaults=_command_defaults(args), say=_say, **given)
    return args.settings


def _config(args) -> StreamingConfig:
    """The engine's knobs of this command (``_settings``)."""
    return _settings(args)[0]


def _run(args) -> RunSettings:
    """What this command decodes and how often (``_settings``)."""
    return _settings(args)[1]


#: ``bench`` with no report option: the default model streamed from disk through a quarter-size pool with the
#: page cache bypassed, beside mlx-lm's in-memory model; an explicit pool size or io mode (option or
#: environment) replaces these.
BENCH_DEFAULTS = {"pool_fraction": 0.25, "io_mode": "direct"}

#: ``bench``'s report options (one at a time); none: the default benchmark.
BENCH_REPORTS = ("processes", "io", "sweep", "prefetch_report", "gate_power", "gate_power_replay", "k_report",
                 "prefetch_auto_report", "overhead", "loops")


def _bench_report(args):
    """The report option ``bench`` was given, or None for the default benchmark (``--processes`` runs the default
    benchmark in fresh processes: its config is the default benchmark's)."""
    return next((name for name in BENCH_REPORTS if getattr(args, name, None) not in (None, False)), None)


#: ``bench``'s runs that take ``BENCH_DEFAULTS`` where nothing else sets a pool size or the io mode: the default
#: benchmark (also in fresh processes) and ``--io``, whose demand rate means nothing at a pool that never misses.
BENCH_DEFAULTED = (None, "processes", "io")


def _command_defaults(args) -> dict:
    defaults = dict(getattr(args, "config_defaults", None) or {})
    if args.command == "bench" and _bench_report(args) in BENCH_DEFAULTED:
        defaults.update(BENCH_DEFAULTS)
    return defaults


def _bench_defaults_used(args, config: StreamingConfig) -> list:
    """The ``BENCH_DEFAULTS`` the default benchmark took (nothing else set a pool size or the io mode)."""
    if args.command != "bench" or _bench_report(args) not in BENCH_DEFAULTED:
        return []
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(StreamingConfig) if hasattr(args, f.name)}
    plain = environment.settings(say=lambda line: None, **given)[0]
    return [name for name in BENCH_DEFAULTS if getattr(config, name) != getattr(plain, name)]


# ----------------------------------------------------------------------------- input checked before work

#: Path options read by a command: destination -> what it must be.

def _flag_of(args, dest: str) -> str:
    return args.flags.get(dest, "--" + dest.replace("_", "-"))


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _model_dir(args) -> Path:
    from ..defaults import default_model

    return args.model or default_model()


def _flags(parser: argparse.ArgumentParser, command: str) -> dict:
    """``{destination: flag}`` of ``command``'s options. argparse has no public way to list a parser's actions,
    so this reads ``_actions``."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    return {a.dest: a.option_strings[0] for a in sub._actions if a.option_strings}


def _with_flags(message: str, flags: dict) -> str:
    """``message`` with every ``field=`` / ``field must`` / ``field is`` of an option's field written as its flag."""
    for dest, flag in flags.items():
        message = re.sub(rf"\b{dest}=", f"{flag} ", message)
        message = re.sub(rf"\b{dest} (must|is)\b", rf"{flag} \1", message)
    return message


def _add_sampling_options(p: argparse.ArgumentParser, max_tokens: int) -> None:
    g = p.add_argument_group("sampling (mlx-lm's sampler)")
    g.add_argument("--max-tokens", type=int, metavar="N", help=f"tokens per answer (default {max_tokens})")
    p.set_defaults(config_defaults={"max_tokens": max_tokens})
    g.add_argument("--temp", type=float, default=0.0, help="temperature; 0 is greedy (default 0)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold (default 1.0)")
