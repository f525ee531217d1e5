"""The benchmark: greedy and speculative decoding on one streaming model, side by side in one process, and
mlx-lm's in-memory model beside them.

``run`` warms both paths for ``warmup_tokens``, then times each ``repeat`` times and reports medians; the
counters come from the last run of each path (the store is reset before every run). With ``compare_inmemory``
mlx-lm's in-memory model is loaded once the streaming model is gone and timed the same way: ``table``'s rows
give each path's tok/s, its ratio to in-memory, hit rate, bytes read, the memory each model held (its weight
arrays, and MLX's peak above what MLX held before it was built) and whether its ids equal in-memory's.
``mlx-streaming bench`` with no options runs it on the default model at a quarter-size pool read with the page
cache bypassed (``cli.BENCH_DEFAULTS``). Decode tok/s starts
after the prompt's prefill. Ratios (speedup, disk-load ratio, streaming / in-memory) are measured in the
same process and are comparable across machines; absolute tok/s are not. ``sweep`` is the pool-size /
io-mode table: mlx-lm in-memory against streaming at several pools, greedy only.

A ``buffered`` figure read from a page cache that holds the shards measures memory copies, not the disk;
``direct`` bypasses the cache (O_DIRECT / F_NOCACHE). Every result names its io mode.
"""

from __future__ import annotations

import gc
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, List, Optional

import mlx.core as mx

from ..config import StreamingConfig
from ..errors import ConfigError
from ..generate import greedy_generate, greedy_steps
from ..io.reader import READ_THREADS, ExpertReader
from ..mtp.drafter import MTPDrafter
from ..mtp.profile import union_profile
from ..mtp.speculative import mtp_generate
from ..mtp.triage import first_divergence
from .reference import InMemoryPlan
from .report import diagnostics_report


def _say(text: str) -> None:
    print(f"[bench] {text}", file=sys.stderr, flush=True)


def timed_greedy(model, prompt_ids, max_tokens: int, prefill_chunk: int,
                 on_decode: Optional[Callable[[], None]] = None) -> tuple:
    """(decode tok/s, ids): the clock starts once the prompt is prefilled (its logits give the first token),
    where ``on_decode()`` is called."""
    start = []

    def prefilled():
        if on_decode is not None:
            on_decode()
        start.append(time.perf_counter())

    ids = [token for token, _ in greedy_steps(model, prompt_ids, max_tokens, prefill_chunk, prefilled)]
    return (max_tokens - 1) / (time.perf_counter() - start[0]), ids


def _spread(rates: List[float]) -> dict:
    return {"median": statistics.median(rates), "runs": rates, "min": min(rates), "max": max(rates)}


def _store_counters(store) -> dict:
    s = store.stats()
    looked_up = s["hits"] + s["misses"]
    return {"disk_loads": s["demand_loads"] + s.get("prefetch_loads", 0), "hits": s["hits"], "hit_rate": s["hits"] / looked_up if looked_up else 0.0,
            "bytes_read": s["bytes_read"], "evictions": s["evictions"], "fastpath": s["fastpath"],
            "fallback": s["fallback"], "grouped": s["grouped"],
            **{k: v for k, v in s.items() if k.startswith(("verify_", "prefetch_")) or k == "demand_loads"}}


def _timed_runs(label: str, once: Callable[[], tuple], store, repeat: int) -> tuple:
    """Run ``once`` ``repeat`` times, resetting the store's counters first; (rates, last result, counters)."""
    rates = []
    for i in range(repeat):
        if store is not None:
            store.reset_stats()
        _say(f"{label}: run {i + 1}/{repeat}")
        rate, *result = once()
        rates.append(rate)
    return rates, result, _store_counters(store) if store is not None else {}


def _memory_mark() -> int:
    """MLX's active bytes now, its cache emptied and its peak reset: what ``_peak_growth`` counts from."""
    gc.collect()
    mx.clear_cache()
    mx.reset_peak_memory()
    return mx.get_active_memory()


def _peak_growth(mark: int) -> int:
    """MLX's peak bytes since ``_memory_mark`` above what was active then."""
    return max(0, mx.get_peak_memory() - mark)


def _streaming_weights(sm) -> int:
    """Bytes of the weight arrays a streaming model holds as built: dense weights, expert pool, MTP head."""
    from .memory import resident_dense_bytes

    head = resident_dense_bytes(sm.mtp, sm.store) if sm.mtp is not None else 0
    return resident_dense_bytes(sm.model, sm.store) + sm.store.pool.nbytes + head


def run(model_dir: Path, config: StreamingConfig, compare_inmemory: bool = False) -> dict:
    """One benchmark of ``config`` on ``model_dir``: the result dict the CLI prints and perf tests store."""
    from ..model import build_streaming_model
    from .memory import memory_snapshot

    inmemory_plan = InMemoryPlan(model_dir)
    if compare_inmemory and not inmemory_plan.fits:
        _say(f"no in-memory comparison: {inmemory_plan.why_not}")
        compare_inmemory = False
    mark = _memory_mark()
    _say(f"building the streaming model from {model_dir}")
    with build_streaming_model(model_dir, config.replace(mtp=True)) as sm:
        prompt_ids = sm.tokenizer.encode(config.prompt)
        K, mode, chunk, n = config.k, config.verify_mode, config.prefill_chunk, config.max_tokens
        weights = _streaming_weights(sm)

        def greedy_once():
            return timed_greedy(sm.model, prompt_ids, n, chunk)

        def spec_once():
            ids, stats = mtp_generate(sm.model, MTPDrafter(sm.mtp, sm.model), prompt_ids, n, K, mode, chunk)
            return stats["decode_tok_s"], ids, stats

        if config.warmup_tokens:
            _say(f"warming up both paths ({config.warmup_tokens} tokens)")
            timed_greedy(sm.model, prompt_ids, config.warmup_tokens, chunk)
            mtp_generate(sm.model, MTPDrafter(sm.mtp, sm.model), prompt_ids, config.warmup_tokens, K, mode, chunk)
        greedy_rates, (greedy_ids,), greedy_counters = _timed_runs("greedy", greedy_once, sm.store, config.repeat)
        sm.store.route_log = []
        spec_rates, (spec_ids, spec_stats), spec_counters = _timed_runs("speculative", spec_once, sm.store, config.repeat)
        k_hist = spec_stats["k_hist"]
        unions = union_profile(sm.store.route_log, max(set(k_hist), key=k_hist.count) if k_hist else K)
        sm.store.route_log = None

        divergence = first_divergence(spec_ids, greedy_ids, _margins(sm.model, prompt_ids, n, chunk)) if spec_ids != greedy_ids else None
        result = {
            "model": str(model_dir), "K": K, "max_tokens": n, "warmup": config.warmup_tokens, "repeat": config.repeat,
            "prompt": config.prompt, "prefill_chunk": chunk, "io_mode": config.io_mode,
            "pool_slots": sm.store.capacity, "num_experts": sm.store.index.num_experts,
            "pinned_experts": sum(len(p.pinned) for p in sm.store.pool.policies.values()),
            "exact_match": spec_ids == greedy_ids,
            "n_mismatch": sum(a != b for a, b in zip(spec_ids, greedy_ids)),
            "first_divergence": None if divergence is None else {**divergence.__dict__, "near_tie": divergence.near_tie},
            "greedy_tok_s": _spread(greedy_rates), "spec_tok_s": _spread(spec_rates),
            "speedup": statistics.median(spec_rates) / statistics.median(greedy_rates),
            **{k: spec_stats[k] for k in ("avg_accept_len", "tokens_per_step", "steps", "verify_mode", "direct_commits",
                                          "fallback_replays", "replayed_tokens", "accept_hist")},
            "spec_time_s": spec_stats["time_s"], "projected_tok_s_free_replay": spec_stats["projected_tok_s_free_replay"],
            "greedy_io": greedy_counters, "spec_io": spec_counters,
            "disk_load_ratio": spec_counters["disk_loads"] / greedy_counters["disk_loads"] if greedy_counters["disk_loads"] else None,
            "union_of_experts": unions, "k_choice": spec_stats.get("k_choice"),
            "memory": memory_snapshot(sm),
            "pool": sm.plan.note,
        }
        result["memory"]["weights_bytes"] = weights
        result["memory"]["mlx_peak_growth_bytes"] = _peak_growth(mark)
        if config.diagnostics:
            result["diagnostics"] = diagnostics_report(sm.store).splitlines()
    del sm  # gone before the in-memory model loads: neither is counted in the other's memory
    if compare_inmemory:
        result["inmemory"] = _inmemory(model_dir, config, prompt_ids)
        result["streaming_over_inmemory"] = result["greedy_tok_s"]["median"] / result["inmemory"]["tok_s"]["median"]
        inmemory_ids = result["inmemory"].pop("ids")
        result["inmemory_ids_match"] = inmemory_ids == greedy_ids
        result["spec_inmemory_ids_match"] = inmemory_ids == spec_ids
    if config.dump_ids:
        Path(config.dump_ids).write_text(json.dumps({"greedy": greedy_ids, "speculative": spec_ids}))
    return result


def _margins(model, prompt_ids, n, chunk) -> list:
    margins = []
    greedy_generate(model, prompt_ids, n, chunk, margins=margins)
    return margins


def _refuse_unless_inmemory_fits(model_dir: Path, mode: str) -> None:
    """One line instead of the kernel's kill, for a mode that measures against mlx-lm's in-memory model."""
    plan = InMemoryPlan(model_dir)
    if not plan.fits:
        raise ConfigError(f"bench {mode} measures against mlx-lm's in-memory model, and {plan.why_not}")


def _inmemory(model_dir: Path, config: StreamingConfig, prompt_ids) -> dict:
    """mlx-lm's in-memory greedy decode tok/s and ids, with the bytes of its weights (every one read at load)
    and MLX's peak above what was active before it loaded."""
    import mlx_lm
    from mlx.utils import tree_flatten

    mark = _memory_mark()
    _say("loading mlx-lm's in-memory model")
    model, _ = mlx_lm.load(str(model_dir))
    weights = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    if config.warmup_tokens:
        timed_greedy(model, prompt_ids, config.warmup_tokens, config.prefill_chunk)
    rates, (ids,), _ = _timed_runs("in-memory greedy", lambda: timed_greedy(model, prompt_ids, config.max_tokens, config.prefill_chunk), None, config.repeat)
    peak = _peak_growth(mark)
    del model
    mx.clear_cache()
    return {"tok_s": _spread(rates), "ids": ids, "weights_bytes": weights, "mlx_peak_growth_bytes": peak}


def table(result: dict) -> str:
    """The streaming paths (and mlx-lm's in-memory model, where it ran) side by side, then what they were."""
    from tabulate import tabulate

    memory = result["memory"]
    inmemory = result.get("inmemory")
    base = inmemory["tok_s"]["median"] if inmemory else None
    rows = []
    if inmemory:
        rows.append(["mlx-lm in-memory greedy", _f(base, 2), _f(1.0, 3), "-", "-", "0",
                     _f(inmemory["weights_bytes"] / 1e6, 1), _f(inmemory["mlx_peak_growth_bytes"] / 1e6, 1), "(reference)"])
    paths = (("streaming greedy", "greedy_tok_s", "greedy_io", result.get("inmemory_ids_match", "(reference)")),
             (f"streaming MTP K={result['K']} ({result['verify_mode']})", "spec_tok_s", "spec_io",
              result.get("spec_inmemory_ids_match", result["exact_match"])))
    for label, key, io, ids_equal in paths:
        t, c = result[key], result[io]
        rows.append([label, _f(t["median"], 2), _f(t["median"] / base, 3) if base else "-", _f(c["hit_rate"], 3),
                     c["disk_loads"], _f(c["bytes_read"] / 1e6, 1), _f(memory["weights_bytes"] / 1e6, 1),
                     _f(memory["mlx_peak_growth_bytes"] / 1e6, 1), ids_equal])
    reference = "in-memory" if inmemory else "streaming greedy"
    head = tabulate(rows, headers=["path", "tok/s", "x in-memory", "hit rate", "disk loads", "MB read", "weights MB",
                                   "MLX peak MB", f"ids = {reference}"], disable_numparse=True,
                    colalign=("left",) + ("right",) * 8)
    u = result["union_of_experts"]
    summary = [
        f"tok/s: median of {result['repeat']} timed runs of {result['max_tokens']} tokens each, from the end of the "
        f"prompt's prefill. hit rate, disk loads, MB read: the last timed run of each path (prompt prefill + "
        f"{result['max_tokens']} tokens), after {result['warmup']} warm-up tokens whose pool state carries over; disk "
        f"loads = demand + prefetch reads, MB read = every byte read from disk (demand and prefetch)"
        + (f"; in-memory reads its {inmemory['weights_bytes'] / 1e6:.1f} MB of weights once at load, none while "
           f"decoding" if inmemory else ""),
        "weights MB: the weight arrays each model holds in MLX memory (in-memory: every weight; streaming: dense "
        "weights + expert pool + MTP head). MLX peak MB: MLX's peak memory from the model's load/build through its "
        "timed runs, above what MLX held before (weights, KV caches, activations, temporaries; both streaming rows "
        "are one model). MB = 10^6 bytes",
        result["pool"],
        f"model {result['model']}  io_mode={result['io_mode']}  pool {result['pool_slots']}/{result['num_experts']} experts per layer  "
        f"max_tokens={result['max_tokens']} warmup={result['warmup']} repeat={result['repeat']}",
        f"speedup {result['speedup']:.3f}x  exact_match={result['exact_match']}  avg accept {result['avg_accept_len']:.3f} per step  "
        f"steps {result['steps']}  disk-load ratio {result['disk_load_ratio'] if result['disk_load_ratio'] is None else round(result['disk_load_ratio'], 3)}",
        f"union of experts per verify: avg {u.get('avg', 0):.1f}  p99 {u.get('p99', 0):.1f}  max {u.get('max', 0)}",
        f"streaming model, after its runs: MLX active {result['memory']['mlx_active_gb']:.3f} GB, peak {result['memory']['mlx_peak_gb']:.3f} GB, RSS {result['memory']['rss_gb']:.3f} GB",
    ]
    for row in result.get("k_choice") or []:
        measured = row["ms_per_step"] is not None
        summary.append(
            f"K={row['K']}: {row['steps']} steps" + (f", {row['ms_per_step']:.1f} ms per step, expected "
            f"{row['expected_tokens_per_step']:.2f} tokens per step = {row['expected_tok_s']:.2f} tok/s, achieved "
            f"{row['achieved_tok_s']:.2f} tok/s" if measured else "") + ("  <- chosen" if row["chosen"] else ""))
    summary.extend(result.get("diagnostics", []))
    return head + "\n" + "\n".join(summary)


def _f(value: float, digits: int) -> str:
    return f"{value:.{digits}f}"


def sweep(model_dir: Path, config: StreamingConfig, pools=(1.0, 0.25), io_modes=("buffered", "direct")) -> List[dict]:
    """Greedy decode tok/s and expert traffic: mlx-lm in-memory, then streaming at each pool fraction and io
    mode (the full pool only buffered: it reads each expert once)."""
    from mlx_lm.utils import load_tokenizer

    from ..model import build_streaming_model

    _refuse_unless_inmemory_fits(model_dir, "--sweep")
    prompt_ids = load_tokenizer(Path(model_dir)).encode(config.prompt)
    inmemory = _inmemory(model_dir, config, prompt_ids)
    reference = inmemory["ids"]
    rows = [{"scenario": "mlx-lm in-memory", "io_mode": "-", "pool_slots": "-", "tok_s": inmemory["tok_s"], "ids_match": True}]
    for fraction in pools:
        for io_mode in io_modes[:1] if fraction >= 1.0 else io_modes:
            cfg = config.with_pool(pool_fraction=fraction).replace(io_mode=io_mode)
            with build_streaming_model(model_dir, cfg) as sm:
                slots = sm.store.capacity
                if config.warmup_tokens:
                    timed_greedy(sm.model, prompt_ids, config.warmup_tokens, config.prefill_chunk)
                rates, (ids,), counters = _timed_runs(f"stream {fraction:.0%} {io_mode}", lambda: timed_greedy(sm.model, prompt_ids, config.max_tokens, config.prefill_chunk), sm.store, config.repeat)
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
                from ..errors import StreamingError

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


def raw_read_probe(index, io_mode: str, experts: int = 256, seed: int = 0, batch: int = 1,
                   threads: int = READ_THREADS) -> dict:
    """Read ``experts`` random experts with a fresh reader, ``batch`` experts per read call (the engine reads
    one expert per call when it misses one, a layer's misses together), on ``threads`` native threads: the
    disk's rate at that request size and depth, in this io mode, without the engine around it."""
    import numpy as np

    rng = np.random.default_rng(seed)
    picks = [(int(rng.choice(index.layers)), int(rng.integers(index.num_experts))) for _ in range(experts)]
    reader = ExpertReader(io_mode, threads)
    try:
        start = time.perf_counter()
        for i in range(0, experts, batch):
            reader.read([(s.path, s.offset, s.nbytes) for layer, expert in picks[i:i + batch]
                         for s in index.slices(layer, expert)])
        seconds = time.perf_counter() - start
    finally:
        reader.close()
    return {"experts": experts, "batch": batch, "threads": threads, "bytes": experts * index.expert_bytes,
            "seconds": seconds, "gbps": experts * index.expert_bytes / seconds / 1e9,
            "reads_per_expert": reader.reads / experts}


#: ``bench --io``'s grid for the disk's ceiling: experts per read call x native read threads.
CEILING_BATCHES = (1, 4, 16)
CEILING_THREADS = (1, 2, 4, 8)


def io_ceiling(index, io_mode: str, top_k: int) -> dict:
    """The disk's best rate over request sizes (one expert, one layer's ``top_k``, and 16 experts per call)
    and native thread counts, each cell a fresh ``raw_read_probe`` of 256 random experts."""
    batches = sorted({1, top_k, *CEILING_BATCHES})
    cells = [raw_read_probe(index, io_mode, batch=b, threads=t, seed=i)
             for i, (b, t) in enumerate((b, t) for b in batches for t in CEILING_THREADS)]
    return {"cells": cells, "best": max(cells, key=lambda c: c["gbps"])}


def _greedy_runs(sm, config: StreamingConfig, label: str) -> tuple:
    """Warm up, then ``config.repeat`` timed greedy decodes of the config's prompt on the built model ``sm``:
    (rates, the last run's ids, the bench counters, the store's raw stats)."""
    prompt_ids = sm.tokenizer.encode(config.prompt)
    if config.warmup_tokens:
        timed_greedy(sm.model, prompt_ids, config.warmup_tokens, config.prefill_chunk)
    rates, (ids,), counters = _timed_runs(
        label, lambda: timed_greedy(sm.model, prompt_ids, config.max_tokens, config.prefill_chunk), sm.store, config.repeat)
    return rates, ids, counters, sm.store.stats()


def _demand_gbps(stats: dict) -> float:
    """The engine's demand-load rate: bytes read on the main thread over the seconds spent reading them."""
    return stats["demand_bytes"] / stats["read_s"] / 1e9 if stats["read_s"] else 0.0


def io_report(model_dir: Path, config: StreamingConfig) -> dict:
    """The disk's ceiling (``io_ceiling``), then greedy decoding at the configured pool and io mode: the
    engine's demand-load rate (bytes read / seconds in demand reads) against the ceiling."""
    from ..model import build_streaming_model

    with build_streaming_model(model_dir, config) as sm:
        _say(f"disk ceiling: request sizes x read threads ({config.io_mode})")
        ceiling = io_ceiling(sm.store.index, config.io_mode, sm.store.top_k)
        rates, ids, counters, s = _greedy_runs(sm, config, "greedy")
        demand = _demand_gbps(s)
        return {"model": str(model_dir), "io_mode": config.io_mode, "layout": "packed" if config.packed_dir else "scattered",
                "pool_slots": sm.store.capacity, "num_experts": sm.store.index.num_experts,
                "expert_bytes": sm.store.index.expert_bytes, "max_tokens": config.max_tokens, "repeat": config.repeat,
                "ceiling": ceiling, "demand_read_gbps": demand, "demand_over_ceiling": demand / ceiling["best"]["gbps"],
                "reads_per_load": sm.store.reader.reads / s["misses"] if s["misses"] else 0.0,
                "greedy_tok_s": _spread(rates), "greedy_io": counters, "read_s_per_token": s["read_s"] / len(ids)}


def io_table(report: dict) -> str:
    from tabulate import tabulate

    cells, best = report["ceiling"]["cells"], report["ceiling"]["best"]
    body = [[c["batch"], c["threads"], c["gbps"], c["reads_per_expert"]] for c in cells]
    return (tabulate(body, headers=["experts per call", "read threads", "GB/s", "reads per expert"], floatfmt=".3f")
            + f"\nio_mode={report['io_mode']} ({report['layout']} layout), {report['expert_bytes']} B per expert, 256 "
              f"random experts per cell. Ceiling {best['gbps']:.3f} GB/s ({best['batch']} per call, {best['threads']} "
              f"threads). The engine's demand loads (greedy, pool {report['pool_slots']} of {report['num_experts']}, "
              f"{report['max_tokens']} tokens x {report['repeat']}): {report['demand_read_gbps']:.3f} GB/s = "
              f"{report['demand_over_ceiling']:.2f} of the ceiling, {1000 * report['read_s_per_token']:.2f} ms reading "
              f"per token")


#: ``bench --k-report``: every fixed K (1: no drafts) and "auto".
K_REPORT = (1, 2, 3, 4, "auto")


def _interleaved(label: str, arms: dict, config: StreamingConfig) -> tuple:
    """Warm every arm up (``arms``: name -> ``once(n)``, which decodes ``n`` tokens and returns (tok/s, ids,
    extra)), then ``config.repeat`` rounds running each arm once, interleaved, so a drifting machine moves them
    alike: (tok/s per arm per round, each arm's (ids, extra) per round)."""
    for once in arms.values():
        once(max(2, config.warmup_tokens))
    rates, runs = {name: [] for name in arms}, {name: [] for name in arms}
    for i in range(config.repeat):
        _say(f"{label}: round {i + 1}/{config.repeat}")
        for name, once in arms.items():
            rate, ids, extra = once(config.max_tokens)
            rates[name].append(rate)
            runs[name].append((ids, extra))
    return rates, runs


def _versus_best(rates: dict, auto) -> dict:
    """Medians per arm, the best arm that is not ``auto``, and auto over it."""
    medians = {name: statistics.median(v) for name, v in rates.items()}
    best = max((name for name in rates if name != auto), key=medians.get)
    return {"tok_s": {str(name): _spread(v) for name, v in rates.items()}, "best_fixed": best,
            "auto_over_best": medians[auto] / medians[best]}


def k_report(model_dir: Path, config: StreamingConfig) -> dict:
    """MTP speculation at every fixed K and at "auto", interleaved (``_interleaved``): median decode tok/s per
    K, auto over the best fixed K, the K auto chose per step, and every run's ids against greedy's."""
    from ..model import build_streaming_model

    with build_streaming_model(model_dir, config.replace(mtp=True)) as sm:
        prompt_ids = sm.tokenizer.encode(config.prompt)
        greedy = greedy_generate(sm.model, prompt_ids, config.max_tokens, config.prefill_chunk)

        def arm(k):
            def once(n):
                ids, stats = mtp_generate(sm.model, MTPDrafter(sm.mtp, sm.model), prompt_ids, n, k, config.verify_mode,
                                          config.prefill_chunk)
                return stats["decode_tok_s"], ids, stats["k_hist"]
            return once

        rates, runs = _interleaved("K report", {k: arm(k) for k in K_REPORT}, config)
        chosen = runs["auto"][-1][1]
        return {"model": str(model_dir), "pool_slots": sm.store.capacity, "max_tokens": config.max_tokens,
                "repeat": config.repeat, **_versus_best(rates, "auto"),
                "auto_k_steps": {str(k): chosen.count(k) for k in sorted(set(chosen))},
                "ids_equal_greedy": all(ids == greedy for arm_runs in runs.values() for ids, _ in arm_runs)}


def prefetch_auto_report(model_dir: Path, config: StreamingConfig) -> dict:
    """Greedy decoding with prefetch off, on and auto (three models of the config's pool, run interleaved):
    median tok/s each, auto over the better of on and off, auto's decisions, and the ids of every arm."""
    from contextlib import ExitStack

    from ..model import build_streaming_model

    with ExitStack() as stack:
        models = {arm: stack.enter_context(build_streaming_model(model_dir, config.replace(prefetch=arm)))
                  for arm in (False, True, "auto")}
        prompt_ids = models[False].tokenizer.encode(config.prompt)

        def arm(sm):
            def once(n):
                return (*timed_greedy(sm.model, prompt_ids, n, config.prefill_chunk), None)
            return once

        names = {False: "off", True: "on", "auto": "auto"}
        rates, runs = _interleaved("prefetch report", {names[a]: arm(sm) for a, sm in models.items()}, config)
        switch = models["auto"].store.prefetch_switch
        return {"model": str(model_dir), "pool_slots": models[False].store.capacity, "io_mode": config.io_mode,
                "max_tokens": config.max_tokens, "repeat": config.repeat, **_versus_best(rates, "auto"),
                "auto_decisions": ["on" if d else "off" for d in switch.decisions],
                "auto_measured_s_per_token": {("on" if a else "off"): v for a, v in switch.measured.items()},
                "ids_identical": len({tuple(ids) for arm_runs in runs.values() for ids, _ in arm_runs}) == 1}


def auto_table(report: dict, what: str) -> str:
    """``k_report`` (``what`` "K") or ``prefetch_auto_report`` ("prefetch") as a table."""
    from tabulate import tabulate

    best = report["tok_s"][str(report["best_fixed"])]["median"]
    body = [[name, v["median"], v["min"], v["max"], v["median"] / best] for name, v in report["tok_s"].items()]
    detail = (f"auto's steps by K in the last round: {report['auto_k_steps']}; every run's ids equal greedy's: "
              f"{report['ids_equal_greedy']}" if what == "K" else
              f"auto's decisions: {report['auto_decisions']}, its last probes (s per token): "
              f"{report['auto_measured_s_per_token']}; ids identical across arms: {report['ids_identical']}")
    return (tabulate(body, headers=[what, "tok/s (median)", "min", "max", f"x best fixed {what}"], floatfmt=".3f")
            + f"\npool {report['pool_slots']} slots, {report['max_tokens']} tokens x {report['repeat']} rounds, arms "
              f"interleaved. auto / best fixed ({report['best_fixed']}): {report['auto_over_best']:.3f}; {detail}")


#: The rows of ``prefetch_report``: (label, pool at its minimum, prefetch, ahead, mult).
PREFETCH_ROWS = (("naive (pool = top_k)", True, False, 0, 1), ("LRU", False, False, 0, 1),
                 ("LRU + prefetch ahead 0", False, True, 0, 1), ("LRU + prefetch ahead 1", False, True, 1, 1),
                 ("LRU + prefetch ahead 0 mult 2", False, True, 0, 2),
                 ("LRU + prefetch ahead 1 mult 2", False, True, 1, 2))


def _prefetch_row(model_dir: Path, config: StreamingConfig, label: str) -> dict:
    from ..model import build_streaming_model

    _say(f"{label}: building")
    with build_streaming_model(model_dir, config) as sm:
        rates, ids, counters, s = _greedy_runs(sm, config, label)
        row = {"label": label, "layout": "packed" if config.packed_dir else "scattered", "pool_slots": sm.store.capacity,
               "prefetch": config.prefetch, "ahead": config.prefetch_ahead, "mult": config.prefetch_mult,
               "tok_s": _spread(rates), "io": counters, "place_s": s["place_s"], "read_s": s["read_s"],
               "demand_read_gbps": _demand_gbps(s), "ids": ids}
        if sm.store.predictor is not None:
            row["diagnostics"] = sm.store.predictor.diagnostics.stats()
    recall = row["diagnostics"]["decode"]["recall"] if "diagnostics" in row else None
    _say(f"{label} ({row['layout']}): {row['tok_s']['median']:.3f} tok/s, demand loads {counters['demand_loads']}, "
         f"prefetch hits {counters.get('prefetch_hits', 0)}, decode recall {recall}")
    return row


def prefetch_report(model_dir: Path, config: StreamingConfig) -> dict:
    """Greedy decoding side by side: the pool at its minimum, the configured LRU pool, and LRU with prefetch
    (ahead 0 and 1, mult 1 and 2, with diagnostics), plus the raw disk rate at the expert read size. With
    ``packed_dir`` the LRU and prefetch rows run again on the packed layout."""
    from ..model import build_streaming_model

    with build_streaming_model(model_dir, config.replace(packed_dir=None)) as sm:
        _say(f"raw read probe ({config.io_mode})")
        raw = raw_read_probe(sm.store.index, config.io_mode)
        top_k = sm.store.top_k
    layouts = [None] + ([config.packed_dir] if config.packed_dir else [])
    rows = []
    for layout in layouts:
        for label, minimum, prefetch, ahead, mult in PREFETCH_ROWS:
            if layout and (minimum or mult > 1):
                continue
            row_config = config.replace(packed_dir=layout, prefetch=prefetch, prefetch_ahead=ahead, prefetch_mult=mult,
                                        diagnostics=bool(prefetch))
            if minimum:
                row_config = row_config.with_pool(pool_slots=top_k)
            rows.append(_prefetch_row(model_dir, row_config, label))
    reference = rows[1]["tok_s"]["median"]
    ids = [row.pop("ids") for row in rows]
    for row in rows:
        row["over_lru"] = row["tok_s"]["median"] / reference
    return {"model": str(model_dir), "io_mode": config.io_mode, "max_tokens": config.max_tokens,
            "repeat": config.repeat, "raw_read": raw, "ids_identical": all(i == ids[0] for i in ids), "rows": rows}


def prefetch_table(report: dict) -> str:
    from tabulate import tabulate

    headers = ["path", "layout", "pool", "tok/s", "x LRU", "demand loads", "prefetch hits", "demand GB/s",
               "recall (decode)", "A: not finished", "A: evicted", "B: not predicted"]
    body = []
    for r in report["rows"]:
        d = (r.get("diagnostics") or {}).get("decode")
        body.append([r["label"], r["layout"], r["pool_slots"], r["tok_s"]["median"], r["over_lru"],
                     r["io"]["demand_loads"], r["io"].get("prefetch_hits", 0), r["demand_read_gbps"],
                     d["recall"] if d else "", d["a_not_finished"] if d else "", d["a_evicted"] if d else "",
                     d["b_not_predicted"] if d else ""])
    raw = report["raw_read"]
    return (tabulate(body, headers=headers, floatfmt=".3f") +
            f"\nio_mode={report['io_mode']}  raw read {raw['gbps']:.3f} GB/s at {raw['bytes'] // raw['experts']} B "
            f"per expert ({raw['experts']} experts)  max_tokens={report['max_tokens']} repeat={report['repeat']}  "
            f"ids identical across rows: {report['ids_identical']}")


def overhead_report(model_dir: Path, config: StreamingConfig) -> dict:
    """The engine's own cost per token: mlx-lm's in-memory greedy against streaming greedy (and MTP
    speculation where the model has a head) at the configured pool, with the miss check per MoE layer and
    per token, every path built first and run in interleaved rounds (``_interleaved``), so a drifting machine
    moves them alike. Per row: decode tok/s (median), ms per token, the process's CPU ms per decoded token
    (median) and, from the last round, the engine's host syncs and the store's timed parts per decoded token;
    every round's ids against in-memory's. Every per-token figure counts from the end of the prompt's prefill."""
    from contextlib import ExitStack

    import mlx_lm

    from ..model import build_streaming_model

    _refuse_unless_inmemory_fits(model_dir, "--overhead")
    model, tokenizer = mlx_lm.load(str(model_dir))
    prompt_ids = tokenizer.encode(config.prompt)
    has_mtp = (Path(model_dir) / "mtp.safetensors").exists() or config.mtp_path
    with ExitStack() as stack:
        arms = {("mlx-lm in-memory greedy", None): _costed(_greedy_path(model, prompt_ids, config), None)}
        slots = {}
        for miss_check in ("layer", "token"):
            sm = stack.enter_context(build_streaming_model(model_dir, config.replace(miss_check=miss_check,
                                                                                     mtp=bool(has_mtp))))
            slots[miss_check] = sm.store.capacity
            arms[("streaming greedy", miss_check)] = _costed(_greedy_path(sm.model, prompt_ids, config), sm.store)
            if has_mtp:
                arms[(f"streaming MTP K={config.k}", miss_check)] = _costed(_speculative_path(sm, prompt_ids, config),
                                                                            sm.store)
        rates, runs = _interleaved("overhead", arms, config)
    inmemory_ids = runs[("mlx-lm in-memory greedy", None)][-1][0]
    rows = []
    for (path, miss_check), arm_runs in runs.items():
        cpu = statistics.median(cpu for _, (cpu, _) in arm_runs)
        ids, (_, stats) = arm_runs[-1]
        ids_match = all(ids == inmemory_ids for ids, _ in arm_runs)
        rows.append(_overhead_row(path, miss_check, rates[(path, miss_check)], cpu, stats, len(ids) - 1, ids_match,
                                  slots.get(miss_check)))
    return {"model": str(model_dir), "device": str(mx.default_device()), "io_mode": config.io_mode,
            "max_tokens": config.max_tokens, "warmup": config.warmup_tokens, "repeat": config.repeat, "rows": rows}


def _greedy_path(model, prompt_ids, config: StreamingConfig) -> Callable:
    return lambda n, on_decode: timed_greedy(model, prompt_ids, n, config.prefill_chunk, on_decode)


def _speculative_path(sm, prompt_ids, config: StreamingConfig) -> Callable:
    def once(n, on_decode):
        ids, stats = mtp_generate(sm.model, MTPDrafter(sm.mtp, sm.model), prompt_ids, n, config.k,
                                  config.verify_mode, config.prefill_chunk, on_decode)
        return stats["decode_tok_s"], ids
    return once


def _costed(once: Callable, store) -> Callable:
    """``once(n, on_decode)`` (decodes ``n`` tokens, calls ``on_decode()`` once the prompt is prefilled, returns
    (tok/s, ids)) as an ``_interleaved`` arm whose extra is (CPU ms per decoded token, the store's counters of
    the decode; {} without a store). CPU time and counters start at ``on_decode``."""
    def arm(n):
        started = []

        def on_decode():
            if store is not None:
                store.reset_stats()
            started.append(time.process_time())

        rate, ids = once(n, on_decode)
        cpu_ms = 1000 * (time.process_time() - started[-1]) / (len(ids) - 1)
        return rate, ids, (cpu_ms, store.stats() if store is not None else {})
    return arm


def _overhead_row(path: str, miss_check: Optional[str], rates, cpu_ms: float, stats: dict, tokens: int,
                  ids_match: bool, pool_slots: Optional[int]) -> dict:
    row = {"path": path, "miss_check": miss_check, "tok_s": _spread(rates), "cpu_ms_per_token": cpu_ms,
           "ids_match": ids_match}
    if not stats:  # in-memory: no store
        return row
    ms = 1000 / statistics.median(rates)
    parts = {part: 1000 * stats[f"{part}_s"] / tokens for part in OVERHEAD_PARTS}
    return {**row, "pool_slots": pool_slots, "host_syncs_per_token": stats["host_syncs"] / tokens, "ms_per_token": ms,
            **{f"{part}_ms_per_token": value for part, value in parts.items()},
            "other_ms_per_token": ms - sum(parts.values()),
            "deferred_forwards": stats["deferred_forwards"], "deferred_retries": stats["deferred_retries"],
            "hit_rate": stats["hits"] / max(1, stats["hits"] + stats["misses"])}


#: The store's timed parts of a step, reported per token by ``bench --overhead`` (``residency.stats.FIELDS``).
OVERHEAD_PARTS = ("sync", "route", "read", "place")


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
                                    "CPU ms over in-memory", "host syncs/token", "wait ms", "route ms", "read ms",
                                    "place ms", "other ms", "retried/deferred", "ids = in-memory"],
                     floatfmt=".2f", missingval="-")
            + f"\n{report['device']}  io_mode={report['io_mode']}  max_tokens={report['max_tokens']} "
              f"warmup={report['warmup']} repeat={report['repeat']} (tok/s and CPU ms: medians). Per decoded token, from "
              f"the end of the prompt's prefill; the counters and parts from the last timed run: host syncs; the host's "
              f"wait for the device, route bookkeeping, demand reads and pool placement (ms); other = ms/token minus "
              f"those: building the step's graph and Python outside the store")
