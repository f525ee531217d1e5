"""``mlx-streaming bench``: streaming greedy and MTP speculation at the configured pool, beside mlx-lm's in-memory model."""

from __future__ import annotations

import json
import statistics
from pathlib import Path


from ...config import StreamingConfig
from ...run_settings import RunSettings
from ...decode.greedy import greedy_generate
from ...mtp.drafter import MTPDrafter
from ...mtp.profile import union_profile
from ...mtp.speculative import mtp_generate
from ...mtp.triage import first_divergence
from ..reference import InMemoryPlan
from ..report import diagnostics_report
from .common import _f, _inmemory, _memory_mark, _peak_growth, _say, _spread, _streaming_weights, _timed_runs, timed_greedy


def run(model_dir: Path, config: StreamingConfig, settings: RunSettings, compare_inmemory: bool = False) -> dict:
    """One benchmark of ``config`` on ``model_dir``: the result dict the CLI prints and perf tests store."""
    from ...model import build_streaming_model
    from ..memory import memory_snapshot

    if compare_inmemory:
        inmemory_plan = InMemoryPlan(model_dir)
        if not inmemory_plan.fits:
            _say(f"no in-memory comparison: {inmemory_plan.why_not}")
            compare_inmemory = False
    mark = _memory_mark()
    _say(f"building the streaming model from {model_dir}")
    with build_streaming_model(model_dir, config.replace(mtp=True)) as sm:
        prompt_ids = sm.tokenizer.encode(settings.prompt)
        K, mode, chunk, n = settings.k, settings.commit_mode, config.prefill_chunk, settings.max_tokens
        weights = _streaming_weights(sm)

        def greedy_once():
            return timed_greedy(sm.model, prompt_ids, n, chunk)

        def spec_once():
            ids, stats = mtp_generate(sm.model, MTPDrafter(sm.mtp, sm.model), prompt_ids, n, K, mode, chunk)
            return stats["decode_tok_s"], ids, stats

        if settings.warmup_tokens:
            _say(f"warming up both paths ({settings.warmup_tokens} tokens)")
            timed_greedy(sm.model, prompt_ids, settings.warmup_tokens, chunk)
            mtp_generate(sm.model, MTPDrafter(sm.mtp, sm.model), prompt_ids, settings.warmup_tokens, K, mode, chunk)
        greedy_rates, (greedy_ids,), greedy_counters = _timed_runs("greedy", greedy_once, sm.store, settings.repeat)
        sm.store.route_log = []
        spec_rates, (spec_ids, spec_stats), spec_counters = _timed_runs("speculative", spec_once, sm.store, settings.repeat)
        k_hist = spec_stats["k_hist"]
        unions = union_profile(sm.store.route_log, max(set(k_hist), key=k_hist.count) if k_hist else K)
        sm.store.route_log = None

        divergence = first_divergence(spec_ids, greedy_ids, _margins(sm.model, prompt_ids, n, chunk)) if spec_ids != greedy_ids else None
        result = {
            "model": str(model_dir), "K": K, "max_tokens": n, "warmup": settings.warmup_tokens, "repeat": settings.repeat,
            "prompt": settings.prompt, "prefill_chunk": chunk, "io_mode": config.io_mode,
            "pool_slots": sm.store.capacity, "num_experts": sm.store.index.num_experts,
            "pinned_experts": sum(len(sm.store.pool.book.pinned(layer)) for layer in sm.store.index.layers),
            "exact_match": spec_ids == greedy_ids,
            "n_mismatch": sum(a != b for a, b in zip(spec_ids, greedy_ids)),
            "first_divergence": None if divergence is None else {**divergence.__dict__, "near_tie": divergence.near_tie},
            "greedy_tok_s": _spread(greedy_rates), "spec_tok_s": _spread(spec_rates),
            "speedup": statistics.median(spec_rates) / statistics.median(greedy_rates),
            **{k: spec_stats[k] for k in ("avg_accept_len", "tokens_per_step", "steps", "commit_mode", "direct_commits",
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
        result["inmemory"] = _inmemory(model_dir, config, settings, prompt_ids)
        result["streaming_over_inmemory"] = result["greedy_tok_s"]["median"] / result["inmemory"]["tok_s"]["median"]
        inmemory_ids = result["inmemory"].pop("ids")
        result["inmemory_ids_match"] = inmemory_ids == greedy_ids
        result["spec_inmemory_ids_match"] = inmemory_ids == spec_ids
    if settings.dump_ids:
        Path(settings.dump_ids).write_text(json.dumps({"greedy": greedy_ids, "speculative": spec_ids}))
    return result


def _margins(model, prompt_ids, n, chunk) -> list:
    margins = []
    greedy_generate(model, prompt_ids, n, chunk, margins=margins)
    return margins


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
             (f"streaming MTP K={result['K']} ({result['commit_mode']})", "spec_tok_s", "spec_io",
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
