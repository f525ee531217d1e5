"""The commands: one ``cmd_<name>(args)`` each, run after the checks."""

from __future__ import annotations

import json
from pathlib import Path

from ..config import StreamingConfig, format_size
from ..errors import ConfigError, OutputError
from .options import _config, _model_dir, _run, _say, _with_flags
from ..checkpoint import MTP_FILE


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
    recorded = recorded if isinstance(recorded, dict) else {}
    studies = recorded.get("yardsticks")  # one study per yardstick, or the file is one study
    studies = list(studies.values()) if isinstance(studies, dict) and studies else [recorded]
    missing = [key for key in ("tokens", "unit", "cost_per_token") if key not in recorded]
    for study in (s if isinstance(s, dict) else {} for s in studies):
        missing += [key for key in ("bases" if "bases" in study else "baseline", "pools")
                    if key not in study and key not in missing]
    if missing:
        raise ConfigError(f"--gate-power-replay {path}: not a `bench --gate-power --json` file "
                          f"(no {', '.join(missing)})")
    return recorded


def _suite_baseline(path: str, unit: str) -> dict:
    """The power study's scenarios' rounds from a baseline the perf suite saved, in the recorded pools' unit, with
    the yardstick the suite measured them against (``gate_power.suite_baseline``)."""
    from ..harness import gate_power

    saved = _json_file("--gate-power-baseline", path)
    try:
        baseline = gate_power.suite_baseline(saved if isinstance(saved, dict) else {})
    except ValueError as exc:
        raise ConfigError(f"--gate-power-baseline {path}: not a perf suite baseline ({exc})") from None
    if baseline["unit"] != unit:
        raise ConfigError(f"--gate-power-baseline {path}: its costs are in {baseline['unit']}, the recorded pools' "
                          f"in {unit}")
    return baseline


def _write_json(path: str, result) -> None:
    try:
        Path(path).write_text(json.dumps(result, indent=2))
    except OSError as exc:
        raise OutputError(f"--json {path}: cannot write it ({exc.strerror})") from None


def cmd_synth(args) -> None:
    if args.arch:
        from ..harness.arch_synth import synth_arch

        if args.layers is not None:
            raise ConfigError("--layers: applies to the Qwen3-Next presets; an --arch checkpoint has its own layers")
        print(synth_arch(args.out, args.arch, seed=args.seed))
        return
    from ..harness.synth import synth_checkpoint

    print(synth_checkpoint(args.out, preset=args.preset, seed=args.seed, layout=args.layout, layers=args.layers,
                          dtype=args.dtype))


def cmd_generate(args) -> None:
    from ..decode.greedy import greedy_steps
    from ..model import build_streaming_model
    from ..harness.report import counters_line, diagnostics_report

    config, run = _config(args), _run(args)
    with build_streaming_model(_model_dir(args), config) as sm:
        tokenizer = sm.tokenizer
        detok = tokenizer.detokenizer
        detok.reset()
        generated, decode_from = 0, None
        prompt_ids = tokenizer.encode(run.prompt)
        if args.record_trace:
            sm.store.route_log = []
        for token, _ in greedy_steps(sm.model, prompt_ids, run.max_tokens, config.prefill_chunk):
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
            from ..residency.trace import write_trace

            write_trace(args.record_trace, sm.store, len(prompt_ids), generated, decode_from)
            _say(f"routing trace: {len(sm.store.route_log)} MoE layer calls written to {args.record_trace}")


def cmd_chat(args) -> None:
    from ..integrations.chat import chat

    chat(_model_dir(args), _config(args), _run(args), temp=args.temp, top_p=args.top_p, seed=args.seed)


def cmd_serve(args) -> None:
    from ..integrations.server import serve

    model_dir = _model_dir(args)
    serve(model_dir, _with_head(model_dir, _config(args)), _run(args), host=args.host, port=args.port, temp=args.temp, top_p=args.top_p)


def cmd_evaluate(args) -> None:
    from ..harness.evaluate import evaluate

    result = evaluate(_model_dir(args), _config(args), loss_sequences=args.loss_sequences, prompts=args.prompts,
                      new_tokens=args.new_tokens)
    print(json.dumps(result, indent=2))
    if args.json:
        _write_json(args.json, result)


def cmd_plan(args) -> None:
    if args.trace:
        from ..harness.report import policy_table, trace_table
        from ..residency.policy_study import compare
        from ..residency.trace import curve, read_trace

        trace = read_trace(args.trace)
        most = trace["num_experts"] - trace["top_k"]
        if not 0 <= (args.pin_hot or 0) <= most:
            raise ConfigError(f"--pin-hot {args.pin_hot}: the trace's model has {trace['num_experts']} experts per "
                              f"layer and routes {trace['top_k']} per token; pin 0 to {most}")
        eviction = _config(args).eviction
        rows = curve(trace, args.disk_gbps * 1e9, args.pin_hot or 0, eviction)
        print(trace_table(rows, args.disk_gbps, args.pin_hot or 0, eviction))
        policies = compare(trace)
        print("\n" + policy_table(policies))
        if args.plot:
            from ..harness.curve_plot import write_plot

            write_plot(rows, args.plot, args.disk_gbps, args.pin_hot or 0)
            _say(f"plot written to {args.plot}")
        if args.json:
            _write_json(args.json, {"curve": rows, "policies": policies})
        return
    print(_with_flags(_plan_of(args).describe(), args.flags))


def _plan_of(args):
    """The memory plan of the model this command builds, the MTP head included where it loads one."""
    from ..model import plan_memory

    if getattr(args, "plan", None) is None:
        model_dir, config = _model_dir(args), _config(args)
        if args.command in WITH_HEAD:
            config = _with_head(model_dir, config)
        args.plan = plan_memory(model_dir, config)
    return args.plan


def _with_head(model_dir, config):
    """``config`` with the MTP head loaded where the model folder has one (or ``--mtp-path`` names one)."""
    return config.replace(mtp=(Path(model_dir) / MTP_FILE).exists() or bool(config.mtp_path))


#: Commands that build a streaming model (each prints its memory plan first), and those that load the MTP head.
BUILDS = ("generate", "bench", "chat", "serve", "evaluate")
WITH_HEAD = ("bench", "evaluate", "plan", "serve")


def _configured(args) -> bool:
    """Whether the command runs on a StreamingConfig and a model's memory plan (checked before it starts)."""
    if args.command == "plan":
        return not args.trace
    return args.command in BUILDS and not getattr(args, "gate_power_replay", None)


#: ``bench``'s reports on one model: the option's destination -> (the report's function in ``harness.bench``, the
#: function making its table, that function's arguments after the result).
MODEL_REPORTS = {
    "io": ("io_report", "io_table", ()),
    "sweep": ("sweep", "sweep_table", ()),
    "prefetch_report": ("prefetch_report", "prefetch_table", ()),
    "k_report": ("k_report", "auto_table", ("K",)),
    "prefetch_auto_report": ("prefetch_auto_report", "auto_table", ("prefetch",)),
    "overhead": ("overhead_report", "overhead_table", ()),
    "loops": ("loops_report", "loops_table", ()),
}


def _report_of(args):
    """The ``MODEL_REPORTS`` option ``bench`` was given, or None."""
    return next((name for name in MODEL_REPORTS if getattr(args, name, False)), None)


def cmd_bench(args) -> None:
    from ..harness import bench

    if args.processes is not None:
        result = bench.noise_floor(_without(args.argv, ("--processes", "--json", "--dump-ids")), args.processes)
        print(json.dumps(result, indent=2))
    elif args.gate_power:
        from ..harness import gate_power

        if args.gate_power_base:
            from ..harness.side_by_side import BaseUnavailable

            try:
                result = gate_power.side_by_side_study(Path.cwd(), args.gate_power_base, _model_dir(args),
                                                       _config(args), _run(args).prompt)
            except BaseUnavailable as exc:
                raise ConfigError(f"--gate-power-base {args.gate_power_base}: {exc}") from None
        else:
            result = gate_power.study(_model_dir(args), _config(args), _run(args).prompt,
                                      tokens=args.max_tokens or gate_power.TOKENS)
        print(gate_power.table(result))
    elif args.gate_power_replay:
        from ..harness import gate_power

        recorded = _recorded_pools(args.gate_power_replay)
        against = args.gate_power_baseline and _suite_baseline(args.gate_power_baseline, recorded["unit"])
        try:
            result = gate_power.replay(recorded, baseline=against or None)
        except ValueError as exc:
            raise ConfigError(f"--gate-power-baseline {args.gate_power_baseline}: {exc}") from None
        print(gate_power.table(result))
    elif _report_of(args) is not None:
        report, table, extra = MODEL_REPORTS[_report_of(args)]
        result = getattr(bench, report)(_model_dir(args), _config(args), _run(args))
        print(getattr(bench, table)(result, *extra))
    else:
        result = bench.run(_model_dir(args), _config(args), _run(args), compare_inmemory=args.compare_inmemory)
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
    from ..checkpoint.packed import repack
    from ..model import open_checkpoint

    model_dir = _model_dir(args)
    has_mtp = (model_dir / MTP_FILE).exists()
    print(repack(open_checkpoint(model_dir, StreamingConfig(mtp=has_mtp)).index, args.out))


def cmd_checksum(args) -> None:
    from ..checkpoint.manifest import MANIFEST_FILE, read_manifest, write_manifest
    from ..checkpoint.packed import packed_index
    from ..errors import OutputError
    from ..model import open_checkpoint

    model_dir = _model_dir(args)
    index = open_checkpoint(model_dir, StreamingConfig(mtp=(model_dir / MTP_FILE).exists())).index
    targets = [(model_dir, index)] + ([(args.packed_dir, packed_index(index, args.packed_dir))] if args.packed_dir else [])
    for folder, folder_index in targets:
        existing = read_manifest(folder)
        if existing and not args.replace:
            raise OutputError(f"{Path(folder) / MANIFEST_FILE}: already there (written by {existing['written_by']}); "
                              f"pass --replace to take new checksums from the files as they are now")
    for folder, folder_index in targets:
        print(write_manifest(folder_index, folder, "checksum"))


def cmd_limit(args) -> None:
    from .. import cgroup

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
    from ..checkpoint.mtp_extract import extract_mtp

    print(extract_mtp(args.hf, args.out, bits=args.bits, group_size=args.q_group_size))
