"""``bench --overhead``: the engine's own cost per token, every path in interleaved rounds."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Callable, Optional

import mlx.core as mx

from ...config import StreamingConfig
from ...run_settings import RunSettings
from ...mtp.drafter import MTPDrafter
from ...mtp.speculative import mtp_generate
from .common import _costed, _interleaved, _refuse_unless_inmemory_fits, _spread, greedy_path
from ...checkpoint import MTP_FILE


def overhead_report(model_dir: Path, config: StreamingConfig, run: RunSettings) -> dict:
    """The engine's own cost per token: mlx-lm's in-memory greedy against streaming greedy (and MTP
    speculation where the model has a head) at the configured pool, with the miss check per MoE layer and
    per token, every path built first and run in interleaved rounds (``_interleaved``), so a drifting machine
    moves them alike. Per row: decode tok/s (median), ms per token, the process's CPU ms per decoded token
    (median) and, from the last round, the engine's host syncs and the store's timed parts per decoded token;
    every round's ids against in-memory's. Every per-token figure counts from the end of the prompt's prefill."""
    from contextlib import ExitStack

    import mlx_lm

    from ...model import build_streaming_model

    _refuse_unless_inmemory_fits(model_dir, "--overhead")
    model, tokenizer = mlx_lm.load(str(model_dir))
    prompt_ids = tokenizer.encode(run.prompt)
    has_mtp = (Path(model_dir) / MTP_FILE).exists() or config.mtp_path
    with ExitStack() as stack:
        arms = {("mlx-lm in-memory greedy", None): _costed(greedy_path(model, prompt_ids, config), None)}
        slots = {}
        for miss_check in ("layer", "forward"):
            sm = stack.enter_context(build_streaming_model(model_dir, config.replace(miss_check=miss_check,
                                                                                     mtp=bool(has_mtp))))
            slots[miss_check] = sm.store.capacity
            arms[("streaming greedy", miss_check)] = _costed(greedy_path(sm.model, prompt_ids, config), sm.store)
            if has_mtp:
                arms[(f"streaming MTP K={run.k}", miss_check)] = _costed(_speculative_path(sm, prompt_ids, config, run),
                                                                            sm.store)
        rates, runs = _interleaved("overhead", arms, run)
    inmemory_ids = runs[("mlx-lm in-memory greedy", None)][-1][0]
    rows = []
    for (path, miss_check), arm_runs in runs.items():
        cpu = statistics.median(cpu for _, (cpu, _) in arm_runs)
        ids, (_, stats) = arm_runs[-1]
        ids_match = all(ids == inmemory_ids for ids, _ in arm_runs)
        rows.append(_overhead_row(path, miss_check, rates[(path, miss_check)], cpu, stats, len(ids) - 1, ids_match,
                                  slots.get(miss_check)))
    return {"model": str(model_dir), "device": str(mx.default_device()), "io_mode": config.io_mode,
            "max_tokens": run.max_tokens, "warmup": run.warmup_tokens, "repeat": run.repeat, "rows": rows}


def _speculative_path(sm, prompt_ids, config: StreamingConfig, run: RunSettings) -> Callable:
    def once(n, on_decode):
        ids, stats = mtp_generate(sm.model, MTPDrafter(sm.mtp, sm.model), prompt_ids, n, run.k,
                                  run.commit_mode, config.prefill_chunk, on_decode)
        return stats["decode_tok_s"], ids
    return once


def _overhead_row(path: str, miss_check: Optional[str], rates, cpu_ms: float, stats: dict, tokens: int,
                  ids_match: bool, pool_slots: Optional[int]) -> dict:
    row = {"path": path, "miss_check": miss_check, "tok_s": _spread(rates), "cpu_ms_per_token": cpu_ms,
           "ids_match": ids_match}
    if not stats:  # in-memory: no store
        return row
    ms = 1000 / statistics.median(rates)
    parts = {part: 1000 * stats[counter] / tokens for part, counter in OVERHEAD_PARTS.items()}
    return {**row, "pool_slots": pool_slots, "host_syncs_per_token": stats["host_syncs"] / tokens, "ms_per_token": ms,
            **{f"{part}_ms_per_token": value for part, value in parts.items()},
            "other_ms_per_token": ms - sum(parts.values()),
            "deferred_forwards": stats["deferred_forwards"], "deferred_retries": stats["deferred_retries"],
            "hit_rate": stats["hits"] / max(1, stats["hits"] + stats["misses"])}


#: The main thread's timed parts of a step, reported per token by ``bench --overhead``: part -> the store's counter
#: (``residency.stats.FIELDS``). Reads count by their wait: the rest of a read runs while earlier experts are placed.
OVERHEAD_PARTS = {"sync": "sync_s", "route": "route_s", "read": "read_wait_s", "place": "place_s"}


def overhead_table(report: dict) -> str:
    from tabulate import tabulate

    base = report["rows"][0]
    body = [[r["path"], r["miss_check"], r.get("pool_slots"), r["tok_s"]["median"], 1000 / r["tok_s"]["median"],
             r["tok_s"]["median"] / base["tok_s"]["median"], r["cpu_ms_per_token"],
             r["cpu_ms_per_token"] - base["cpu_ms_per_token"], r.get("host_syncs_per_token"),
             *(r.get(f"{part}_ms_per_token") for part in (*OVERHEAD_PARTS, "other")),
             f"{r['deferred_retries']}/{r['deferred_forwards']}" if "deferred_forwards" in r else None, r["ids_match"]]
            for r in report["rows"]]
    return (tabulate(body, headers=["path", "miss check", "pool", "tok/s", "ms/token", "x in-memory", "CPU ms/token",
                                    "CPU ms over in-memory", "host syncs/token", "wait ms", "route ms", "read wait ms",
                                    "place ms", "other ms", "retried/deferred", "ids = in-memory"],
                     floatfmt=".2f", missingval="-")
            + f"\n{report['device']}  io_mode={report['io_mode']}  max_tokens={report['max_tokens']} "
              f"warmup={report['warmup']} repeat={report['repeat']} (tok/s and CPU ms: medians). Per decoded token, from "
              f"the end of the prompt's prefill; the counters and parts from the last timed run: host syncs; the host's "
              f"wait for the device, route bookkeeping, waits for demand reads and pool placement (ms); other = ms/token minus "
              f"those: building the step's graph and Python outside the store")
