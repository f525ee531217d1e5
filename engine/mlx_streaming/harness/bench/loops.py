"""``bench --loops``: mlx-lm's ``stream_generate`` on the streaming model against the same on mlx-lm's in-memory
model, with the streaming model under mlx-lm's own loop and under the engine's (``decode.step.generate_step`` in
``stream_generate``'s draft slot, as chat and serve run it), every arm in interleaved rounds.

Beside tok/s each arm gets its host cost: the main thread's CPU time per decoded token. MLX computes on threads
of its own or on the GPU, so this is graph building, kernel submission and the engine's bookkeeping; where it
nears the wall time per token the host, not the device, sets the pace (a small model on a fast GPU), and what the
engine adds to it is lost one for one."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

from ...config import StreamingConfig
from ...run_settings import RunSettings
from .common import _interleaved, _refuse_unless_inmemory_fits, _spread

ARMS = ("mlx-lm in memory", "streaming, mlx-lm's loop", "streaming, engine's loop")


def loops_report(model_dir: Path, config: StreamingConfig, run: RunSettings) -> dict:
    """Median decode tok/s of each arm (``stream_generate``'s own count, after the prefill); each arm over
    in-memory as the median of its rounds' ratios (a round's arms run back to back, so a machine whose speed
    drifts between rounds moves both alike); and whether every run's ids were the same."""
    import mlx_lm

    from ...integrations import internals, loop
    from ...model import build_streaming_model

    _refuse_unless_inmemory_fits(model_dir, "--loops")
    inmemory, tokenizer = mlx_lm.load(str(model_dir))
    internals.install_engine_step()
    with build_streaming_model(model_dir, config) as sm:
        def arm(model, **extra):
            def once(n):
                responses, host = [], None
                for response in mlx_lm.stream_generate(model, tokenizer, run.prompt, max_tokens=n, **extra):
                    if not responses:
                        host = time.thread_time()  # the decode starts: the prefill is behind
                    responses.append(response)
                host = (time.thread_time() - host) / max(1, len(responses) - 1)
                return responses[-1].generation_tps, [r.token for r in responses], 1000 * host
            return once

        engine = loop.EngineLoop(sm, 1, "direct", speculate=False)
        arms = dict(zip(ARMS, (arm(inmemory), arm(sm.model), arm(sm.model, draft_model=engine))))
        rates, runs = _interleaved("loops", arms, run)
        pool_slots = sm.store.capacity
    return {"model": str(model_dir), "pool_slots": pool_slots, "io_mode": config.io_mode, "preload": config.preload,
            "max_tokens": run.max_tokens, "repeat": run.repeat, "tok_s": {name: _spread(v) for name, v in rates.items()},
            "x_in_memory": {name: statistics.median(a / b for a, b in zip(rates[name], rates[ARMS[0]]))
                            for name in ARMS},
            "host_cpu_ms_per_token": {name: statistics.median(host for _, host in runs[name]) for name in ARMS},
            "ids_equal": len({tuple(ids) for arm_runs in runs.values() for ids, _ in arm_runs}) == 1}


def loops_table(report: dict) -> str:
    from tabulate import tabulate

    body = [[name, v["median"], v["min"], v["max"], report["x_in_memory"][name], report["host_cpu_ms_per_token"][name],
             1000 / v["median"]] for name, v in report["tok_s"].items()]
    return (tabulate(body, headers=["stream_generate on", "tok/s (median)", "min", "max", "x in-memory (median of rounds)",
                                    "host CPU ms/token", "wall ms/token"], floatfmt=".3f")
            + f"\npool {report['pool_slots']} slots{' (preloaded)' if report['preload'] else ''}, {report['io_mode']}, "
              f"{report['max_tokens']} tokens x {report['repeat']} rounds, arms interleaved; every run's ids equal: "
              f"{report['ids_equal']}. host CPU ms/token: the main thread's CPU time per decoded token (median of rounds); "
              f"near the wall time per token, the host sets the pace")
