"""Memory snapshot of a streaming run: MLX active / peak, process RSS, and where the bytes are."""

from __future__ import annotations

import mlx.core as mx
import psutil
from mlx.utils import tree_flatten

GB = 1e9


def resident_dense_bytes(module, store) -> int:
    """Bytes of ``module``'s parameters that are not pool arrays."""
    pool = {id(a) for p in store.pool.arrays.values() for a in p.values()}
    return sum(v.nbytes for _, v in tree_flatten(module.parameters()) if id(v) not in pool)


def memory_snapshot(sm) -> dict:
    """GB figures. The breakdown: dense weights of the main model, the expert pool, the MTP head's dense
    weights, the rest of MLX's active memory (KV caches, activations and temporaries), and the reader's
    prefetcher's peak host staging (outside MLX)."""
    active = mx.get_active_memory()
    parts = {
        "dense_weights": resident_dense_bytes(sm.model, sm.store),
        "expert_pool": sm.store.pool.nbytes,
        "mtp_head": resident_dense_bytes(sm.mtp, sm.store) if sm.mtp else 0,
    }
    parts["activations_and_temporaries"] = max(0, active - sum(parts.values()))
    parts["prefetch_staging_peak"] = sm.store.counters.prefetch_staging_peak
    return {
        "mlx_active_gb": active / GB,
        "mlx_peak_gb": mx.get_peak_memory() / GB,
        "rss_gb": psutil.Process().memory_info().rss / GB,
        "breakdown_gb": {k: v / GB for k, v in parts.items()},
    }
