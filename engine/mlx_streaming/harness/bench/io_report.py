"""``bench --io``: the disk's ceiling against the engine's demand-read rate."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, List

from ...config import READ_THREADS, StreamingConfig
from ...run_settings import RunSettings
from ...io.reader import ExpertReader
from ..reference import InMemoryPlan
from .common import _costed, _interleaved, _say, _spread, greedy_path


def raw_read_probe(index, io_mode: str, experts: int = 256, seed: int = 0, batch: int = 1,
                   threads: int = READ_THREADS) -> dict:
    """Read ``experts`` random experts with a fresh reader, ``batch`` experts per read call (the engine reads
    one expert per call when it misses one, a layer's misses together), on ``threads`` native threads: the
    disk's rate at that request size and depth, in this io mode, without the engine around it."""
    import numpy as np

    rng = np.random.default_rng(seed)
    picks = [(int(rng.choice(index.layers)), int(rng.integers(index.num_experts))) for _ in range(experts)]
    reader, in_place = ExpertReader(io_mode, threads), 0
    try:
        start = time.perf_counter()
        for i in range(0, experts, batch):
            ranges = [(s.path, s.offset, s.nbytes) for layer, expert in picks[i:i + batch]
                      for s in index.slices(layer, expert)]
            reading = reader.start(ranges)
            reading.take(len(ranges))
            in_place += reading.in_place
        seconds = time.perf_counter() - start
    finally:
        reader.close()
    return {"experts": experts, "batch": batch, "threads": threads, "bytes": experts * index.expert_bytes,
            "seconds": seconds, "gbps": experts * index.expert_bytes / seconds / 1e9,
            "reads_per_expert": reader.reads / experts, "in_place": in_place / reader.reads}


def placement_probe(index, io_mode: str, experts: int = 32, seed: int = 0) -> dict:
    """The engine's placement of ``experts`` random experts of one layer (read first) into a fresh pool of that
    many slots (``ExpertPool.place``, its writes then evaluated) against a plain copy of the same host buffers
    to the device, two ways: an array per buffer (the bytes as they arrive), and one array of them all
    (concatenated on the host first: no cost per buffer). Where the device has memory of its own (CUDA) each copy
    includes a device copy of its arrays: until a kernel reads it, an array made from host bytes stays in host
    memory there. Bytes per second each, and placement over each copy; each is timed three times, the best
    kept."""
    import mlx.core as mx
    import numpy as np

    from ...residency.pool import ExpertPool, computes_in_host_memory

    layer = index.layers[0]
    picks = np.random.default_rng(seed).choice(index.num_experts, min(experts, index.num_experts), replace=False)
    picks = [int(e) for e in picks]
    reader = ExpertReader(io_mode)
    try:
        staged = {e: reader.read([(s.path, s.offset, s.nbytes) for s in index.slices(layer, e)]) for e in picks}
    finally:
        reader.close()
    nbytes = len(picks) * index.expert_bytes

    writes = []

    def place() -> float:
        pool = ExpertPool(index, len(picks), layers=[layer])
        writes.append(pool.writes)
        start = time.perf_counter()
        pool.place(layer, picks, staged, set(picks))
        mx.eval(list(pool.arrays[layer].values()))
        return time.perf_counter() - start

    to_device = not computes_in_host_memory()
    buffers = [buf for e in picks for buf in staged[e]]

    def copy(arrays: Callable[[], List]) -> float:
        start = time.perf_counter()
        made = arrays()
        mx.eval([a * 1 for a in made] if to_device else made)
        return time.perf_counter() - start

    place_s = min(place() for _ in range(3))
    each_s = min(copy(lambda: [mx.array(buf) for buf in buffers]) for _ in range(3))
    whole_s = min(copy(lambda: [mx.array(np.concatenate(buffers))]) for _ in range(3))
    return {"experts": len(picks), "bytes": nbytes, "writes": writes[-1], "place_gbps": nbytes / place_s / 1e9,
            "copy_gbps": nbytes / each_s / 1e9, "place_over_copy": each_s / place_s,
            "one_array_gbps": nbytes / whole_s / 1e9, "place_over_one_array": whole_s / place_s}


#: ``bench --io``'s grid for the disk's ceiling: experts per read call x native read threads. 16 threads: on an
#: H100 host's disk the default model's 25% pool waited 0.35-0.48 ms per token for packed reads with 16 against
#: 0.53-0.56 with the default 4.
CEILING_BATCHES = (1, 4, 16)
CEILING_THREADS = (1, 2, 4, 8, 16)


def io_ceiling(index, io_mode: str, top_k: int) -> dict:
    """The disk's best rate over request sizes (one expert, one layer's ``top_k``, and 16 experts per call)
    and native thread counts, each cell a fresh ``raw_read_probe`` of 256 random experts."""
    batches = sorted({1, top_k, *CEILING_BATCHES})
    cells = [raw_read_probe(index, io_mode, batch=b, threads=t, seed=i)
             for i, (b, t) in enumerate((b, t) for b in batches for t in CEILING_THREADS)]
    return {"cells": cells, "best": max(cells, key=lambda c: c["gbps"])}


def _demand_gbps(stats: dict) -> float:
    """The engine's demand-load rate: bytes read on the main thread over the seconds spent reading them."""
    return stats["demand_bytes"] / stats["read_s"] / 1e9 if stats["read_s"] else 0.0


def io_report(model_dir: Path, config: StreamingConfig, run: RunSettings) -> dict:
    """The disk's ceiling (``io_ceiling``), placement against a plain copy (``placement_probe``), then greedy
    decoding at the configured pool and io mode, in interleaved rounds with mlx-lm's in-memory model where it
    fits: the engine's demand-load rate (bytes read / seconds in demand reads) against the ceiling, and its time
    per token against its bound (``_bound``)."""
    from ...model import build_streaming_model

    with build_streaming_model(model_dir, config) as sm:
        _say(f"disk ceiling: request sizes x read threads ({config.io_mode})")
        ceiling = io_ceiling(sm.store.index, config.io_mode, sm.store.top_k)
        _say("placement against a plain copy of the same bytes")
        placement = placement_probe(sm.store.index, config.io_mode)
        prompt_ids = sm.tokenizer.encode(run.prompt)
        arms = {"streaming": _costed(greedy_path(sm.model, prompt_ids, config), sm.store)}
        plan = InMemoryPlan(model_dir)
        if plan.fits:
            import mlx_lm

            arms["in-memory"] = _costed(greedy_path(mlx_lm.load(str(model_dir))[0], prompt_ids, config), None)
        else:
            _say(f"no bound: compute time per token needs mlx-lm's in-memory model, and {plan.why_not}")
        rates, runs = _interleaved("greedy", arms, run)
        ids, (_, s) = runs["streaming"][-1]
        tokens = len(ids) - 1
        demand = _demand_gbps(s)
        report = {"model": str(model_dir), "io_mode": config.io_mode,
                  "layout": "packed" if config.packed_dir else "scattered", "pool_slots": sm.store.capacity,
                  "num_experts": sm.store.index.num_experts, "expert_bytes": sm.store.index.expert_bytes,
                  "read_threads": config.read_threads, "max_tokens": run.max_tokens, "repeat": run.repeat,
                  "ceiling": ceiling, "placement": placement, "demand_read_gbps": demand,
                  "demand_over_ceiling": demand / ceiling["best"]["gbps"],
                  "reads_per_load": s["demand_reads"] / s["misses"] if s["misses"] else 0.0,
                  "demand_in_place": s["reads_in_place"] / s["demand_reads"] if s["demand_reads"] else 0.0,
                  "greedy_tok_s": _spread(rates["streaming"]), "read_s_per_token": s["read_s"] / tokens,
                  "demand_bytes_per_token": s["demand_bytes"] / tokens}
        if "in-memory" in runs:
            report["bound"] = _bound(report, _spread(rates["in-memory"]),
                                     all(ids == runs["in-memory"][-1][0] for ids, _ in runs["streaming"]))
        return report


def _bound(report: dict, inmemory_tok_s: dict, ids_equal: bool) -> dict:
    """The pool's bound per token: its demand bytes at the disk's ceiling, plus in-memory's time per token
    (compute, with nothing to read); the engine's time per token over it, and over in-memory's."""
    read_ms = 1000 * report["demand_bytes_per_token"] / (report["ceiling"]["best"]["gbps"] * 1e9)
    compute_ms = 1000 / inmemory_tok_s["median"]
    engine_ms = 1000 / report["greedy_tok_s"]["median"]
    return {"read_ms": read_ms, "compute_ms": compute_ms, "bound_ms": read_ms + compute_ms, "engine_ms": engine_ms,
            "over_bound": engine_ms / (read_ms + compute_ms), "inmemory_tok_s": inmemory_tok_s,
            "x_inmemory": compute_ms / engine_ms, "ids_equal": ids_equal}


def io_table(report: dict) -> str:
    from tabulate import tabulate

    cells, best = report["ceiling"]["cells"], report["ceiling"]["best"]
    body = [[c["batch"], c["threads"], c["gbps"], c["reads_per_expert"], c["in_place"]] for c in cells]
    return (tabulate(body, headers=["experts per call", "read threads", "GB/s", "reads per expert", "in place"],
                     floatfmt=".3f")
            + f"\nio_mode={report['io_mode']} ({report['layout']} layout), {report['expert_bytes']} B per expert, 256 "
              f"random experts per cell. Ceiling {best['gbps']:.3f} GB/s ({best['batch']} per call, {best['threads']} "
              f"threads). The engine's demand loads (greedy, pool {report['pool_slots']} of {report['num_experts']}, "
              f"{report['max_tokens']} tokens x {report['repeat']}, --read-threads {report['read_threads']}): "
              f"{report['demand_read_gbps']:.3f} GB/s = "
              f"{report['demand_over_ceiling']:.2f} of the ceiling, {1000 * report['read_s_per_token']:.2f} ms reading "
              f"per token, {report['demand_in_place']:.2f} of its reads in place{_depth_advice(report)}. "
              "(In place: O_DIRECT reads straight into their buffers, offset, length and memory page-aligned; the "
              f"rest go through a bounce buffer.){_layout_advice(report)} {_placement_line(report['placement'])}"
              + _bound_line(report))


def _bound_line(report: dict) -> str:
    b = report.get("bound")
    if b is None:
        return "\nNo bound: mlx-lm's in-memory model does not fit this machine, so its compute time is not known."
    return (f"\nBound per token: {report['demand_bytes_per_token'] / 1e6:.2f} MB of misses at the ceiling "
            f"({b['read_ms']:.2f} ms) plus in-memory's {b['compute_ms']:.2f} ms = {b['bound_ms']:.2f} ms; the engine "
            f"took {b['engine_ms']:.2f} ms = {b['over_bound']:.2f}x its bound and {b['x_inmemory']:.3f}x of in-memory "
            f"(greedy, {report['repeat']} interleaved rounds, medians; ids "
            f"{'equal' if b['ids_equal'] else 'NOT equal'})")


def _placement_line(p: dict) -> str:
    return (f"Placement of {p['experts']} experts into a pool ({p['writes']} writes): {p['place_gbps']:.3f} GB/s; a "
            f"plain copy of the same "
            f"bytes to the device: {p['copy_gbps']:.3f} GB/s as they arrive (an array per buffer), "
            f"{p['one_array_gbps']:.3f} GB/s as one array; placement {p['place_over_copy']:.2f} and "
            f"{p['place_over_one_array']:.2f} of them")


def _depth_advice(report: dict) -> str:
    """Where the disk's best cell ran another number of reads in flight than the engine: the option that matches it."""
    best = report["ceiling"]["best"]["threads"]
    return f" (the disk's best cell ran {best} threads: try --read-threads {best})" if best != report["read_threads"] else ""


def _layout_advice(report: dict) -> str:
    """Where each expert took several reads (one per tensor: the layout mlx_lm.convert writes), the packed
    layout, which reads each in one."""
    reads = report["ceiling"]["best"]["reads_per_expert"]
    if reads <= 1:
        return ""
    return (f" Each expert took {reads:g} reads in this layout; the packed layout reads it in one: "
            f"mlx-streaming repack --model {report['model']} --out DIR, then --packed DIR.")
