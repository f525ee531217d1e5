"""One benchmark run on one checkpoint: decode tok/s and expert traffic per scenario, side by side.

Scenarios run in one process on one prompt, in order, each first warmed up and then timed ``repeat``
times (median reported). ``inmemory`` is mlx-lm's own model; the others are the streaming engine with the
pool at a fraction of the experts and an io mode. A ``buffered`` figure read through the page cache is not a
disk-streaming figure; ``direct`` bypasses the cache (O_DIRECT / F_NOCACHE).
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

import mlx.core as mx

from .config import StreamingConfig
from .generate import greedy_steps


@dataclass(frozen=True)
class Scenario:
    name: str
    pool_fraction: Optional[float] = None  # None: mlx-lm in-memory
    io_mode: str = "buffered"


DEFAULT_SCENARIOS = (
    Scenario("inmemory"),
    Scenario("stream-100%", 1.0, "buffered"),
    Scenario("stream-25%-buffered", 0.25, "buffered"),
    Scenario("stream-25%-direct", 0.25, "direct"),
)


def _time_decode(model, prompt_ids, max_tokens: int, prefill_chunk: int) -> tuple:
    """(decode tok/s, ids): the clock starts once the prompt is processed."""
    ids, start = [], None
    for token, _ in greedy_steps(model, prompt_ids, max_tokens, prefill_chunk):
        ids.append(token)
        if start is None:
            start = time.perf_counter()
    return (max_tokens - 1) / (time.perf_counter() - start), ids


def run_scenario(model_dir: Path, scenario: Scenario, config: StreamingConfig, warmup: int, repeat: int) -> dict:
    import mlx_lm

    from .model import build_streaming_model

    if scenario.pool_fraction is None:
        model, tokenizer = mlx_lm.load(str(model_dir))
        store, closer = None, None
    else:
        num_experts = mlx_lm.utils.load_config(Path(model_dir))["num_experts"]
        slots = max(1, round(num_experts * scenario.pool_fraction))
        sm = build_streaming_model(model_dir, config.replace(pool_slots=slots, pool_bytes=None, memory_budget=None, io_mode=scenario.io_mode))
        model, tokenizer, store, closer = sm.model, sm.tokenizer, sm.store, sm
    try:
        prompt_ids = tokenizer.encode(config.prompt)
        if warmup:
            _time_decode(model, prompt_ids, warmup, config.prefill_chunk)
        rates = []
        for _ in range(repeat):
            if store is not None:
                store.reset_stats()
            rate, ids = _time_decode(model, prompt_ids, config.max_tokens, config.prefill_chunk)
            rates.append(rate)
        row = {"scenario": scenario.name, "io_mode": scenario.io_mode if store else "-", "tok_s": statistics.median(rates),
               "tok_s_runs": rates, "ids": ids}
        if store is not None:
            n = len(ids)
            row.update(pool_slots=store.capacity, **store.stats())
            row.update(hits_per_tok=store.hits / n, misses_per_tok=store.misses / n, mb_read_per_tok=store.bytes_read / n / 1e6)
        return row
    finally:
        if closer is not None:
            closer.close()
        mx.clear_cache()


def run(model_dir: Path, config: StreamingConfig, scenarios=DEFAULT_SCENARIOS, warmup: int = 8, repeat: int = 3) -> List[dict]:
    rows = []
    for scenario in scenarios:
        print(f"[bench] {scenario.name} ...", file=sys.stderr, flush=True)
        rows.append(run_scenario(model_dir, scenario, config, warmup, repeat))
    reference = rows[0]["ids"]
    for row in rows:
        row["ids_match_first"] = row["ids"] == reference
    return rows


def table(rows: List[dict]) -> str:
    from tabulate import tabulate

    cols = ["scenario", "io_mode", "pool_slots", "tok_s", "hits_per_tok", "misses_per_tok", "mb_read_per_tok", "ids_match_first"]
    return tabulate([[r.get(c, "-") for c in cols] for r in rows], headers=cols, floatfmt=".2f")
