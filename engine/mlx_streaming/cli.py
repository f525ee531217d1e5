"""The ``mlx-streaming`` console script: synth, generate, bench, repack, extract-mtp."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from .config import StreamingConfig, parse_size
from .errors import StreamingError


def _add_engine_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=Path, help="model folder (default: the embedded default model)")
    p.add_argument("--prompt", help="prompt text")
    p.add_argument("--max-tokens", type=int, help="tokens to generate")
    p.add_argument("--pool-slots", type=int, help="expert slots per MoE layer")
    p.add_argument("--pool-bytes", type=parse_size, help="bytes of resident experts, e.g. 2G")
    p.add_argument("--memory-budget", type=parse_size, help="bytes for the whole process, e.g. 24G")
    p.add_argument("--io-mode", choices=("buffered", "direct"), help="read experts through the page cache or not")
    p.add_argument("--packed", dest="packed_dir", help="read experts from this packed layout (mlx-streaming repack)")
    p.add_argument("--verify", action="store_true", default=None, help="byte-truth: check every expert placed into the pool against disk (STG_VERIFY=1)")
    p.add_argument("--prefetch", action="store_true", default=None, help="read predicted experts in the background")
    p.add_argument("--ahead", dest="prefetch_ahead", type=int, choices=(0, 1), help="predict this layer's (0) or the next layer's (1) experts")
    p.add_argument("--mult", dest="prefetch_mult", type=int, help="predict top_k x MULT experts per token")
    p.add_argument("--staging-bytes", type=parse_size, help="host bytes the prefetcher may hold, e.g. 64M")
    p.add_argument("--diagnostics", action="store_true", default=None, help="measure prediction recall, miss attribution, main-thread timings")


def _config(args) -> StreamingConfig:
    """Every option whose destination is a StreamingConfig field, over the seed's environment names."""
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(StreamingConfig) if hasattr(args, f.name)}
    return StreamingConfig.from_env(**given)


def _model_dir(args) -> Path:
    from .defaults import default_model

    return args.model or default_model()


def cmd_synth(args) -> None:
    from .checkpoint.synth import synth_checkpoint

    out = synth_checkpoint(args.out, preset=args.preset, seed=args.seed, layout=args.layout)
    print(out)


def cmd_generate(args) -> None:
    from .generate import greedy_steps
    from .model import build_streaming_model

    config = _config(args)
    with build_streaming_model(_model_dir(args), config) as sm:
        tokenizer = sm.tokenizer
        detok = tokenizer.detokenizer
        detok.reset()
        for token, _ in greedy_steps(sm.model, tokenizer.encode(config.prompt), config.max_tokens, config.prefill_chunk):
            if token in tokenizer.eos_token_ids:
                break
            detok.add_token(token)
            print(detok.last_segment, end="", flush=True)
        detok.finalize()
        print(detok.last_segment)
        print(json.dumps(sm.store.stats()), file=sys.stderr)


def cmd_evaluate(args) -> None:
    from .evaluate import evaluate

    result = evaluate(_model_dir(args), _config(args), loss_sequences=args.loss_sequences, prompts=args.prompts,
                      new_tokens=args.new_tokens)
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


def cmd_bench(args) -> None:
    from . import bench

    if args.processes:
        result = bench.noise_floor(_without(args.argv, ("--processes", "--json", "--dump-ids")), args.processes)
        print(json.dumps(result, indent=2))
    elif args.io:
        result = bench.io_report(_model_dir(args), _config(args))
        print(json.dumps(result, indent=2))
    elif args.sweep:
        result = bench.sweep(_model_dir(args), _config(args))
        print(bench.sweep_table(result))
    elif args.prefetch_report:
        result = bench.prefetch_report(_model_dir(args), _config(args))
        print(bench.prefetch_table(result))
    else:
        result = bench.run(_model_dir(args), _config(args), compare_inmemory=args.compare_inmemory)
        print(bench.table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


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


def cmd_extract_mtp(args) -> None:
    from .checkpoint.mtp_extract import extract_mtp

    print(extract_mtp(args.hf, args.out, bits=args.bits))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mlx-streaming", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("synth", help="write a synthetic Qwen3-Next checkpoint")
    p.add_argument("--preset", default="tiny", choices=("tiny", "small", "medium"))
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layout", default="mlx", choices=("mlx", "hf"))
    p.set_defaults(func=cmd_synth)

    p = sub.add_parser("generate", help="greedy generation with streamed experts")
    _add_engine_options(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("evaluate", help="a trained model against its training report: held-out loss, MTP acceptance")
    _add_engine_options(p)
    p.add_argument("--loss-sequences", type=int, default=8, help="held-out sequences for the loss (about 25 s each here)")
    p.add_argument("--prompts", type=int, default=16, help="held-out prompts for the acceptance measurement")
    p.add_argument("--new-tokens", type=int, default=96, help="tokens generated per prompt")
    p.add_argument("--json", help="write the result here")
    p.set_defaults(func=cmd_evaluate)

    p = sub.add_parser("bench", help="decode tok/s and expert traffic: in-memory vs streaming")
    _add_engine_options(p)
    p.add_argument("--k", type=int, help="tokens per verify: 1 + K-1 MTP drafts (default 3)")
    p.add_argument("--verify-mode", choices=("direct", "replay"), help="Gated-DeltaNet commit after a partial accept")
    p.add_argument("--warmup", dest="warmup_tokens", type=int, help="warm-up tokens per path (default 8)")
    p.add_argument("--repeat", type=int, help="timed runs per path, medians reported (default 3)")
    p.add_argument("--pin-hot", type=int, help="pin each layer's N hottest experts, found by a calibration run")
    p.add_argument("--pin-cal-tokens", type=int, help="tokens of the pin-hot calibration run")
    p.add_argument("--dump-ids", help="write the greedy and speculative ids to this JSON file")
    p.add_argument("--compare-inmemory", action="store_true", help="also time mlx-lm's in-memory model in this process")
    p.add_argument("--sweep", action="store_true", help="greedy only: in-memory vs streaming at 100%% and 25%% pools, both io modes")
    p.add_argument("--io", action="store_true", help="disk: raw read rate at the expert size vs the engine's demand-load rate (greedy)")
    p.add_argument("--prefetch-report", action="store_true", help="greedy: naive, LRU, LRU + prefetch (ahead 0/1, mult 1/2) side by side, with diagnostics")
    p.add_argument("--processes", type=int, help="noise floor: run this benchmark in N fresh processes, report the spread")
    p.add_argument("--json", help="write the full result here")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("repack", help="write the experts in the packed layout (one aligned record per expert)")
    p.add_argument("--model", type=Path, help="model folder (default: the embedded default model)")
    p.add_argument("--out", type=Path, required=True)
    p.set_defaults(func=cmd_repack)

    p = sub.add_parser("extract-mtp", help="pull mtp.* out of an original-layout checkpoint")
    p.add_argument("--hf", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--bits", type=int, default=4)
    p.set_defaults(func=cmd_extract_mtp)
    return parser


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.argv = argv[1:]  # after the subcommand
    try:
        args.func(args)
    except StreamingError as exc:
        print(f"mlx-streaming: error: {exc}", file=sys.stderr)
        return 2
    return 0
