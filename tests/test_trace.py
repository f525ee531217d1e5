"""Routing traces: recorded once, replayed through the engine's own policy; the replay equals live runs."""

import json
import subprocess
import sys

import pytest

from mlx_streaming.residency.trace import curve, read_trace, replay, write_trace
from mlx_streaming.config import StreamingConfig
from mlx_streaming.errors import ConfigError, OutputError
from mlx_streaming.decode.greedy import greedy_generate
from mlx_streaming.model import build_streaming_model

PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n"


def _live(model_dir, slots, trace_path=None, eviction="lfu"):
    """(hits, misses) of a 20-token greedy run at ``slots``; with ``trace_path``, its trace written there."""
    with build_streaming_model(model_dir, StreamingConfig(pool_slots=slots, eviction=eviction)) as sm:
        ids = sm.tokenizer.encode(PROMPT)
        sm.store.route_log = []
        greedy_generate(sm.model, ids, 20)
        if trace_path:
            prefill_calls = len(sm.store.index.layers)  # one prefill forward: one call per MoE layer
            write_trace(trace_path, sm.store, len(ids), 20, prefill_calls)
        s = sm.store.stats()
        return s["hits"], s["misses"]


@pytest.fixture(scope="module")
def recorded(model_dir, tmp_path_factory):
    """(trace file of a 20-token run at 12 slots, that run's (hits, misses))."""
    path = tmp_path_factory.mktemp("trace") / "trace.json"
    return path, _live(model_dir, 12, path)


def test_replay_equals_live_runs_at_two_pool_sizes(model_dir, recorded):
    path, live_12 = recorded
    trace = read_trace(path)
    assert (replay(trace, 12)["hits"], replay(trace, 12)["misses"]) == live_12
    live_6 = _live(model_dir, 6)  # the same greedy ids, so the same routes, at another pool size
    assert (replay(trace, 6)["hits"], replay(trace, 6)["misses"]) == live_6
    assert live_6[0] < live_12[0]
    lru_6 = _live(model_dir, 6, eviction="lru")
    assert (replay(trace, 6, eviction="lru")["hits"], replay(trace, 6, eviction="lru")["misses"]) == lru_6
    assert lru_6 != live_6  # the two rules keep different experts here
    rows = curve(trace, 2e9)
    assert [r["slots"] for r in rows] == list(range(trace["top_k"], trace["num_experts"] + 1))
    assert rows[-1]["misses"] == len({(layer, e) for layer, _, experts in trace["calls"] for e in experts})
    lru = curve(trace, 2e9, eviction="lru")
    assert all(a["hit_rate"] <= b["hit_rate"] for a, b in zip(lru, lru[1:]))  # LRU: more slots never hit less


def test_trace_files_are_checked_and_nothing_else_is_overwritten(model_dir, tmp_path):
    mine = tmp_path / "notes.json"
    mine.write_text('{"my": "notes"}')
    with build_streaming_model(model_dir, StreamingConfig(pool_slots=6)) as sm:
        sm.store.route_log = []
        greedy_generate(sm.model, sm.tokenizer.encode(PROMPT), 2)
        with pytest.raises(OutputError, match="is not a routing trace"):
            write_trace(mine, sm.store, 1, 2, 8)
    assert json.loads(mine.read_text()) == {"my": "notes"}
    with pytest.raises(ConfigError, match="not a routing trace"):
        read_trace(mine)
    out = subprocess.run([sys.executable, "-m", "mlx_streaming", "plan", "--trace", str(mine)], capture_output=True,
                         text=True)
    assert out.returncode == 2 and "not a routing trace" in out.stderr and "Traceback" not in out.stderr


def test_plan_draws_the_curve_into_a_png_and_replaces_only_its_own(recorded, tmp_path):
    path, png = recorded[0], tmp_path / "curve.png"

    def plot():
        return subprocess.run([sys.executable, "-m", "mlx_streaming", "plan", "--trace", str(path), "--plot", str(png)],
                              capture_output=True, text=True)

    first = plot()
    assert first.returncode == 0, first.stderr
    data = png.read_bytes()
    assert data.startswith(b"\x89PNG") and b"mlx-streaming plan --trace" in data[:4096]
    assert plot().returncode == 0  # its own file: replaced
    photo = tmp_path / "photo.png"
    photo.write_bytes(b"\x89PNG not ours")
    refused = subprocess.run([sys.executable, "-m", "mlx_streaming", "plan", "--trace", str(path), "--plot", str(photo)],
                             capture_output=True, text=True)
    assert refused.returncode == 2 and "was not written by mlx-streaming" in refused.stderr
    assert photo.read_bytes() == b"\x89PNG not ours"


def _trace(calls, layers=(0,), num_experts=8, top_k=1, decode_from=0):
    return {"layers": list(layers), "num_experts": num_experts, "top_k": top_k, "decode_from": decode_from,
            "calls": [[layer, 1, list(experts)] for layer, experts in calls]}


@pytest.mark.parametrize("rank, eviction", [("LFU", "lfu"), ("LRU", "lru")])
def test_the_policy_study_replays_the_engines_rules_per_layer_as_the_engine_does(recorded, rank, eviction):
    from mlx_streaming.residency import policy_study

    trace = read_trace(recorded[0])
    for slots in (trace["top_k"], 6, 12, trace["num_experts"]):
        ours = policy_study.replay(trace, slots, rank, "per layer")
        assert ours["decode_misses"] == replay(trace, slots, eviction=eviction)["decode_misses"]


def test_the_policy_study_knows_each_rule_and_belady_bounds_them(recorded):
    from mlx_streaming.residency import policy_study

    cycle = _trace([(0, [e]) for e in [0, 1, 2] * 6])  # a loop one longer than the pool: LRU always misses
    rates = {rank: policy_study.replay(cycle, 2, rank, "per layer")["decode_hits"] for rank in policy_study.RANKS}
    assert rates["LRU"] == 0 and rates["Belady"] == 8  # Belady keeps one of the two others: a hit every other call
    hot = _trace([(0, [e]) for e in [0, 0, 0, 1, 2, 0, 3, 0, 4, 0]])  # 0 is used most; 1-4 once each
    assert policy_study.replay(hot, 2, "LFU", "per layer")["decode_hits"] == 5
    assert policy_study.replay(hot, 2, "LRU-2", "per layer")["decode_hits"] == 5
    # two layers, one busy and one idle: a shared pool lends the idle layer's slots to the busy one
    uneven = _trace([(0, [e % 3]) for e in range(12)] + [(1, [0])], layers=(0, 1))
    assert policy_study.replay(uneven, 2, "LRU", "shared")["decode_hits"] > policy_study.replay(
        uneven, 2, "LRU", "per layer")["decode_hits"]
    rows = policy_study.compare(read_trace(recorded[0]))
    for share in policy_study.SHARES:
        at = {r["policy"]: r["decode_hit_rate"] for r in rows if r["share"] == share}
        for rank in policy_study.RANKS:
            assert at[f"{rank}, per layer"] <= at["Belady, per layer"] + 1e-12
            assert at[f"{rank}, shared"] <= at["Belady, shared"] + 1e-12


def test_plan_prints_the_policies_beside_belady(recorded, tmp_path):
    out = subprocess.run([sys.executable, "-m", "mlx_streaming", "plan", "--trace", str(recorded[0]), "--json",
                          str(tmp_path / "plan.json")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "Belady, per layer" in out.stdout and "LRU-2, shared" in out.stdout
    saved = json.loads((tmp_path / "plan.json").read_text())
    assert saved["curve"][0]["slots"] == read_trace(recorded[0])["top_k"] and len(saved["policies"]) == 4 * 8
