"""The ``mlx-streaming`` argument parser, and each command's flags by the config field they set."""

from __future__ import annotations

import argparse
from pathlib import Path

from .commands import (cmd_bench, cmd_chat, cmd_checksum, cmd_evaluate, cmd_extract_mtp, cmd_generate, cmd_limit,
                       cmd_plan, cmd_repack, cmd_serve, cmd_synth)
from .options import (BENCH_DEFAULTS, DEFAULTS, DESCRIPTION, ENV_HELP, RUN_DEFAULTS, _Parser, _add_generation_options,
                      _add_model_options, _add_sampling_options, _k, _size)


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__

    parser = _Parser(prog="mlx-streaming", description=DESCRIPTION, epilog=ENV_HELP)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = _command(sub, "generate", cmd_generate, help="greedy generation with streamed experts",
                       description="Greedy generation with streamed experts; text on stdout, pool and counters on stderr.")
    _add_model_options(p)
    _add_generation_options(p)
    p.add_argument("--record-trace", metavar="FILE",
                   help="write which experts each MoE layer call routed to (prompt and decode), for plan --trace")

    p = _command(sub, "plan", cmd_plan, help="the memory plan (dense weights, pool, head, staging, margin), nothing loaded",
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

    p = _command(sub, "bench", cmd_bench, help="streaming vs mlx-lm's in-memory model: tok/s, hit rate, bytes read, memory",
                       description="By default: the model streamed from disk through a bounded pool (--pool-fraction "
                                   f"{BENCH_DEFAULTS['pool_fraction']} with --io-mode {BENCH_DEFAULTS['io_mode']} "
                                   "unless a pool size or io mode is given), greedy and MTP speculative decoding, "
                                   "beside mlx-lm's in-memory model: tok/s, x in-memory, hit rate, bytes read, "
                                   "memory, ids equal. Or one of the reports below.")
    _add_model_options(p)
    _add_generation_options(p)
    g = p.add_argument_group("speculation and timing")
    g.add_argument("--k", type=_k, help="tokens per verify: 1 + K-1 MTP drafts, or auto: chosen while decoding "
                                        f"from measured step costs and acceptance (default {RUN_DEFAULTS.k})")
    g.add_argument("--commit-mode", dest="commit_mode", choices=("direct", "replay"),
                   help="how Gated-DeltaNet state is committed after a partial accept: keep the per-position states "
                        f"(direct) or restore a snapshot and replay (default {RUN_DEFAULTS.commit_mode})")
    g.add_argument("--warmup", dest="warmup_tokens", type=int, metavar="N",
                   help=f"warm-up tokens per path before the timed runs (default {RUN_DEFAULTS.warmup_tokens})")
    g.add_argument("--repeat", type=int, metavar="N", help=f"timed runs per path, medians reported (default {RUN_DEFAULTS.repeat})")
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
    for flag, kind, text in BENCH_MODES:
        modes.add_argument(flag, help=text, **({"action": "store_true"} if kind is None else kind))
    reports.add_argument("--gate-power-base", metavar="REV",
                         help="with --gate-power: study the side-by-side gate instead: git revision REV's engine "
                              "(exported and built apart) in rounds alternating with this tree's, planted 10%% and "
                              "20%% slowdowns in this tree's only (about 20 minutes here)")
    reports.add_argument("--gate-power-baseline", metavar="FILE",
                         help="with --gate-power-replay: judge the recorded pools against this baseline the perf "
                              "suite saved (baselines/<machine>/NNNN_baseline.json) instead of the study's own "
                              "baseline pool")

    p = _command(sub, "chat", cmd_chat, help="chat interactively, answers streamed as they come, with mlx-lm's sampler",
                       description="Chat on a streaming model through mlx-lm's stream_generate. Ctrl-C ends the answer; "
                                   "Ctrl-D ends the session.")
    _add_model_options(p)
    _add_sampling_options(p, 256)
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")

    p = _command(sub, "serve", cmd_serve, help="an OpenAI-compatible HTTP server (mlx-lm's) on a streaming model",
                       description="mlx-lm's OpenAI-compatible server (/v1/chat/completions, /v1/completions, "
                                   "/v1/models, streaming) on a streaming model built with the options below.")
    _add_model_options(p)
    _add_sampling_options(p, 512)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="port to listen on (default 8080)")

    p = _command(sub, "evaluate", cmd_evaluate, help="a trained model against its training report: held-out loss, MTP acceptance",
                       description="Held-out loss and MTP acceptance of a trained model (the default one unless "
                                   "--model), against the figures of its training run.")
    _add_model_options(p)
    p.add_argument("--loss-sequences", type=int, default=8, help="held-out sequences for the loss (about 25 s each on a CPU) (default 8)")
    p.add_argument("--prompts", type=int, default=16, help="held-out prompts for the acceptance measurement (default 16)")
    p.add_argument("--new-tokens", type=int, default=96, help="tokens generated per prompt (default 96)")
    p.add_argument("--json", metavar="FILE", help="write the result here")

    p = _command(sub, "synth", cmd_synth, help="write a synthetic checkpoint (Qwen3-Next presets, or any supported --arch)",
                       description="Write a synthetic checkpoint (random weights, real layout). --out must be a new or "
                                   "empty folder, or one synth wrote before (then it is replaced).")
    p.add_argument("--preset", default="tiny", choices=("tiny", "small", "medium", "qwen3-next-80b"),
                   help="size: tiny (~10 MB), small (~380 MB), medium (~2.8 GB), or qwen3-next-80b: "
                        "Qwen3-Next-80B-A3B's published config at full size (~45 GB, written as a stream in "
                        "minutes, mlx layout only) (default tiny)")
    p.add_argument("--layers", type=int, metavar="N",
                   help="N decoder layers instead of the preset's, every per-layer shape kept (at least 4: "
                        "every 4th layer is full attention, and the model needs one)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                   help="what is not packed (scales, biases, norms), for qwen3-next-80b: float32 runs about 9x "
                        "faster on MLX's CPU backend, which computes bfloat16 quantized matmuls slowly "
                        "(default bfloat16, as the published model)")
    p.add_argument("--out", type=Path, metavar="DIR", required=True, help="the folder to write")
    p.add_argument("--seed", type=int, default=0, help="the same seed gives byte-identical files (default 0)")
    p.add_argument("--layout", default="mlx", choices=("mlx", "hf"),
                   help="mlx: the 4-bit MLX conversion layout; hf: the original bf16 layout (default mlx)")
    p.add_argument("--arch", metavar="NAME",
                   help="instead of a Qwen3-Next preset, a tiny checkpoint of this mlx-lm MoE architecture "
                        "(model_type, e.g. mixtral, deepseek_v3), written by mlx-lm's own classes and save code")

    p = _command(sub, "repack", cmd_repack, help="write the experts in the packed layout (one aligned record per expert)",
                       description="Write the experts in the packed layout, then read them with --packed DIR. --out "
                                   "must be a new or empty folder, or one repack wrote before.")
    p.add_argument("--model", type=Path, metavar="DIR", help="model folder (default: the embedded default model)")
    p.add_argument("--out", type=Path, metavar="DIR", required=True, help="the folder to write")

    p = _command(sub, "checksum", cmd_checksum, help="write the checksum manifest --verify checks experts against",
                       description="Checksum every expert of a checkpoint made elsewhere (e.g. by mlx_lm.convert) "
                                   "into expert-checksums.json beside its files; --verify then checks every expert "
                                   "placed into the pool against it. synth, repack and extract-mtp write one already.")
    p.add_argument("--model", type=Path, metavar="DIR", help="model folder (default: the embedded default model)")
    p.add_argument("--packed", dest="packed_dir", metavar="DIR", type=Path, help="also checksum this packed layout")
    p.add_argument("--replace", action="store_true",
                   help="take new checksums from the files as they are now, over an existing manifest")

    p = _command(sub, "extract-mtp", cmd_extract_mtp, help="pull mtp.* out of an original-layout checkpoint",
                       description="Convert the MTP head of an original-layout (Hugging Face) checkpoint, which "
                                   "mlx_lm.convert drops, into the file --mtp reads (mtp.safetensors).")
    p.add_argument("--hf", type=Path, metavar="DIR", required=True, help="the original-layout checkpoint folder")
    p.add_argument("--out", type=Path, metavar="DIR", required=True,
                   help="the file to write (usually MODEL/mtp.safetensors); a new file, or one extract-mtp wrote")
    p.add_argument("--bits", type=int, default=4, choices=(2, 3, 4, 6, 8), help="expert and projection bits (default 4)")
    p.add_argument("--q-group-size", type=int, default=64, choices=(32, 64, 128),
                   help="quantization group size, as mlx_lm.convert's option of that name (default 64)")

    p = _command(sub, "limit", cmd_limit, help="run a command under a hard memory limit and say its peak memory",
                       description="Run COMMAND in a memory cgroup of --memory bytes (Linux; root or a delegated "
                                   "cgroup): the kernel kills it if it grows past the limit. Then say its peak "
                                   "memory (the cgroup's maximum usage) and exit with its exit status. Example: "
                                   "mlx-streaming limit --memory 4G -- pytest -m exact --streaming-model DIR")
    p.add_argument("--memory", type=_size, metavar="SIZE", required=True, help="the limit, e.g. 4G")
    p.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- COMMAND ...", help="the command and its arguments")
    return parser




def _command(sub, name: str, func, **texts) -> argparse.ArgumentParser:
    """The subcommand ``name`` (its ``help`` and ``description``), run by ``func``."""
    p = sub.add_parser(name, **texts)
    p.set_defaults(func=func)
    return p


#: ``bench``'s report options, one at a time: (flag, its argparse keywords beyond help (None: a switch), help).
BENCH_MODES = (
    ("--sweep", None, "greedy only: in-memory vs streaming at 100%% and 25%% pools, both io modes"),
    ("--io", None, "disk: the best read rate over request sizes and read threads vs the engine's demand-load rate "
                   "(greedy; at the benchmark's default pool and io mode unless given), and the engine's time per "
                   "token against its bound (the misses' bytes at that rate plus in-memory's time per token, "
                   "interleaved with mlx-lm's in-memory model where it fits)"),
    ("--prefetch-report", None, "greedy: naive, the pool, the pool + prefetch (ahead 0/1, mult 1/2) side by side, with "
                                "diagnostics"),
    ("--k-report", None, "MTP speculation at K = 1, 2, 3, 4 and auto (new per run, and kept across runs), interleaved: "
                         "tok/s and auto over the best K"),
    ("--prefetch-auto-report", None, "greedy with prefetch off, on and auto, interleaved: tok/s and auto over the "
                                     "better"),
    ("--overhead", None, "the engine's own cost per token: in-memory vs streaming with the miss check per layer and "
                         "per forward (host syncs, wait), greedy and MTP"),
    ("--loops", None, "mlx-lm's stream_generate on the streaming model, under mlx-lm's loop and the engine's (as chat "
                      "and serve run it), against the same on mlx-lm's in-memory model, interleaved"),
    ("--gate-power", None, "how often the perf gate catches planted 5/10/20%% slowdowns and fails an unchanged tree, "
                           "quiet and beside two busy loops (about 25 minutes here; --json FILE keeps the recorded "
                           "rounds)"),
    ("--gate-power-replay", {"metavar": "FILE"}, "the power study's simulated gate runs again, under the current "
                                                 "rule, on the rounds a --gate-power --json FILE run recorded "
                                                 "(nothing measured)"),
    ("--processes", {"type": int, "metavar": "N"}, "noise floor: run the default benchmark in N fresh processes, "
                                                   "report the spread"),
)
