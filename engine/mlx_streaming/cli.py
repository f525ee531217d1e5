"""The ``mlx-streaming`` console script.

Every engine option maps by name onto a ``StreamingConfig`` field; an error about a field is reported with the
flag the user typed. Errors end in one line and exit status 2, Ctrl-C in one line and 130, never a traceback.

Input is checked before any work (``check_input``): every path for its kind (file or folder), every output path
for a folder it can be written into, every number against what the model and this machine allow, ``serve``'s
address by binding it; only then is the memory plan printed and the model built. Settings taken from the
environment (``MLX_STREAMING_<NAME>``, ``config.ENV_NAMES``) are each named in one line on stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
from pathlib import Path

from .config import DEFAULT_MEMORY_ALLOWANCE, ENV_NAMES, StreamingConfig, format_size, parse_size
from .errors import CheckpointError, ConfigError, OutputError, StreamingError

DESCRIPTION = """Run Mixture-of-Experts models larger than memory on MLX: dense weights resident, experts
streamed from disk into a bounded pool, output equal to mlx-lm's in-memory model token for token.
Without --model every command uses the embedded default model (a small trained Qwen3-Next)."""

DEFAULTS = StreamingConfig()

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
    from .plan import auto_memory_budget

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
    g.add_argument("--packed", dest="packed_dir", metavar="DIR", help="read experts from this packed layout (mlx-streaming repack)")
    g.add_argument("--verify", action="store_true", default=None,
                   help="byte truth: check every expert placed into the pool against its checksum (STG_VERIFY=1)")
    g.add_argument("--miss-check", choices=("token", "layer"),
                   help="check that routed experts are resident once per forward, rerunning it layer by layer "
                        "after a miss (token), or at every MoE layer (layer) (default token)")
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
    g.add_argument("--prompt", metavar="TEXT", help=f"prompt text (default {DEFAULTS.prompt!r})")
    g.add_argument("--max-tokens", type=int, metavar="N", help=f"tokens to generate (default {DEFAULTS.max_tokens})")


def _config(args) -> StreamingConfig:
    """Every option whose destination is a StreamingConfig field, over the environment's ``MLX_STREAMING_``
    names (each named on stderr when used), over the command's own defaults (``config_defaults``). Made once
    per command: the environment is announced once."""
    if getattr(args, "config", None) is None:
        given = {f.name: getattr(args, f.name) for f in dataclasses.fields(StreamingConfig) if hasattr(args, f.name)}
        args.config = StreamingConfig.from_env(defaults=_command_defaults(args), say=_say, **given)
    return args.config


#: ``bench`` with no report option: the default model streamed from disk through a quarter-size pool with the
#: page cache bypassed, beside mlx-lm's in-memory model; an explicit pool size or io mode (option or
#: environment) replaces these.
BENCH_DEFAULTS = {"pool_fraction": 0.25, "io_mode": "direct"}

#: ``bench``'s report options (one at a time); none: the default benchmark.
BENCH_REPORTS = ("processes", "io", "sweep", "prefetch_report", "gate_power", "gate_power_replay", "k_report",
                 "prefetch_auto_report", "overhead")


def _bench_report(args):
    """The report option ``bench`` was given, or None for the default benchmark (``--processes`` runs the default
    benchmark in fresh processes: its config is the default benchmark's)."""
    return next((name for name in BENCH_REPORTS if getattr(args, name, None) not in (None, False)), None)


def _command_defaults(args) -> dict:
    defaults = dict(getattr(args, "config_defaults", None) or {})
    if args.command == "bench" and _bench_report(args) in (None, "processes"):
        defaults.update(BENCH_DEFAULTS)
    return defaults


def _bench_defaults_used(args, config: StreamingConfig) -> list:
    """The ``BENCH_DEFAULTS`` the default benchmark took (nothing else set a pool size or the io mode)."""
    if args.command != "bench" or _bench_report(args) not in (None, "processes"):
        return []
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(StreamingConfig) if hasattr(args, f.name)}
    plain = StreamingConfig.from_env(say=lambda line: None, **given)
    return [name for name in BENCH_DEFAULTS if getattr(config, name) != getattr(plain, name)]


# ----------------------------------------------------------------------------- input checked before work

#: Path options read by a command: destination -> what it must be.
INPUT_PATHS = {"model": "folder", "packed_dir": "folder", "hf": "folder", "trace": "file",
               "gate_power_replay": "file", "gate_power_baseline": "file"}
#: File options a command writes once its work is done: destination -> flag.
OUTPUT_FILES = {"json": "--json", "dump_ids": "--dump-ids", "record_trace": "--record-trace", "plot": "--plot"}
#: Files of a model folder that must be files where they are there (a missing one is reported when read).
MODEL_FILES = ("config.json", "model.safetensors.index.json", "model.safetensors", "mtp.safetensors",
               "tokenizer.json", "tokenizer_config.json", "generation_config.json", "heldout.safetensors",
               "training_report.json", "heldout_pytorch.json")
#: Counts a command takes outside the StreamingConfig: destination -> least value.
COUNTS = {"processes": 1, "loss_sequences": 1, "prompts": 1, "new_tokens": 1}
#: Seeds: what both numpy's and MLX's generators take.
SEED_RANGE = (0, 2 ** 64 - 1)


def _flag_of(args, dest: str) -> str:
    return args.flags.get(dest, "--" + dest.replace("_", "-"))


def _check_kind(option: str, path, kind: str) -> None:
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"{option} {path}: cannot read it (no such {kind})")
    if kind == "folder" and not path.is_dir():
        raise ConfigError(f"{option} {path}: is a file, not a folder; {option} takes a folder")
    if kind == "file" and path.is_dir():
        raise ConfigError(f"{option} {path}: is a folder, not a file; {option} takes a file")


def _check_output_file(option: str, path) -> None:
    """``path`` can be written once the work is done: not a folder, in a folder that exists and is writable."""
    path = Path(path)
    folder = path.parent
    if path.is_dir():
        raise OutputError(f"{option} {path}: is a folder; give the name of the file to write (nothing was run)")
    if not folder.is_dir():
        raise OutputError(f"{option} {path}: folder {folder} does not exist (nothing was run)")
    if not os.access(folder, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise OutputError(f"{option} {path}: cannot write there (permission denied; nothing was run)")


def _check_output_target(option: str, path) -> None:
    """A file or folder a command creates with its parents (``--out``): the nearest folder that exists is writable."""
    ancestor = Path(path).absolute().parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise OutputError(f"{option} {path}: {ancestor} is a file, not a folder")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise OutputError(f"{option} {path}: cannot write in {ancestor} (permission denied)")


def _check_model_folder(option: str, folder: Path) -> None:
    """Every file the checkpoint is read from, where it is there, is a file (a folder of that name is refused)."""
    names = list(MODEL_FILES)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            names += sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass  # reported, with its reason, when the checkpoint is opened
    for name in names:
        if (folder / name).is_dir():
            raise CheckpointError(f"{option} {folder}: {name} is a folder, not a file")


def _check_address(host: str, port: int) -> None:
    """``serve --host/--port``: a port that can be, a host that resolves, an address this process may bind."""
    import socket

    if not 1 <= port <= 65535:
        raise ConfigError(f"--port {port}: not a TCP port (1 to 65535)")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                              flags=socket.AI_PASSIVE)[0]
    except (socket.gaierror, UnicodeError) as exc:
        raise ConfigError(f"--host {host}: not an address of this machine ({getattr(exc, 'strerror', None) or exc})") from None
    probe = socket.socket(family, kind, proto)
    try:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as mlx-lm's HTTP server binds
        probe.bind(address)
    except OSError as exc:
        raise ConfigError(f"--host {host} --port {port}: cannot listen there ({exc.strerror})") from None
    finally:
        probe.close()


def check_input(args) -> None:
    """What can be checked from the command line alone, before any file is read: numbers outside the config,
    path kinds, output folders, ``serve``'s address."""
    for dest, least in COUNTS.items():
        value = getattr(args, dest, None)
        if value is not None and value < least:
            raise ConfigError(f"{_flag_of(args, dest)} {value}: must be at least {least}")
    if getattr(args, "seed", None) is not None and not SEED_RANGE[0] <= args.seed <= SEED_RANGE[1]:
        raise ConfigError(f"--seed {args.seed}: seeds run from 0 to 2**64-1")
    if getattr(args, "temp", None) is not None and args.temp < 0:
        raise ConfigError(f"--temp {args.temp}: a temperature is 0 (greedy) or more")
    if getattr(args, "top_p", None) is not None and not 0 < args.top_p <= 1:
        raise ConfigError(f"--top-p {args.top_p}: a nucleus threshold is above 0 and at most 1")
    if getattr(args, "disk_gbps", None) is not None and args.disk_gbps <= 0:
        raise ConfigError(f"--disk-gbps {args.disk_gbps}: a disk rate is above 0")
    if args.command == "plan" and not args.trace:
        for dest in ("json", "plot", "pin_hot"):
            if getattr(args, dest) is not None:
                raise ConfigError(f"{_flag_of(args, dest)}: only with --trace FILE (the plan itself is printed)")
    if getattr(args, "gate_power_base", None) and not args.gate_power:
        raise ConfigError(f"--gate-power-base {args.gate_power_base}: only with --gate-power")
    if getattr(args, "gate_power_baseline", None) and not args.gate_power_replay:
        raise ConfigError(f"--gate-power-baseline {args.gate_power_baseline}: only with --gate-power-replay FILE")
    if args.command == "bench" and getattr(args, "dump_ids", None) and _bench_report(args) is not None:
        raise ConfigError(f"--dump-ids {args.dump_ids}: only in the default benchmark, not with "
                          f"{_flag_of(args, _bench_report(args))}")
    for dest, kind in INPUT_PATHS.items():
        if getattr(args, dest, None) is not None:
            _check_kind(_flag_of(args, dest), getattr(args, dest), kind)
    if getattr(args, "model", None) is not None:
        _check_model_folder("--model", Path(args.model))
    for dest, option in OUTPUT_FILES.items():
        if getattr(args, dest, None):
            _check_output_file(option, getattr(args, dest))
    if getattr(args, "plot", None):
        import importlib.util

        if Path(args.plot).suffix.lower() != ".png":
            raise OutputError(f"--plot {args.plot}: name the file to write *.png")
        if importlib.util.find_spec("matplotlib") is None:
            raise ConfigError("--plot needs matplotlib: pip install 'mlx-streaming[plot]'")
    if getattr(args, "out", None) is not None:
        out = Path(args.out)
        if args.command == "extract-mtp":
            if out.is_dir():
                raise OutputError(f"--out {out.absolute()}: is a folder; give the name of the file to write")
            if out.suffix != ".safetensors":
                raise OutputError(f"--out {out.absolute()}: name the file to write *.safetensors")
        elif out.exists() and not out.is_dir():
            raise OutputError(f"--out {out.absolute()}: is a file, not a folder; give a new or empty folder")
        _check_output_target("--out", out)
    if args.command == "serve":
        _check_address(args.host, args.port)


def _machine_memory() -> int:
    import psutil

    return psutil.virtual_memory().total


def check_config(args, config: StreamingConfig) -> None:
    """The config against the files it names and this machine: paths from the environment, byte sizes."""
    if config.dump_ids and args.command == "bench" and not getattr(args, "dump_ids", None):
        _check_output_file("MLX_STREAMING_DUMP_IDS", config.dump_ids)
    if config.mtp_path:
        _check_kind("MLX_STREAMING_MTP_PATH", config.mtp_path, "file")
    memory = _machine_memory()
    for name in ("pool_bytes", "memory_budget", "staging_bytes"):
        value = getattr(config, name)
        if value is not None and value > memory:
            raise ConfigError(f"{name}={format_size(value)} is more than this machine's memory ({format_size(memory)})")


def _model_limits(model_dir: Path) -> dict:
    """What the model allows, from its config.json: context length, experts per layer, experts per token."""
    from .adapters.switch_layers import experts_per_token
    from .model import read_config

    model_config = read_config(model_dir)
    scopes = (model_config, model_config.get("text_config") or {})
    positions = next((s["max_position_embeddings"] for s in scopes if s.get("max_position_embeddings")), None)
    return {"max_positions": positions, "top_k": experts_per_token(model_config)}


def check_against_model(args, config: StreamingConfig, plan) -> None:
    """Numbers the model bounds, from its config.json and the memory plan (headers only, nothing loaded)."""
    limits = _model_limits(_model_dir(args))
    top_k, positions = limits["top_k"], limits["max_positions"]
    if positions:
        lengths = {"max_tokens": config.max_tokens, "pin_cal_tokens": config.pin_cal_tokens,
                   "warmup_tokens": config.warmup_tokens, "new_tokens": getattr(args, "new_tokens", None)}
        for name, value in lengths.items():
            if value is not None and value > positions:
                raise ConfigError(f"{_flag_of(args, name)} {value}: more tokens than the model's context "
                                  f"(max_position_embeddings={positions})")
    if config.prefetch and config.prefetch_mult * top_k > plan.num_experts:
        raise ConfigError(f"{_flag_of(args, 'prefetch_mult')} {config.prefetch_mult}: predicts num_experts_per_tok="
                          f"{top_k} x {config.prefetch_mult} experts of a layer's {plan.num_experts}; at most "
                          f"{plan.num_experts // top_k}")
    if config.pin_hot and config.pin_hot > plan.slots - top_k:
        raise ConfigError(f"{_flag_of(args, 'pin_hot')} {config.pin_hot}: the pool holds {plan.slots} experts per "
                          f"layer and num_experts_per_tok={top_k} must stay unpinned; at most {plan.slots - top_k}")
    if args.command == "evaluate":
        from .checkpoint.safetensors import read_header
        from .harness.evaluate import HELDOUT_FILE

        heldout = Path(_model_dir(args)) / HELDOUT_FILE
        tokens = read_header(heldout).get("tokens") if heldout.is_file() else None
        if tokens is not None and tokens.shape:
            sequences = tokens.shape[0]
            for dest in ("loss_sequences", "prompts"):
                if getattr(args, dest) > sequences:
                    raise ConfigError(f"{_flag_of(args, dest)} {getattr(args, dest)}: {heldout} holds {sequences} "
                                      f"held-out sequences")


def _model_dir(args) -> Path:
    from .defaults import default_model

    return args.model or default_model()


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _json_file(option: str, path: str):
    try:
        return json.loads(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(f"{option} {path}: cannot read it ({exc.strerror})") from None
    except ValueError as exc:
        raise ConfigError(f"{option} {path}: not valid JSON ({exc})") from None


def _recorded_pools(path: str) -> dict:
    """The pools a ``bench --gate-power --json FILE`` run recorded."""
    recorded = _json_file("--gate-power-replay", path)
    needed = ("bases" if isinstance(recorded, dict) and "bases" in recorded else "baseline", "pools", "tokens", "unit",
              "cost_per_token")
    missing = [key for key in needed if not isinstance(recorded, dict) or key not in recorded]
    if missing:
        raise ConfigError(f"--gate-power-replay {path}: not a `bench --gate-power --json` file "
                          f"(no {', '.join(missing)})")
    return recorded


def _suite_baseline(path: str, unit: str) -> dict:
    """The power study's scenarios' rounds from a baseline the perf suite saved, in the recorded pools' unit."""
    from .harness import gate_power

    saved = _json_file("--gate-power-baseline", path)
    try:
        baseline = gate_power.suite_baseline(saved if isinstance(saved, dict) else {})
    except ValueError as exc:
        raise ConfigError(f"--gate-power-baseline {path}: not a perf suite baseline ({exc})") from None
    if baseline["unit"] != unit:
        raise ConfigError(f"--gate-power-baseline {path}: its costs are in {baseline['unit']}, the recorded pools' "
                          f"in {unit}")
    return baseline["pools"]


def _write_json(path: str, result) -> None:
    try:
        Path(path).write_text(json.dumps(result, indent=2))
    except OSError as exc:
        raise OutputError(f"--json {path}: cannot write it ({exc.strerror})") from None


def cmd_synth(args) -> None:
    if args.arch:
        from .harness.arch_synth import synth_arch

        if args.layers is not None:
            raise ConfigError("--layers: applies to the Qwen3-Next presets; an --arch checkpoint has its own layers")
        print(synth_arch(args.out, args.arch, seed=args.seed))
        return
    from .harness.synth import synth_checkpoint

    print(synth_checkpoint(args.out, preset=args.preset, seed=args.seed, layout=args.layout, layers=args.layers))


def cmd_generate(args) -> None:
    from .generate import greedy_steps
    from .model import build_streaming_model
    from .harness.report import counters_line, diagnostics_report

    config = _config(args)
    with build_streaming_model(_model_dir(args), config) as sm:
        tokenizer = sm.tokenizer
        detok = tokenizer.detokenizer
        detok.reset()
        generated, decode_from = 0, None
        prompt_ids = tokenizer.encode(config.prompt)
        if args.record_trace:
            sm.store.route_log = []
        for token, _ in greedy_steps(sm.model, prompt_ids, config.max_tokens, config.prefill_chunk):
            if decode_from is None and args.record_trace:
                decode_from = len(sm.store.route_log)
            if token in tokenizer.eos_token_ids:
                break
            generated += 1
            detok.add_token(token)
            print(detok.last_segment, end="", flush=True)
        detok.finalize()
        print(detok.last_segment)
        stats = sm.store.stats()
        _say(counters_line(stats, f"the prompt's prefill and {generated} generated tokens"))
        if config.diagnostics:
            _say(diagnostics_report(sm.store))
        _say(json.dumps(stats))
        if args.record_trace:
            from .residency.trace import write_trace

            write_trace(args.record_trace, sm.store, len(prompt_ids), generated, decode_from)
            _say(f"routing trace: {len(sm.store.route_log)} MoE layer calls written to {args.record_trace}")


def cmd_chat(args) -> None:
    from .harness.chat import chat

    chat(_model_dir(args), _config(args), temp=args.temp, top_p=args.top_p, seed=args.seed)


def cmd_serve(args) -> None:
    from .harness.serve import serve

    model_dir = _model_dir(args)
    serve(model_dir, _with_head(model_dir, _config(args)), host=args.host, port=args.port, temp=args.temp, top_p=args.top_p)


def _add_sampling_options(p: argparse.ArgumentParser, max_tokens: int) -> None:
    g = p.add_argument_group("sampling (mlx-lm's sampler)")
    g.add_argument("--max-tokens", type=int, metavar="N", help=f"tokens per answer (default {max_tokens})")
    p.set_defaults(config_defaults={"max_tokens": max_tokens})
    g.add_argument("--temp", type=float, default=0.0, help="temperature; 0 is greedy (default 0)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold (default 1.0)")


def cmd_evaluate(args) -> None:
    from .harness.evaluate import evaluate

    result = evaluate(_model_dir(args), _config(args), loss_sequences=args.loss_sequences, prompts=args.prompts,
                      new_tokens=args.new_tokens)
    print(json.dumps(result, indent=2))
    if args.json:
        _write_json(args.json, result)


def cmd_plan(args) -> None:
    if args.trace:
        from .residency.trace import curve, read_trace
        from .harness.report import trace_table

        trace = read_trace(args.trace)
        most = trace["num_experts"] - trace["top_k"]
        if not 0 <= (args.pin_hot or 0) <= most:
            raise ConfigError(f"--pin-hot {args.pin_hot}: the trace's model has {trace['num_experts']} experts per "
                              f"layer and routes {trace['top_k']} per token; pin 0 to {most}")
        rows = curve(trace, args.disk_gbps * 1e9, args.pin_hot or 0)
        print(trace_table(rows, args.disk_gbps, args.pin_hot or 0))
        if args.plot:
            from .harness.curve_plot import write_plot

            write_plot(rows, args.plot, args.disk_gbps, args.pin_hot or 0)
            _say(f"plot written to {args.plot}")
        if args.json:
            _write_json(args.json, rows)
        return
    print(_with_flags(_plan_of(args).describe(), args.flags))


def _plan_of(args):
    """The memory plan of the model this command builds, the MTP head included where it loads one."""
    from .model import plan_memory

    if getattr(args, "plan", None) is None:
        model_dir, config = _model_dir(args), _config(args)
        if args.command in WITH_HEAD:
            config = _with_head(model_dir, config)
        args.plan = plan_memory(model_dir, config)
    return args.plan


def _with_head(model_dir, config):
    """``config`` with the MTP head loaded where the model folder has one (or ``--mtp-path`` names one)."""
    return config.replace(mtp=(Path(model_dir) / "mtp.safetensors").exists() or bool(config.mtp_path))


#: Commands that build a streaming model (each prints its memory plan first), and those that load the MTP head.
BUILDS = ("generate", "bench", "chat", "serve", "evaluate")
WITH_HEAD = ("bench", "evaluate", "plan", "serve")


def _configured(args) -> bool:
    """Whether the command runs on a StreamingConfig and a model's memory plan (checked before it starts)."""
    if args.command == "plan":
        return not args.trace
    return args.command in BUILDS and not getattr(args, "gate_power_replay", None)


def cmd_bench(args) -> None:
    from .harness import bench

    if args.processes is not None:
        result = bench.noise_floor(_without(args.argv, ("--processes", "--json", "--dump-ids")), args.processes)
        print(json.dumps(result, indent=2))
    elif args.io:
        result = bench.io_report(_model_dir(args), _config(args))
        print(bench.io_table(result))
    elif args.sweep:
        result = bench.sweep(_model_dir(args), _config(args))
        print(bench.sweep_table(result))
    elif args.prefetch_report:
        result = bench.prefetch_report(_model_dir(args), _config(args))
        print(bench.prefetch_table(result))
    elif args.gate_power:
        from .harness import gate_power

        if args.gate_power_base:
            from .harness.side_by_side import BaseUnavailable

            try:
                result = gate_power.side_by_side_study(Path.cwd(), args.gate_power_base, _model_dir(args),
                                                       _config(args))
            except BaseUnavailable as exc:
                raise ConfigError(f"--gate-power-base {args.gate_power_base}: {exc}") from None
        else:
            result = gate_power.study(_model_dir(args), _config(args))
        print(gate_power.table(result))
    elif args.gate_power_replay:
        from .harness import gate_power

        recorded = _recorded_pools(args.gate_power_replay)
        against = args.gate_power_baseline and _suite_baseline(args.gate_power_baseline, recorded["unit"])
        result = gate_power.replay(recorded, baseline=against or None)
        print(gate_power.table(result))
    elif args.k_report:
        result = bench.k_report(_model_dir(args), _config(args))
        print(bench.auto_table(result, "K"))
    elif args.prefetch_auto_report:
        result = bench.prefetch_auto_report(_model_dir(args), _config(args))
        print(bench.auto_table(result, "prefetch"))
    elif args.overhead:
        result = bench.overhead_report(_model_dir(args), _config(args))
        print(bench.overhead_table(result))
    else:
        result = bench.run(_model_dir(args), _config(args), compare_inmemory=args.compare_inmemory)
        print(bench.table(result))
    if args.json:
        _write_json(args.json, result)


def _without(argv, options) -> list:
    """``argv`` less each of ``options`` with its value (``--opt VALUE`` or ``--opt=VALUE``)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in options:
            skip = True
        elif not arg.startswith(tuple(f"{o}=" for o in options)):
            out.append(arg)
    return out


def cmd_repack(args) -> None:
    from .checkpoint.packed import repack
    from .model import open_checkpoint

    model_dir = _model_dir(args)
    has_mtp = (model_dir / "mtp.safetensors").exists()
    print(repack(open_checkpoint(model_dir, StreamingConfig(mtp=has_mtp)).index, args.out))


def cmd_checksum(args) -> None:
    from .checkpoint.manifest import MANIFEST_FILE, read_manifest, write_manifest
    from .checkpoint.packed import packed_index
    from .errors import OutputError
    from .model import open_checkpoint

    model_dir = _model_dir(args)
    index = open_checkpoint(model_dir, StreamingConfig(mtp=(model_dir / "mtp.safetensors").exists())).index
    targets = [(model_dir, index)] + ([(args.packed_dir, packed_index(index, args.packed_dir))] if args.packed_dir else [])
    for folder, folder_index in targets:
        existing = read_manifest(folder)
        if existing and not args.replace:
            raise OutputError(f"{Path(folder) / MANIFEST_FILE}: already there (written by {existing['written_by']}); "
                              f"pass --replace to take new checksums from the files as they are now")
    for folder, folder_index in targets:
        print(write_manifest(folder_index, folder, "checksum"))


def cmd_limit(args) -> None:
    from . import cgroup

    command = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not command:
        raise ConfigError("give the command to run after --, e.g. limit --memory 4G -- mlx-streaming generate")
    if args.memory < 1 << 20:
        raise ConfigError(f"--memory {args.memory}: a limit below 1 MB leaves nothing to start a process with")
    try:
        run = cgroup.limited_run(command, args.memory, capture=False)
    except cgroup.LimitUnavailable as exc:
        raise ConfigError(f"--memory: {exc}") from None
    except FileNotFoundError:
        raise ConfigError(f"{command[0]}: no such command") from None
    peak = "unknown" if run.peak_bytes is None else format_size(run.peak_bytes)
    ended = "killed by the kernel for memory" if run.killed_for_memory else f"exit status {run.returncode}"
    _say(f"mlx-streaming limit: peak {peak} under a {format_size(args.memory)} limit (the memory cgroup's maximum "
         f"usage: resident memory and page cache); {ended}")
    raise SystemExit(run.returncode if run.returncode >= 0 else 128 - run.returncode)


def cmd_extract_mtp(args) -> None:
    from .checkpoint.mtp_extract import extract_mtp

    print(extract_mtp(args.hf, args.out, bits=args.bits, group_size=args.q_group_size))


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = _Parser(prog="mlx-streaming", description=DESCRIPTION, epilog=ENV_HELP)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("generate", help="greedy generation with streamed experts",
                       description="Greedy generation with streamed experts; text on stdout, pool and counters on stderr.")
    _add_model_options(p)
    _add_generation_options(p)
    p.add_argument("--record-trace", metavar="FILE",
                   help="write which experts each MoE layer call routed to (prompt and decode), for plan --trace")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("plan", help="the memory plan (dense weights, pool, head, staging, margin), nothing loaded",
                       description="What a streaming model of these options will hold, from the checkpoint's headers "
                                   "alone: every command that builds a model prints it before loading.")
    _add_model_options(p)
    g = p.add_argument_group("pool-size curve from a routing trace (generate --record-trace)")
    g.add_argument("--trace", metavar="FILE", help="replay this trace at every pool size instead")
    g.add_argument("--disk-gbps", type=float, default=2.0, metavar="GB/S",
                   help="disk read rate for the I/O-bound decode rate (default 2.0)")
    g.add_argument("--pin-hot", type=int, metavar="N", help="pin each layer's N most routed experts of the trace")
    g.add_argument("--json", metavar="FILE", help="write the curve here")
    g.add_argument("--plot", metavar="FILE.png", help="draw the curve into this PNG (needs the plot extra: matplotlib)")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("bench", help="streaming vs mlx-lm's in-memory model: tok/s, hit rate, bytes read, memory",
                       description="By default: the model streamed from disk through a bounded pool (--pool-fraction "
                                   f"{BENCH_DEFAULTS['pool_fraction']} with --io-mode {BENCH_DEFAULTS['io_mode']} "
                                   "unless a pool size or io mode is given), greedy and MTP speculative decoding, "
                                   "beside mlx-lm's in-memory model: tok/s, x in-memory, hit rate, bytes read, "
                                   "memory, ids equal. Or one of the reports below.")
    _add_model_options(p)
    _add_generation_options(p)
    g = p.add_argument_group("speculation and timing")
    g.add_argument("--k", type=_k, help="tokens per verify: 1 + K-1 MTP drafts, or auto: chosen while decoding "
                                        f"from measured step costs and acceptance (default {DEFAULTS.k})")
    g.add_argument("--commit-mode", dest="verify_mode", choices=("direct", "replay"),
                   help="how Gated-DeltaNet state is committed after a partial accept: keep the per-position states "
                        f"(direct) or restore a snapshot and replay (default {DEFAULTS.verify_mode})")
    g.add_argument("--warmup", dest="warmup_tokens", type=int, metavar="N",
                   help=f"warm-up tokens per path before the timed runs (default {DEFAULTS.warmup_tokens})")
    g.add_argument("--repeat", type=int, metavar="N", help=f"timed runs per path, medians reported (default {DEFAULTS.repeat})")
    g.add_argument("--pin-hot", type=int, metavar="N", help="pin each layer's N hottest experts, found by a calibration run")
    g.add_argument("--pin-cal-tokens", type=int, metavar="N",
                   help=f"tokens of the pin-hot calibration run (default {DEFAULTS.pin_cal_tokens})")
    g.add_argument("--dump-ids", metavar="FILE", help="write the greedy and speculative ids to this JSON file")
    g.add_argument("--compare-inmemory", action=argparse.BooleanOptionalAction, default=True,
                   help="also time mlx-lm's in-memory model in this process, the default benchmark's first row "
                        "(default on; --no-compare-inmemory skips it)")
    g.add_argument("--json", metavar="FILE", help="write the full result here")
    reports = p.add_argument_group("reports (one at a time)")
    modes = reports.add_mutually_exclusive_group()
    modes.add_argument("--sweep", action="store_true",
                       help="greedy only: in-memory vs streaming at 100%% and 25%% pools, both io modes")
    modes.add_argument("--io", action="store_true",
                       help="disk: raw read rate at the expert size vs the engine's demand-load rate (greedy)")
    modes.add_argument("--prefetch-report", action="store_true",
                       help="greedy: naive, LRU, LRU + prefetch (ahead 0/1, mult 1/2) side by side, with diagnostics")
    modes.add_argument("--k-report", action="store_true",
                       help="MTP speculation at K = 1, 2, 3, 4 and auto, interleaved: tok/s and auto over the best K")
    modes.add_argument("--prefetch-auto-report", action="store_true",
                       help="greedy with prefetch off, on and auto, interleaved: tok/s and auto over the better")
    modes.add_argument("--overhead", action="store_true",
                       help="the engine's own cost per token: in-memory vs streaming with the miss check per layer "
                            "and per token (host syncs, wait), greedy and MTP")
    modes.add_argument("--gate-power", action="store_true",
                       help="how often the perf gate catches planted 5/10/20%% slowdowns and fails an unchanged "
                            "tree, quiet and beside two busy loops (about 25 minutes here; --json FILE keeps the "
                            "recorded rounds)")
    modes.add_argument("--gate-power-replay", metavar="FILE",
                       help="the power study's simulated gate runs again, under the current rule, on the rounds a "
                            "--gate-power --json FILE run recorded (nothing measured)")
    modes.add_argument("--processes", type=int, metavar="N",
                       help="noise floor: run the default benchmark in N fresh processes, report the spread")
    reports.add_argument("--gate-power-base", metavar="REV",
                         help="with --gate-power: study the side-by-side gate instead: git revision REV's engine "
                              "(exported and built apart) in rounds alternating with this tree's, planted 10%% and "
                              "20%% slowdowns in this tree's only (about 20 minutes here)")
    reports.add_argument("--gate-power-baseline", metavar="FILE",
                         help="with --gate-power-replay: judge the recorded pools against this baseline the perf "
                              "suite saved (baselines/<machine>/NNNN_baseline.json) instead of the study's own "
                              "baseline pool")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("chat", help="chat interactively, answers streamed as they come, with mlx-lm's sampler",
                       description="Chat on a streaming model through mlx-lm's stream_generate. Ctrl-C ends the answer; "
                                   "Ctrl-D ends the session.")
    _add_model_options(p)
    _add_sampling_options(p, 256)
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (mlx-lm's) on a streaming model",
                       description="mlx-lm's OpenAI-compatible server (/v1/chat/completions, /v1/completions, "
                                   "/v1/models, streaming) on a streaming model built with the options below.")
    _add_model_options(p)
    _add_sampling_options(p, 512)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="port to listen on (default 8080)")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("evaluate", help="a trained model against its training report: held-out loss, MTP acceptance",
                       description="Held-out loss and MTP acceptance of a trained model (the default one unless "
                                   "--model), against the figures of its training run.")
    _add_model_options(p)
    p.add_argument("--loss-sequences", type=int, default=8, help="held-out sequences for the loss (about 25 s each on a CPU) (default 8)")
    p.add_argument("--prompts", type=int, default=16, help="held-out prompts for the acceptance measurement (default 16)")
    p.add_argument("--new-tokens", type=int, default=96, help="tokens generated per prompt (default 96)")
    p.add_argument("--json", metavar="FILE", help="write the result here")
    p.set_defaults(func=cmd_evaluate)

    p = sub.add_parser("synth", help="write a synthetic checkpoint (Qwen3-Next presets, or any supported --arch)",
                       description="Write a synthetic checkpoint (random weights, real layout). --out must be a new or "
                                   "empty folder, or one synth wrote before (then it is replaced).")
    p.add_argument("--preset", default="tiny", choices=("tiny", "small", "medium", "qwen3-next-80b"),
                   help="size: tiny (~10 MB), small (~380 MB), medium (~2.8 GB), or qwen3-next-80b: "
                        "Qwen3-Next-80B-A3B's published config at full size (~45 GB, written as a stream in "
                        "minutes, mlx layout only) (default tiny)")
    p.add_argument("--layers", type=int, metavar="N",
                   help="N decoder layers instead of the preset's, every per-layer shape kept (at least 4: "
                        "every 4th layer is full attention, and the model needs one)")
    p.add_argument("--out", type=Path, metavar="DIR", required=True, help="the folder to write")
    p.add_argument("--seed", type=int, default=0, help="the same seed gives byte-identical files (default 0)")
    p.add_argument("--layout", default="mlx", choices=("mlx", "hf"),
                   help="mlx: the 4-bit MLX conversion layout; hf: the original bf16 layout (default mlx)")
    p.add_argument("--arch", metavar="NAME",
                   help="instead of a Qwen3-Next preset, a tiny checkpoint of this mlx-lm MoE architecture "
                        "(model_type, e.g. mixtral, deepseek_v3), written by mlx-lm's own classes and save code")
    p.set_defaults(func=cmd_synth)

    p = sub.add_parser("repack", help="write the experts in the packed layout (one aligned record per expert)",
                       description="Write the experts in the packed layout, then read them with --packed DIR. --out "
                                   "must be a new or empty folder, or one repack wrote before.")
    p.add_argument("--model", type=Path, metavar="DIR", help="model folder (default: the embedded default model)")
    p.add_argument("--out", type=Path, metavar="DIR", required=True, help="the folder to write")
    p.set_defaults(func=cmd_repack)

    p = sub.add_parser("checksum", help="write the checksum manifest --verify checks experts against",
                       description="Checksum every expert of a checkpoint made elsewhere (e.g. by mlx_lm.convert) "
                                   "into expert-checksums.json beside its files; --verify then checks every expert "
                                   "placed into the pool against it. synth, repack and extract-mtp write one already.")
    p.add_argument("--model", type=Path, metavar="DIR", help="model folder (default: the embedded default model)")
    p.add_argument("--packed", dest="packed_dir", metavar="DIR", type=Path, help="also checksum this packed layout")
    p.add_argument("--replace", action="store_true",
                   help="take new checksums from the files as they are now, over an existing manifest")
    p.set_defaults(func=cmd_checksum)

    p = sub.add_parser("extract-mtp", help="pull mtp.* out of an original-layout checkpoint",
                       description="Convert the MTP head of an original-layout (Hugging Face) checkpoint, which "
                                   "mlx_lm.convert drops, into the file --mtp reads (mtp.safetensors).")
    p.add_argument("--hf", type=Path, metavar="DIR", required=True, help="the original-layout checkpoint folder")
    p.add_argument("--out", type=Path, metavar="DIR", required=True,
                   help="the file to write (usually MODEL/mtp.safetensors); a new file, or one extract-mtp wrote")
    p.add_argument("--bits", type=int, default=4, choices=(2, 3, 4, 6, 8), help="expert and projection bits (default 4)")
    p.add_argument("--q-group-size", type=int, default=64, choices=(32, 64, 128),
                   help="quantization group size, as mlx_lm.convert's option of that name (default 64)")
    p.set_defaults(func=cmd_extract_mtp)

    p = sub.add_parser("limit", help="run a command under a hard memory limit and say its peak memory",
                       description="Run COMMAND in a memory cgroup of --memory bytes (Linux; root or a delegated "
                                   "cgroup): the kernel kills it if it grows past the limit. Then say its peak "
                                   "memory (the cgroup's maximum usage) and exit with its exit status. Example: "
                                   "mlx-streaming limit --memory 4G -- pytest -m exact --streaming-model DIR")
    p.add_argument("--memory", type=_size, metavar="SIZE", required=True, help="the limit, e.g. 4G")
    p.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- COMMAND ...", help="the command and its arguments")
    p.set_defaults(func=cmd_limit)
    return parser


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


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        args.argv = argv[argv.index(args.command) + 1:]
        args.flags = _flags(parser, args.command)
        check_input(args)
        if _configured(args):
            config = _config(args)
            check_config(args, config)
            plan = _plan_of(args)
            check_against_model(args, config, plan)
            used = _bench_defaults_used(args, config)
            if used:
                _say(f"mlx-streaming bench: {', '.join(f'{_flag_of(args, n)} {getattr(config, n)}' for n in used)}: "
                     f"the benchmark's default, beside mlx-lm's in-memory model (--pool-fraction 1 keeps every "
                     f"expert resident, --io-mode buffered reads through the page cache)")
            if args.command in BUILDS and getattr(args, "processes", None) is None:
                _say(_with_flags(plan.describe(), args.flags))
        args.func(args)
    except StreamingError as exc:
        print(f"mlx-streaming {args.command}: error: {_with_flags(str(exc), args.flags)}", file=sys.stderr)
        return 2
    except OSError as exc:  # a file that changed under the checks above: still one line
        print(f"mlx-streaming {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nmlx-streaming: interrupted", file=sys.stderr)
        return 130
    return 0
