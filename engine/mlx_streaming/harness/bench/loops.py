"""``bench --loops``: mlx-lm's ``stream_generate`` on the streaming model against the same on mlx-lm's in-memory
model, with the streaming model under mlx-lm's own loop and under the engine's (``decode.step.generate_step`` in
``stream_generate``'s draft slot, as chat and serve run it), every arm in interleaved rounds."""

from __future__ import annotations

import statistics
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
                responses = list(mlx_lm.stream_generate(model, tokenizer, run.prompt, max_tokens=n, **extra))
                return responses[-1].generation_tps, [r.token for r in responses], None
            return once

        engine = loop.EngineLoop(sm, 1, "direct", speculate=False)
        arms = dict(zip(ARMS, (arm(inmemory), arm(sm.model), arm(sm.model, draft_model=engine))))
        rates, runs = _interleaved("loops", arms, run)
        pool_slots = sm.store.capacity
    return {"model": str(model_dir), "pool_slots": pool_slots, "io_mode": config.io_mode, "preload": config.preload,
            "max_tokens": run.max_tokens, "repeat": run.repeat, "tok_s": {name: _spread(v) for name, v in rates.items()},
            "x_in_memory": {name: statistics.median(a / b for a, b in zip(rates[name], rates[ARMS[0]]))
                            for name in ARMS},
            "ids_equal": len({tuple(ids) for arm_runs in runs.values() for ids, _ in arm_runs}) == 1}


def loops_table(report: dict) -> str:
    from tabulate import tabulate

    body = [[name, v["median"], v["min"], v["max"], report["x_in_memory"][name]] for name, v in report["tok_s"].items()]
    return (tabulate(body, headers=["stream_generate on", "tok/s (median)", "min", "max", "x in-memory (median of rounds)"], floatfmt=".3f")
            + f"\npool {report['pool_slots']} slots{' (preloaded)' if report['preload'] else ''}, {report['io_mode']}, "
              f"{report['max_tokens']} tokens x {report['repeat']} rounds, arms interleaved; every run's ids equal: "
              f"{report['ids_equal']}")
