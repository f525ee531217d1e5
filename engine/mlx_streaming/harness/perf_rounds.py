"""How a perf round is measured: the perf suite's scenarios, the yardstick, token costs and work counters.

One owner for what the perf suite (``perf/test_perf.py``), the power study and the side-by-side base worker
measure, so that the two revisions of a side-by-side gate run the same scenarios the same way. A round is one
greedy or speculative decode of ``tokens`` tokens from a fresh cache (the pool stays warm), after a yardstick
round: the same greedy decode on mlx-lm's own in-memory model.

Run as a script (``python perf_rounds.py --worker``) this file is the side-by-side gate's base worker: it reads
requests from stdin and answers on stdout, one JSON object per line, measuring whichever ``mlx_streaming`` is on
its path (the base revision's). So it imports nothing of this package's harness, only the engine's public API:
``build_streaming_model``, ``StreamingConfig``, ``greedy_steps``, ``MTPDrafter``, ``mtp_generate``.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, Mapping, Optional

#: Work counters, each per generated token of a scenario's first timed round, each with one meaning.
WORK_COUNTERS = {
    "routed": "experts looked up at acquire (hits + misses), every MoE layer call of every forward",
    "experts_placed": "experts written into the pool (misses), from a demand read or from prefetch staging",
    "demand_loads": "experts read on the main thread at acquire",
    "prefetch_loads": "expert reads the prefetcher's threads completed",
    "bytes_read": "bytes read from disk, demand and prefetch",
    "read_calls": "system reads issued by the reader (after merging adjacent ranges)",
    "host_syncs": "the engine's waits for the device on the forward path (routes or predictions brought to "
                  "the host, a grouped call's partial output, the deferred check)",
    "rerun_layer_calls": "MoE layer calls computed by a deferred forward whose check found a miss, discarded and run "
                         "again",
    "pool_writes": "writes placing experts into the pool's arrays (per expert tensor: one per placed expert, or one "
                   "per load where a load's experts are written by one scatter)",
    "verify_calls": "experts checked by byte-truth verification",
    "spec_steps": "speculative verify steps",
    "accepted_drafts": "drafts accepted by speculative verification",
}
#: Counters exact for every scenario, and those exact only without prefetch (with prefetch, which reads finish
#: before their acquire, and so what is read on demand, depends on timing).
EXACT = ("routed", "experts_placed", "host_syncs", "rerun_layer_calls", "pool_writes")
EXACT_WITHOUT_PREFETCH = EXACT + ("demand_loads", "bytes_read", "read_calls", "verify_calls")


@dataclass(frozen=True)
class Scenario:
    """``pool``: ``"full"`` (every expert read in at build: compute alone) or ``"quarter"`` (a 25% pool read
    with O_DIRECT); ``changes``: more engine settings; ``k``: tokens per speculative verify (1: greedy);
    ``exact``: the counters judged exactly; ``reads``: whether it reads experts from disk while decoding."""
    pool: str
    exact: tuple
    reads: bool
    changes: dict = field(default_factory=dict)
    k: int = 1


#: The perf suite's scenarios, by the name of their test without ``test_``.
SCENARIOS = {
    "greedy_full_pool": Scenario("full", EXACT_WITHOUT_PREFETCH, reads=False),
    "greedy_quarter_pool_direct": Scenario("quarter", EXACT_WITHOUT_PREFETCH, reads=True),
    "greedy_quarter_pool_prefetch": Scenario("quarter", EXACT, reads=True,
                                             changes={"prefetch": True, "prefetch_ahead": 1}),
    "speculative_k3": Scenario("quarter", EXACT_WITHOUT_PREFETCH + ("spec_steps", "accepted_drafts"), reads=True,
                               k=3),
}


def cost_unit() -> str:
    """``cpu_s_per_token`` on MLX's CPU backend, ``wall_s_per_token`` on a GPU backend."""
    import mlx.core as mx

    return "cpu_s_per_token" if mx.default_device().type == mx.DeviceType.cpu else "wall_s_per_token"


def clock(unit: str) -> Callable[[], float]:
    return time.process_time if unit.startswith("cpu") else time.perf_counter


def measured(run: Callable[[], object], tokens: int, unit: str) -> tuple:
    """``run()``'s cost per token in ``unit``, its wall seconds per token, and what it returned."""
    now = clock(unit)
    c0, w0 = now(), time.perf_counter()
    out = run()
    return (now() - c0) / tokens, (time.perf_counter() - w0) / tokens, out


def token_costs(steps: Iterable, unit: str) -> tuple:
    """The cost in ``unit`` of each step of ``steps`` (an iterator that yields once per generated token) but the
    first, which carries the prompt's prefill, and the last, which queues no next step (a decode loop one step
    ahead computed it during the step before); and the wall seconds per token of them all."""
    now = clock(unit)
    marks, w0 = [now()], time.perf_counter()
    for _ in steps:
        marks.append(now())
    return [b - a for a, b in zip(marks, marks[1:])][1:-1], (time.perf_counter() - w0) / (len(marks) - 1)


def work_counters(stats: Mapping, reader_reads: int, tokens: int, spec: Optional[Mapping] = None) -> Dict[str, float]:
    """``WORK_COUNTERS`` per generated token from the store's ``stats()``, the reader's read count and, for a
    speculative run, its statistics."""
    counts = {
        "routed": stats["hits"] + stats["misses"], "experts_placed": stats["misses"],
        "demand_loads": stats["demand_loads"], "prefetch_loads": stats.get("prefetch_loads", 0),
        "bytes_read": stats["bytes_read"], "read_calls": reader_reads, "host_syncs": stats["host_syncs"],
        "rerun_layer_calls": stats["rerun_layer_calls"], "pool_writes": stats["pool_writes"],
        "verify_calls": stats.get("verify_calls", 0),
        "spec_steps": spec["steps"] if spec else 0, "accepted_drafts": spec["accepted_drafts"] if spec else 0,
    }
    return {name: value / tokens for name, value in counts.items()}


def build(model_dir, mtp_path, config, scenario: Scenario, plant_s: float = 0.0):
    """A newly built streaming model for ``scenario`` over ``config`` (the suite's engine settings), so each
    scenario's counters start from the same pool whatever ran before it. ``plant_s``: a planted slowdown (CPU
    seconds per forward), for the gate's tests and power study; given to the engine only when set."""
    from mlx_streaming.model import build_streaming_model

    config = config.replace(mtp=mtp_path.exists(), mtp_path=str(mtp_path), **scenario.changes)
    if scenario.pool == "quarter":
        config = quarter_pool(model_dir, config).replace(io_mode="direct")
    else:
        config = config.with_pool().replace(preload=True)
    sm = build_streaming_model(model_dir, config)
    if plant_s:
        PlantedSlowdown(sm, plant_s)
    return sm


class PlantedSlowdown:
    """A planted slowdown, for the perf gate's tests and power study: ``seconds`` of the decoding thread's CPU
    time burnt at the start of every forward of ``sm``'s model, injected from outside through its miss guard's
    forward hooks. The thread's own clock, not the process's: while MLX's compute thread runs beside it (a
    decode loop one step ahead), the process's clock would count that work too and end the burn early."""

    def __init__(self, sm, seconds: float = 0.0):
        self.seconds = seconds
        self._hooks = sm.store.guard.forward_hooks
        self._hooks.append(self)

    def remove(self) -> None:
        """Take this slowdown out of the model's forward hooks."""
        self._hooks.remove(self)

    def __call__(self, tokens: int) -> None:
        if self.seconds:
            end = time.thread_time() + self.seconds
            while time.thread_time() < end:
                pass


def quarter_pool(model_dir, config):
    """``config`` with a quarter of each MoE layer's experts resident, or, where ``config`` sets a memory budget
    (the suite's, for a model that does not fit) or a pool (``--streaming-pool-slots``), that pool where it is
    less."""
    quarter = config.with_pool(pool_fraction=0.25)
    if config.memory_budget is None and config.pool_slots is None:
        return quarter
    from mlx_streaming.model import plan_memory, within_budget

    slots = plan_memory(model_dir, quarter).slots
    if config.pool_slots is not None:
        return config.with_pool(pool_slots=min(slots, config.pool_slots))
    return within_budget(model_dir, config, slots)


def greedy_round(model, prompt, tokens: int) -> Callable[[str], tuple]:
    """A greedy round on ``model``: ``decode(unit)`` -> (token costs, wall seconds per token, None)."""
    from mlx_streaming.decode.greedy import greedy_steps

    def decode(unit):
        return (*token_costs(greedy_steps(model, prompt, tokens), unit), None)

    return decode


def scenario_round(sm, scenario: Scenario, prompt, tokens: int) -> Callable[[str], tuple]:
    """A round of ``scenario`` on the streaming model ``sm``: ``decode(unit)`` -> (token costs, wall seconds per
    token, speculative stats or None). A speculative round gives one cost per token for the whole round."""
    if scenario.k == 1:
        return greedy_round(sm.model, prompt, tokens)
    from mlx_streaming.mtp.drafter import MTPDrafter
    from mlx_streaming.mtp.speculative import mtp_generate

    def decode(unit):
        cost, wall, stats = measured(
            lambda: mtp_generate(sm.model, MTPDrafter(sm.mtp, sm.model), prompt, tokens, scenario.k, "direct")[1],
            tokens, unit)
        return [cost], wall, stats

    return decode


#: The yardsticks' labels: the model's own in-memory decode, and the embedded default model's.
OWN_YARDSTICK = "mlx-lm in memory, this model"
EMBEDDED_YARDSTICK = "mlx-lm in memory, the embedded default model"


@dataclass(frozen=True)
class Yardstick:
    """Whose in-memory greedy decode the yardstick rounds run: the model's own where mlx-lm's in-memory model
    fits, else the embedded default model's (a model of the same kind that fits anywhere), with its prompt.
    ``label`` starts with ``OWN_YARDSTICK`` or ``EMBEDDED_YARDSTICK``, maybe followed by why, in brackets."""
    model: str
    prompt: list
    label: str

    @classmethod
    def choose(cls, model_dir, prompt, fits: bool) -> "Yardstick":
        if fits:
            return cls(str(model_dir), list(prompt), OWN_YARDSTICK)
        return cls.embedded(f"{EMBEDDED_YARDSTICK} (this model does not fit in memory)")

    @classmethod
    def embedded(cls, label: str = EMBEDDED_YARDSTICK) -> "Yardstick":
        from mlx_lm.utils import load_tokenizer
        from mlx_streaming.defaults import default_model

        default = default_model()
        return cls(str(default), load_tokenizer(default).encode(YARDSTICK_PROMPT), label)

    @staticmethod
    def kind(label: str) -> str:
        """``OWN_YARDSTICK`` or ``EMBEDDED_YARDSTICK``: ``label`` without its reason."""
        return label.split(" (")[0]

    def as_dict(self) -> dict:
        return {"model": self.model, "prompt": self.prompt}


#: The prompt of a yardstick on the embedded default model.
YARDSTICK_PROMPT = "def fibonacci(n):"


class Rounds:
    """One scenario's rounds on one engine, each after its yardstick round: the same protocol in the perf suite
    (in process) and in the base worker (``--worker``)."""

    def __init__(self, sm, decode: Callable[[str], tuple], yardstick: Callable[[str], tuple], tokens: int):
        self.sm, self.decode, self.yardstick, self.tokens = sm, decode, yardstick, tokens
        self.unit = cost_unit()

    def warm_up(self) -> None:
        """The yardstick once, the scenario twice: the first fills the pool; the second starts, like every timed
        round, from a pool this decode has already been through."""
        self.yardstick(self.unit), self.decode(self.unit), self.decode(self.unit)

    def yard(self) -> list:
        """A yardstick round's token costs; the store's counters start anew after it."""
        costs = self.yardstick(self.unit)[0]
        self.sm.store.reset_stats()
        return costs

    def timed(self, counted: bool) -> dict:
        """A timed round: its token costs, wall seconds per token and, if ``counted``, its work counters (read
        from the store's ``stats()`` after the round; the suite reads them after the first timed round only,
        since reading them settles the store's bulk counts)."""
        costs, wall, spec = self.decode(self.unit)
        if not counted:
            return {"costs": costs, "wall": wall}
        counters = work_counters(self.sm.store.stats(), self.sm.store.reader.reads, self.tokens, spec)
        return {"costs": costs, "wall": wall, "counters": counters}


def _worker() -> None:
    """The base worker: requests on stdin, one JSON answer per line on the stdout it was given (the engine's
    own prints go to stderr). Requests: ``{"model", "mtp", "prompt", "tokens", "config", "yardstick": {"model",
    "prompt"}}`` first, then
    ``{"scenario": name}`` (builds and warms up), ``{"round": true}`` (a yardstick round, then a timed round)."""
    from pathlib import Path

    answer, sys.stdout = sys.stdout, sys.stderr

    def say(obj) -> None:
        answer.write(json.dumps(obj) + "\n")
        answer.flush()

    try:
        import mlx_lm
        import mlx_streaming
        from mlx_streaming.config import StreamingConfig

        setup = json.loads(sys.stdin.readline())
        model_dir, mtp_path = Path(setup["model"]), Path(setup["mtp"])
        prompt, tokens = setup["prompt"], setup["tokens"]
        reference = mlx_lm.load(setup["yardstick"]["model"])[0]
        yardstick = greedy_round(reference, setup["yardstick"]["prompt"], tokens)
        config = StreamingConfig(**setup["config"])
        say({"engine": str(Path(mlx_streaming.__file__).parent)})
        rounds, counted = None, False
        for line in sys.stdin:
            request = json.loads(line)
            if "scenario" in request:
                if rounds is not None:
                    rounds.sm.close()
                scenario = SCENARIOS[request["scenario"]]
                sm = build(model_dir, mtp_path, config, scenario)
                rounds = Rounds(sm, scenario_round(sm, scenario, prompt, tokens), yardstick, tokens)
                rounds.warm_up()
                counted = True
                say({"ready": request["scenario"]})
            else:
                yard = rounds.yard()
                say({**rounds.timed(counted), "yard_costs": yard})
                counted = False
    except Exception as exc:  # noqa: BLE001 - the parent reports it in one line
        say({"error": f"{type(exc).__name__}: {exc}"})


if __name__ == "__main__" and sys.argv[1:] == ["--worker"]:
    _worker()
