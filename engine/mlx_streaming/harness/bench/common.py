"""What every bench mode shares: timed greedy runs, spreads, memory marks, the in-memory reference."""

from __future__ import annotations

import gc
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, List, Optional

import mlx.core as mx

from ...config import StreamingConfig
from ...run_settings import RunSettings
from ...errors import ConfigError
from ...decode.greedy import greedy_steps
from ..reference import InMemoryPlan


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


def greedy_path(model, prompt_ids, config: StreamingConfig) -> Callable:
    """``once(n, on_decode)``: ``timed_greedy`` of ``model`` (an ``_costed`` arm's decode)."""
    return lambda n, on_decode: timed_greedy(model, prompt_ids, n, config.prefill_chunk, on_decode)


def _costed(once: Callable, store) -> Callable:
    """``once(n, on_decode)`` (decodes ``n`` tokens, calls ``on_decode()`` once the prompt is prefilled, returns
    (tok/s, ids, *more)) as an ``_interleaved`` arm whose extra is (CPU ms per decoded token, the store's counters
    of the decode ({} without a store), *more). CPU time and counters start at ``on_decode``: the process's CPU
    time, which a neighbour on a shared host moves far less than wall time."""
    def arm(n):
        started = []

        def on_decode():
            if store is not None:
                store.reset_stats()
            started.append(time.process_time())

        rate, ids, *more = once(n, on_decode)
        cpu_ms = 1000 * (time.process_time() - started[-1]) / (len(ids) - 1)
        return rate, ids, (cpu_ms, store.stats() if store is not None else {}, *more)
    return arm


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
    from ..memory import resident_dense_bytes

    head = resident_dense_bytes(sm.mtp, sm.store) if sm.mtp is not None else 0
    return resident_dense_bytes(sm.model, sm.store) + sm.store.pool.nbytes + head


def _refuse_unless_inmemory_fits(model_dir: Path, mode: str) -> None:
    """One line instead of the kernel's kill, for a mode that measures against mlx-lm's in-memory model."""
    plan = InMemoryPlan(model_dir)
    if not plan.fits:
        raise ConfigError(f"bench {mode} measures against mlx-lm's in-memory model, and {plan.why_not}")


def _inmemory(model_dir: Path, config: StreamingConfig, run: RunSettings, prompt_ids) -> dict:
    """mlx-lm's in-memory greedy decode tok/s and ids, with the bytes of its weights (every one read at load)
    and MLX's peak above what was active before it loaded."""
    import mlx_lm
    from mlx.utils import tree_flatten

    mark = _memory_mark()
    _say("loading mlx-lm's in-memory model")
    model, _ = mlx_lm.load(str(model_dir))
    weights = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    if run.warmup_tokens:
        timed_greedy(model, prompt_ids, run.warmup_tokens, config.prefill_chunk)
    rates, (ids,), _ = _timed_runs("in-memory greedy", lambda: timed_greedy(model, prompt_ids, run.max_tokens, config.prefill_chunk), None, run.repeat)
    peak = _peak_growth(mark)
    del model
    mx.clear_cache()
    return {"tok_s": _spread(rates), "ids": ids, "weights_bytes": weights, "mlx_peak_growth_bytes": peak}


def _f(value: float, digits: int) -> str:
    return f"{value:.{digits}f}"


def _greedy_runs(sm, config: StreamingConfig, run: RunSettings, label: str) -> tuple:
    """Warm up, then ``run.repeat`` timed greedy decodes of the run's prompt on the built model ``sm``:
    (rates, the last run's ids, the bench counters, the store's raw stats)."""
    prompt_ids = sm.tokenizer.encode(run.prompt)
    if run.warmup_tokens:
        timed_greedy(sm.model, prompt_ids, run.warmup_tokens, config.prefill_chunk)
    rates, (ids,), counters = _timed_runs(
        label, lambda: timed_greedy(sm.model, prompt_ids, run.max_tokens, config.prefill_chunk), sm.store, run.repeat)
    return rates, ids, counters, sm.store.stats()


def _interleaved(label: str, arms: dict, run: RunSettings) -> tuple:
    """Warm every arm up (``arms``: name -> ``once(n)``, which decodes ``n`` tokens and returns (tok/s, ids,
    extra)), then ``run.repeat`` rounds running each arm once, interleaved, so a drifting machine moves them
    alike: (tok/s per arm per round, each arm's (ids, extra) per round). Each round starts one arm later than
    the round before, so no arm always runs after the same one (arms that share a pool inherit its state)."""
    for once in arms.values():
        once(max(2, run.warmup_tokens))
    rates, runs = {name: [] for name in arms}, {name: [] for name in arms}
    names = list(arms)
    for i in range(run.repeat):
        _say(f"{label}: round {i + 1}/{run.repeat}")
        for name in names[i % len(names):] + names[:i % len(names)]:
            rate, ids, extra = arms[name](run.max_tokens)
            rates[name].append(rate)
            runs[name].append((ids, extra))
    return rates, runs


def _versus_best(rates: dict, autos: tuple) -> dict:
    """Medians per arm, the best arm that is not one of ``autos``, and each of those over it."""
    medians = {name: statistics.median(v) for name, v in rates.items()}
    best = max((name for name in rates if name not in autos), key=medians.get)
    return {"tok_s": {str(name): _spread(v) for name, v in rates.items()}, "best_fixed": best,
            "over_best": {name: medians[name] / medians[best] for name in autos}}
