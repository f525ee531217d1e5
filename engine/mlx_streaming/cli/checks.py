"""Input checks before any work: paths by kind, outputs by where they may be written, numbers against the
model and this machine, ``serve``'s address by binding it. Each refusal is one line naming what the user typed."""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..config import StreamingConfig, format_size
from ..run_settings import RunSettings
from ..errors import CheckpointError, ConfigError, OutputError
from .options import _bench_report, _flag_of, _model_dir
from ..checkpoint import MTP_FILE


INPUT_PATHS = {"model": "folder", "packed_dir": "folder", "hf": "folder", "trace": "file",
               "gate_power_replay": "file", "gate_power_baseline": "file"}
#: File options a command writes once its work is done: destination -> flag.
OUTPUT_FILES = {"json": "--json", "dump_ids": "--dump-ids", "record_trace": "--record-trace", "plot": "--plot"}
#: Files of a model folder that must be files where they are there (a missing one is reported when read).
MODEL_FILES = ("config.json", "model.safetensors.index.json", "model.safetensors", MTP_FILE,
               "tokenizer.json", "tokenizer_config.json", "generation_config.json", "heldout.safetensors",
               "training_report.json", "heldout_pytorch.json")
#: Counts a command takes outside the StreamingConfig: destination -> least value.
COUNTS = {"processes": 1, "loss_sequences": 1, "prompts": 1, "new_tokens": 1}
#: Seeds: what both numpy's and MLX's generators take.
SEED_RANGE = (0, 2 ** 64 - 1)


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


def check_config(args, config: StreamingConfig, run: RunSettings) -> None:
    """The settings against the files they name and this machine: paths from the environment, byte sizes."""
    if run.dump_ids and args.command == "bench" and not getattr(args, "dump_ids", None):
        _check_output_file("MLX_STREAMING_DUMP_IDS", run.dump_ids)
    if config.mtp_path:
        _check_kind("MLX_STREAMING_MTP_PATH", config.mtp_path, "file")
    memory = _machine_memory()
    for name in ("pool_bytes", "memory_budget", "staging_bytes"):
        value = getattr(config, name)
        if value is not None and value > memory:
            raise ConfigError(f"{name}={format_size(value)} is more than this machine's memory ({format_size(memory)})")


def _model_limits(model_dir: Path) -> dict:
    """What the model allows, from its config.json: context length, experts per layer, experts per token."""
    from ..runtime.sites import experts_per_token
    from ..model import read_config

    model_config = read_config(model_dir)
    scopes = (model_config, model_config.get("text_config") or {})
    positions = next((s["max_position_embeddings"] for s in scopes if s.get("max_position_embeddings")), None)
    return {"max_positions": positions, "top_k": experts_per_token(model_config)}


def check_against_model(args, config: StreamingConfig, run: RunSettings, plan) -> None:
    """Numbers the model bounds, from its config.json and the memory plan (headers only, nothing loaded)."""
    limits = _model_limits(_model_dir(args))
    top_k, positions = limits["top_k"], limits["max_positions"]
    if positions:
        lengths = {"max_tokens": run.max_tokens, "pin_cal_tokens": config.pin_cal_tokens,
                   "warmup_tokens": run.warmup_tokens, "new_tokens": getattr(args, "new_tokens", None)}
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
        from ..checkpoint.safetensors import read_header
        from ..harness.evaluate import HELDOUT_FILE

        heldout = Path(_model_dir(args)) / HELDOUT_FILE
        tokens = read_header(heldout).get("tokens") if heldout.is_file() else None
        if tokens is not None and tokens.shape:
            sequences = tokens.shape[0]
            for dest in ("loss_sequences", "prompts"):
                if getattr(args, dest) > sequences:
                    raise ConfigError(f"{_flag_of(args, dest)} {getattr(args, dest)}: {heldout} holds {sequences} "
                                      f"held-out sequences")
