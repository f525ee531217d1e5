"""``bench --k-report``, ``--prefetch-auto-report`` and ``--prefetch-report``: the automatic choices against the fixed ones."""

from __future__ import annotations

import statistics
from pathlib import Path


from ...config import StreamingConfig
from ...run_settings import RunSettings
from ...decode.greedy import greedy_generate
from ...mtp.autok import KChooser
from ...mtp.drafter import MTPDrafter
from ...mtp.speculative import mtp_generate
from .common import _costed, _greedy_runs, _interleaved, _say, _spread, _versus_best, timed_greedy
from .io_report import _demand_gbps, raw_read_probe


#: ``bench --k-report``: every fixed K (1: no drafts), "auto" with a new chooser per run (as ``generate`` runs)
#: and "auto kept", one chooser kept across the arm's runs, its warm-up included (as ``serve`` keeps one per model).
K_REPORT = (1, 2, 3, 4, "auto", "auto kept")
AUTO_ARMS = ("auto", "auto kept")


def _report_key(arm: str) -> str:
    """The prefix of an auto arm's entries in ``k_report``'s dict ("auto kept" -> "auto_kept")."""
    return arm.replace(" ", "_")


def k_report(model_dir: Path, config: StreamingConfig, run: RunSettings) -> dict:
    """MTP speculation at every fixed K and at "auto" (a new chooser per run, and one kept across runs),
    interleaved (``_interleaved``): median decode tok/s per K, each auto over the best fixed K, the same by the
    process's CPU ms per decoded token (on MLX's CPU backend the verdict a neighbour on a shared host cannot move;
    on a GPU the host's share only), the K each auto chose per step, and every run's ids against greedy's."""
    from ...model import build_streaming_model

    with build_streaming_model(model_dir, config.replace(mtp=True)) as sm:
        prompt_ids = sm.tokenizer.encode(run.prompt)
        greedy = greedy_generate(sm.model, prompt_ids, run.max_tokens, config.prefill_chunk)

        def arm(k):
            kept = KChooser() if k == "auto kept" else None

            def once(n, on_decode):
                ids, stats = mtp_generate(sm.model, MTPDrafter(sm.mtp, sm.model), prompt_ids, n,
                                          "auto" if kept else k, run.commit_mode, config.prefill_chunk, on_decode,
                                          chooser=kept)
                return stats["decode_tok_s"], ids, stats["k_hist"], stats["time_s"]["catch_up"]
            return _costed(once, None)

        rates, runs = _interleaved("K report", {k: arm(k) for k in K_REPORT}, run)
        cpu_ms = {str(k): statistics.median(cpu for _, (cpu, *_) in runs[k]) for k in K_REPORT}
        best_cpu = min((k for k in cpu_ms if k not in AUTO_ARMS), key=cpu_ms.get)
        versus = _versus_best(rates, AUTO_ARMS)
        report = {"model": str(model_dir), "pool_slots": sm.store.capacity, "max_tokens": run.max_tokens,
                  "repeat": run.repeat, "tok_s": versus["tok_s"], "best_fixed": versus["best_fixed"],
                  "tok_s_per_round": rates, "cpu_ms_per_token": cpu_ms, "best_fixed_by_cpu": best_cpu,
                  "ids_equal_greedy": all(ids == greedy for arm_runs in runs.values() for ids, _ in arm_runs)}
        for name in AUTO_ARMS:
            key = _report_key(name)
            steps = [{str(k): chosen.count(k) for k in sorted(set(chosen))} for _, (_, _, chosen, _) in runs[name]]
            report.update({f"{key}_over_best": versus["over_best"][name],
                           f"{key}_over_best_by_cpu": cpu_ms[best_cpu] / cpu_ms[name],
                           f"{key}_k_steps": steps[-1], f"{key}_k_steps_per_round": steps,
                           f"{key}_catch_up_ms_per_round": [1000 * s for _, (*_, s) in runs[name]]})
        return report


def prefetch_auto_report(model_dir: Path, config: StreamingConfig, run: RunSettings) -> dict:
    """Greedy decoding with prefetch off, on and auto (three models of the config's pool, run interleaved):
    median tok/s each, auto over the better of on and off, auto's decisions, and the ids of every arm."""
    from contextlib import ExitStack

    from ...model import build_streaming_model

    with ExitStack() as stack:
        models = {arm: stack.enter_context(build_streaming_model(model_dir, config.replace(prefetch=arm)))
                  for arm in (False, True, "auto")}
        prompt_ids = models[False].tokenizer.encode(run.prompt)

        def arm(sm):
            def once(n):
                return (*timed_greedy(sm.model, prompt_ids, n, config.prefill_chunk), None)
            return once

        names = {False: "off", True: "on", "auto": "auto"}
        rates, runs = _interleaved("prefetch report", {names[a]: arm(sm) for a, sm in models.items()}, run)
        switch = models["auto"].prefetch.switch
        versus = _versus_best(rates, ("auto",))
        return {"model": str(model_dir), "pool_slots": models[False].store.capacity, "io_mode": config.io_mode,
                "max_tokens": run.max_tokens, "repeat": run.repeat, "tok_s": versus["tok_s"],
                "best_fixed": versus["best_fixed"], "auto_over_best": versus["over_best"]["auto"],
                "auto_decisions": ["on" if d else "off" for d in switch.decisions],
                "auto_measured_s_per_token": {("on" if a else "off"): v for a, v in switch.measured.items()},
                "ids_identical": len({tuple(ids) for arm_runs in runs.values() for ids, _ in arm_runs}) == 1}


def auto_table(report: dict, what: str) -> str:
    """``k_report`` (``what`` "K") or ``prefetch_auto_report`` ("prefetch") as a table."""
    from tabulate import tabulate

    best = report["tok_s"][str(report["best_fixed"])]["median"]
    cpu = report.get("cpu_ms_per_token", {})
    body = [[name, v["median"], v["min"], v["max"], v["median"] / best, *([cpu[name]] if cpu else [])]
            for name, v in report["tok_s"].items()]
    if what == "K":
        detail = "; ".join(
            f"{name} / best fixed ({report['best_fixed']}): {report[key + '_over_best']:.3f}, by CPU time "
            f"({report['best_fixed_by_cpu']}) {report[key + '_over_best_by_cpu']:.3f}, steps by K in the last round "
            f"{report[key + '_k_steps']}, head catch-ups {report[key + '_catch_up_ms_per_round'][-1]:.1f} ms"
            for name, key in ((name, _report_key(name)) for name in AUTO_ARMS))
        detail += f"; every run's ids equal greedy's: {report['ids_equal_greedy']}"
    else:
        detail = (f"auto / best fixed ({report['best_fixed']}): {report['auto_over_best']:.3f}; auto's decisions: "
                  f"{report['auto_decisions']}, its last probes (s per token): {report['auto_measured_s_per_token']}; "
                  f"ids identical across arms: {report['ids_identical']}")
    headers = [what, "tok/s (median)", "min", "max", f"x best fixed {what}", *(["CPU ms/token (median)"] if cpu else [])]
    return (tabulate(body, headers=headers, floatfmt=".3f")
            + f"\npool {report['pool_slots']} slots, {report['max_tokens']} tokens x {report['repeat']} rounds, arms "
              f"interleaved. {detail}")


#: The rows of ``prefetch_report``: (label, pool at its minimum, prefetch, ahead, mult).
PREFETCH_ROWS = (("naive (pool = top_k)", True, False, 0, 1), ("pool", False, False, 0, 1),
                 ("pool + prefetch ahead 0", False, True, 0, 1), ("pool + prefetch ahead 1", False, True, 1, 1),
                 ("pool + prefetch ahead 0 mult 2", False, True, 0, 2),
                 ("pool + prefetch ahead 1 mult 2", False, True, 1, 2))


def _prefetch_row(model_dir: Path, config: StreamingConfig, run: RunSettings, label: str) -> dict:
    from ...model import build_streaming_model

    _say(f"{label}: building")
    with build_streaming_model(model_dir, config) as sm:
        rates, ids, counters, s = _greedy_runs(sm, config, run, label)
        row = {"label": label, "layout": "packed" if config.packed_dir else "scattered", "pool_slots": sm.store.capacity,
               "prefetch": config.prefetch, "ahead": config.prefetch_ahead, "mult": config.prefetch_mult,
               "tok_s": _spread(rates), "io": counters, "place_s": s["place_s"], "read_s": s["read_s"],
               "demand_read_gbps": _demand_gbps(s), "hidden_read_share": s["hidden_read_share"], "ids": ids}
        if sm.store.predictor is not None:
            row["diagnostics"] = sm.store.predictor.diagnostics.stats()
    recall = row["diagnostics"]["decode"]["recall"] if "diagnostics" in row else None
    _say(f"{label} ({row['layout']}): {row['tok_s']['median']:.3f} tok/s, demand loads {counters['demand_loads']}, "
         f"prefetch hits {counters.get('prefetch_hits', 0)}, decode recall {recall}")
    return row


def prefetch_report(model_dir: Path, config: StreamingConfig, run: RunSettings) -> dict:
    """Greedy decoding side by side: the pool at its minimum, the configured pool, and that pool with prefetch
    (ahead 0 and 1, mult 1 and 2, with diagnostics), plus the raw disk rate at the expert read size. With
    ``packed_dir`` the pool and prefetch rows run again on the packed layout."""
    from ...model import build_streaming_model

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
            rows.append(_prefetch_row(model_dir, row_config, run, label))
    reference = rows[1]["tok_s"]["median"]
    ids = [row.pop("ids") for row in rows]
    for row in rows:
        row["over_pool"] = row["tok_s"]["median"] / reference
    return {"model": str(model_dir), "io_mode": config.io_mode, "max_tokens": run.max_tokens,
            "repeat": run.repeat, "raw_read": raw, "ids_identical": all(i == ids[0] for i in ids), "rows": rows}


def prefetch_table(report: dict) -> str:
    from tabulate import tabulate

    headers = ["path", "layout", "pool", "tok/s", "x pool", "demand loads", "prefetch hits", "demand GB/s",
               "read time hidden", "recall (decode)", "A: not finished", "A: evicted", "B: not predicted"]
    body = []
    for r in report["rows"]:
        d = (r.get("diagnostics") or {}).get("decode")
        body.append([r["label"], r["layout"], r["pool_slots"], r["tok_s"]["median"], r["over_pool"],
                     r["io"]["demand_loads"], r["io"].get("prefetch_hits", 0), r["demand_read_gbps"],
                     r["hidden_read_share"], d["recall"] if d else "", d["a_not_finished"] if d else "", d["a_evicted"] if d else "",
                     d["b_not_predicted"] if d else ""])
    raw = report["raw_read"]
    return (tabulate(body, headers=headers, floatfmt=".3f") +
            f"\nio_mode={report['io_mode']}  raw read {raw['gbps']:.3f} GB/s at {raw['bytes'] // raw['experts']} B "
            f"per expert ({raw['experts']} experts)  max_tokens={report['max_tokens']} repeat={report['repeat']}  "
            f"ids identical across rows: {report['ids_identical']}")
