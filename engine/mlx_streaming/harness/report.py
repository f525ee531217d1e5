"""Counters and diagnostics for people: what each number counts, and over which tokens."""

from __future__ import annotations

from ..config import format_size


def counters_line(stats: dict, covers: str) -> str:
    """One line of the store's counters, saying what they cover (e.g. "the prompt's prefill and 12 generated
    tokens"); the pool starts empty at build, so the first tokens of a run always load."""
    looked_up = stats["hits"] + stats["misses"]
    line = (f"counters over {covers}: {looked_up} experts routed, {stats['hits']} resident "
            f"({stats['hits'] / looked_up if looked_up else 0:.1%}), {stats['demand_loads']} demand loads")
    if "prefetch_staging_bytes" in stats:  # a prefetcher is running
        line += f", {stats['prefetch_loads']} prefetch reads ({stats['prefetched']} of them used)"
    line += f"; {format_size(stats['bytes_read'])} read from disk"
    if "verify_from_manifest" in stats:  # byte-truth verification is on
        line += f"; verify: {stats['verify_calls']} checks, {stats['verify_bad']} bad"
    return line


def diagnostics_report(store) -> str:
    """Main-thread read and place time, and with prefetch on the predictor's recall and miss attribution."""
    s = store.stats()
    lines = [f"diagnostics: demand reads {s['read_s'] * 1000:.1f} ms for {format_size(s['demand_bytes'])} "
             f"({s['read_wait_s'] * 1000:.1f} ms of it waited for), placing experts into the pool "
             f"{s['place_s'] * 1000:.1f} ms"]
    if store.predictor is None or store.predictor.diagnostics is None:
        lines.append("diagnostics: no predictor (prefetch is off): nothing to attribute")
        return "\n".join(lines)
    d = store.predictor.diagnostics.stats()
    for scope in ("all", "decode"):
        c = d[scope]
        lines.append(
            f"diagnostics ({'every forward' if scope == 'all' else 'decode steps'}): recall {c['recall']:.3f} "
            f"({c['predicted_and_routed']} of {c['routed']} routed were predicted); not resident at acquire: "
            f"A not finished {c['a_not_finished']}, A evicted {c['a_evicted']}, B not predicted {c['b_not_predicted']}; "
            f"mean submit-to-acquire {c['avg_window_ms']:.1f} ms")
    lines.append(f"diagnostics: main thread predict {d['predict_s'] * 1000:.1f} ms, submit {d['submit_s'] * 1000:.1f} ms")
    return "\n".join(lines)


def policy_table(rows: list) -> str:
    """``residency.policy_study.compare`` as a table: each policy's decode hit rate at each pool share, and how far
    it stays below the offline optimum (Belady) of its pool shape."""
    from tabulate import tabulate

    shares = sorted({r["share"] for r in rows})
    rate = {(r["policy"], r["share"]): r["decode_hit_rate"] for r in rows}
    slots = {r["share"]: r["slots"] for r in rows}
    policies = list(dict.fromkeys(r["policy"] for r in rows))

    def cell(policy, share):
        bound = rate[(f"Belady, {policy.split(', ')[1]}", share)]
        gap = "" if policy.startswith("Belady") else f" ({(rate[(policy, share)] - bound) * 100:+.1f})"
        return f"{rate[(policy, share)]:.3f}{gap}"

    body = [[policy] + [cell(policy, share) for share in shares] for policy in policies]
    headers = ["policy, pools"] + [f"{share:.0%} ({slots[share]}/layer)" for share in shares]
    return (tabulate(body, headers=headers)
            + "\ndecode hit rate at equal bytes (per layer: one pool per MoE layer; shared: one pool of all layers' "
              "slots); in brackets, points from Belady's offline optimum of the same pool shape")


def trace_table(rows: list, disk_gbps: float, pin_hot: int, eviction: str) -> str:
    """``residency.trace.curve`` as a table: pool size against hit rate, disk traffic and the I/O-bound decode rate."""
    from tabulate import tabulate

    body = [[r["slots"], r["pool_bytes"] / 1e6, r["hit_rate"], r["disk_bytes_per_token"] / 1e6, r["io_bound_tok_s"]]
            for r in rows]
    return (tabulate(body, headers=["slots/layer", "pool MB", "hit rate", "disk MB/token", "I/O-bound tok/s"],
                     floatfmt=(".0f", ".2f", ".3f", ".3f", ".1f"))
            + f"\nreplayed through the engine's {eviction.upper()} eviction; disk MB and tok/s per decoded token at {disk_gbps:g} GB/s"
            + (f"; {pin_hot} most routed experts per layer pinned" if pin_hot else ""))
