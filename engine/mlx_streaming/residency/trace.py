"""Routing traces: which experts each MoE layer call routed to, recorded once, replayed at every pool size.

A trace is the store's route log of one run (``store.route_log``): per MoE layer call, in call order, its layer,
its tokens and its distinct experts; prompt and decode (and the MTP head's layer where the head ran). The ids a
greedy run produces do not depend on the pool, so neither does its trace. ``replay`` runs a trace through the
engine's own residency code, ``expert_groups`` and ``SlotBook.admit`` / ``place``, the way ``ExpertStore.acquire``
does: per call, per group, the experts resident are hits (and touched), the rest are placed, protected by the
group. So its hits and misses equal a live run's at the same pool size and eviction rule (without prefetch, which
changes only where a miss's bytes come from, not what is resident). ``curve`` replays every pool size from
``top_k`` to every expert.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path
from typing import Dict, List, Optional

from .policy import SlotBook, expert_groups

TRACE_FORMAT = "mlx-streaming routing trace 1"


def write_trace(path, store, prompt_tokens: int, generated_tokens: int, decode_from: int) -> None:
    """Write ``store.route_log`` (``decode_from``: the index of the first decode call) with what replay needs.
    Only a new file or an earlier trace is replaced; the file appears whole or not at all."""
    from ..errors import OutputError

    path = Path(path).absolute()
    if path.is_dir() or (path.exists() and not _is_trace(path)):
        raise OutputError(f"--record-trace {path}: exists and is not a routing trace; give a new file name "
                          f"(nothing was changed)")
    if not path.parent.is_dir():
        raise OutputError(f"--record-trace {path}: folder {path.parent} does not exist")
    index = store.index
    partial = path.parent / f".{path.name}.partial-{os.getpid()}"
    partial.write_text(json.dumps({
        "format": TRACE_FORMAT, "num_experts": index.num_experts, "top_k": store.top_k,
        "expert_bytes": index.expert_bytes, "layers": list(index.layers), "prompt_tokens": prompt_tokens,
        "generated_tokens": generated_tokens, "decode_from": decode_from,
        "calls": [[layer, tokens, list(experts)] for layer, tokens, experts in store.route_log],
    }))
    os.replace(partial, path)


def _is_trace(path: Path) -> bool:
    try:
        return json.loads(path.read_text()).get("format") == TRACE_FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def read_trace(path) -> dict:
    from ..errors import ConfigError

    try:
        trace = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: not a readable routing trace ({exc})") from None
    if not isinstance(trace, dict) or trace.get("format") != TRACE_FORMAT:
        raise ConfigError(f"{path}: not a routing trace written by --record-trace")
    return trace


def hottest(trace: dict, n: int) -> Dict[int, List[int]]:
    """Per layer, the ``n`` experts the trace routed to most often (what a pin-hot calibration would pin)."""
    counts: Dict[int, Counter] = {layer: Counter() for layer in trace["layers"]}
    for layer, _, experts in trace["calls"]:
        counts[layer].update(experts)
    return {layer: [e for e, _ in c.most_common(n)] for layer, c in counts.items()}


def replay(trace: dict, slots: int, pinned: Optional[Dict[int, List[int]]] = None, eviction: str = "lfu") -> dict:
    """Hits and misses of the whole trace at ``slots`` per layer under ``eviction`` (``pinned`` experts resident
    from the start, as after a pin-hot calibration), and the misses of its decode calls."""
    book = SlotBook(trace["layers"], trace["num_experts"], slots, eviction)
    for layer, experts in (pinned or {}).items():
        book.place(layer, experts)
        for e in experts:
            book.pin(layer, e)
    hits = misses = decode_misses = 0
    for i, (layer, _, experts) in enumerate(trace["calls"]):
        for group in expert_groups(experts, book.pinned(layer), slots):
            missing = book.admit(layer, group)
            hits += len(group) - len(missing)
            misses += len(missing)
            decode_misses += len(missing) if i >= trace["decode_from"] else 0
            if missing:
                book.place(layer, missing, group)
    return {"slots": slots, "hits": hits, "misses": misses, "hit_rate": hits / max(1, hits + misses),
            "decode_misses": decode_misses}


def curve(trace: dict, disk_bytes_per_s: float, pin_hot: int = 0, eviction: str = "lfu") -> List[dict]:
    """Every pool size from ``top_k`` (plus ``pin_hot``) to every expert under ``eviction``: hit rate, pool bytes,
    disk bytes per decoded token and the decode rate the disk alone allows at ``disk_bytes_per_s``."""
    pinned = hottest(trace, pin_hot) if pin_hot else None
    layers, expert_bytes = len(trace["layers"]), trace["expert_bytes"]
    rows = []
    for slots in range(trace["top_k"] + pin_hot, trace["num_experts"] + 1):
        r = replay(trace, slots, pinned, eviction)
        per_token = r["decode_misses"] * expert_bytes / max(1, trace["generated_tokens"] - 1)
        rows.append({**r, "pool_bytes": slots * layers * expert_bytes, "disk_bytes_per_token": per_token,
                     "io_bound_tok_s": disk_bytes_per_s / per_token if per_token else float("inf")})
    return rows
