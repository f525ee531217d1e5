"""The ``mlx-streaming`` console script.

Every engine option maps by name onto a ``StreamingConfig`` field; an error about a field is reported with the
flag the user typed. Errors end in one line and exit status 2, Ctrl-C in one line and 130, never a traceback.

Input is checked before any work (``check_input``): every path for its kind (file or folder), every output path
for a folder it can be written into, every number against what the model and this machine allow, ``serve``'s
address by binding it; only then is the memory plan printed and the model built. Settings taken from the
environment (``MLX_STREAMING_<NAME>``, ``environment.ENV_NAMES``) are each named in one line on stderr.
"""

from __future__ import annotations

import sys

from ..errors import StreamingError
from .checks import check_against_model, check_config, check_input
from .commands import BUILDS, _configured, _plan_of
from .options import _bench_defaults_used, _config, _flag_of, _flags, _run, _say, _with_flags
from .parser import build_parser


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        args.argv = argv[argv.index(args.command) + 1:]
        args.flags = _flags(parser, args.command)
        check_input(args)
        if _configured(args):
            config, run = _config(args), _run(args)
            check_config(args, config, run)
            plan = _plan_of(args)
            check_against_model(args, config, run, plan)
            used = _bench_defaults_used(args, config)
            if used:
                _say(f"mlx-streaming bench: {', '.join(f'{_flag_of(args, n)} {getattr(config, n)}' for n in used)}: "
                     f"the benchmark's default (--pool-fraction 1 keeps every expert resident, --io-mode buffered "
                     f"reads through the page cache)")
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
