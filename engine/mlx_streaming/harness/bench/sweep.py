"""``bench --sweep`` (pools x io modes against in-memory) and ``bench --processes N`` (the noise floor)."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import List

import mlx.core as mx

from ...config import StreamingConfig
from ...run_settings import RunSettings
from .common import _inmemory, _refuse_unless_inmemory_fits, _say, _spread, _timed_runs, timed_greedy


def sweep(model_dir: Path, config: StreamingConfig, run: RunSettings, pools=(1.0, 0.25), io_modes=("buffered", "direct")) -> List[dict]:
    """Greedy decode tok/s and expert traffic: mlx-lm in-memory, then streaming at each pool fraction and io
    mode (the full pool only buffered: it reads each expert once)."""
    from mlx_lm.utils import load_tokenizer

    from ...model import build_streaming_model

    _refuse_unless_inmemory_fits(model_dir, "--sweep")
    prompt_ids = load_tokenizer(Path(model_dir)).encode(run.prompt)
    inmemory = _inmemory(model_dir, config, run, prompt_ids)
    reference = inmemory["ids"]
    rows = [{"scenario": "mlx-lm in-memory", "io_mode": "-", "pool_slots": "-", "tok_s": inmemory["tok_s"], "ids_match": True}]
    for fraction in pools:
        for io_mode in io_modes[:1] if fraction >= 1.0 else io_modes:
            cfg = config.with_pool(pool_fraction=fraction).replace(io_mode=io_mode)
            with build_streaming_model(model_dir, cfg) as sm:
                slots = sm.store.capacity
                if run.warmup_tokens:
                    timed_greedy(sm.model, prompt_ids, run.warmup_tokens, config.prefill_chunk)
                rates, (ids,), counters = _timed_runs(f"stream {fraction:.0%} {io_mode}", lambda: timed_greedy(sm.model, prompt_ids, run.max_tokens, config.prefill_chunk), sm.store, run.repeat)
            rows.append({"scenario": f"streaming {fraction:.0%}", "io_mode": io_mode, "pool_slots": slots, "tok_s": _spread(rates),
                         "ids_match": ids == reference, **{k: counters[k] / len(ids) for k in ("hits", "disk_loads", "bytes_read")}})
            mx.clear_cache()
    return rows


def sweep_table(rows: List[dict]) -> str:
    from tabulate import tabulate

    body = [[r["scenario"], r["io_mode"], r["pool_slots"], r["tok_s"]["median"], r.get("hits", "-"), r.get("disk_loads", "-"),
             r["bytes_read"] / 1e6 if "bytes_read" in r else "-", r["ids_match"]] for r in rows]
    return tabulate(body, headers=["scenario", "io mode", "slots/layer", "decode tok/s", "hits/tok", "disk loads/tok", "MB read/tok", "ids = in-memory"], floatfmt=".2f", missingval="-")


def noise_floor(argv: List[str], processes: int) -> dict:
    """Run ``mlx-streaming bench ARGV`` in ``processes`` fresh processes, one after another: the spread of the
    tok/s medians and ratios, and whether every process produced the same ids."""
    import subprocess
    import tempfile

    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(processes):
            out, ids = Path(tmp) / f"run{i}.json", Path(tmp) / f"ids{i}.json"
            _say(f"process {i + 1}/{processes}")
            done = subprocess.run([sys.executable, "-m", "mlx_streaming", "bench", *argv, "--json", str(out),
                                   "--dump-ids", str(ids)], stdout=subprocess.DEVNULL)
            if done.returncode != 0:
                from ...errors import StreamingError

                raise StreamingError(f"--processes: process {i + 1} of {processes} failed (exit status "
                                     f"{done.returncode}; its error is above)")
            runs.append((json.loads(out.read_text()), json.loads(ids.read_text())))

    def spread(values: List[float]) -> dict:
        median = statistics.median(values)
        return {"values": values, "median": median, "min": min(values), "max": max(values),
                "rel_spread": (max(values) - min(values)) / median if median else 0.0}

    return {
        "processes": processes,
        "greedy_tok_s": spread([r["greedy_tok_s"]["median"] for r, _ in runs]),
        "spec_tok_s": spread([r["spec_tok_s"]["median"] for r, _ in runs]),
        "speedup": spread([r["speedup"] for r, _ in runs]),
        "ids_identical_across_processes": all(ids == runs[0][1] for _, ids in runs),
        "disk_loads_identical": len({(r["greedy_io"]["disk_loads"], r["spec_io"]["disk_loads"]) for r, _ in runs}) == 1,
    }
