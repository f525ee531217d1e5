"""Larger than memory, for real: a model built once per session, a hard memory limit below its size (the kernel's
memory cgroup), mlx-lm's in-memory load killed under it, and the streaming model under the same limit decoding
the recorded reference's ids exactly, its peak memory under the limit.

The model has the ``small`` synthetic preset's shapes (about 360 MB, written by the streaming writer: as small as
still proves the point in CI); the limit is 200 MB. The reference is recorded where the model fits (this machine, outside the limit) by the same code as
``pytest --streaming-record-reference``. Where no memory cgroup can be made, the tests say why and skip.
"""

import json
import sys

import pytest

from mlx_streaming import cgroup
from mlx_streaming.harness import reference

MB = 1 << 20
LIMIT = 200 * MB
PROMPTS = ("def fibonacci(n):", "The quick brown fox")
TOKENS = 8

#: Builds the streaming model under the limit: the pool from the memory budget the process may take there
#: (``--memory-budget auto``), reads past the page cache, and checks its ids against the recorded reference.
STREAM = """
import json, sys
from pathlib import Path
from mlx_streaming.config import StreamingConfig
from mlx_streaming.decode.greedy import greedy_generate
from mlx_streaming.harness.reference import RecordedOracle
from mlx_streaming.model import build_streaming_model
from mlx_streaming.plan import auto_memory_budget
model, ref, prompts, tokens = Path(sys.argv[1]), Path(sys.argv[2]), json.loads(sys.argv[3]), int(sys.argv[4])
oracle = RecordedOracle(ref, model, prompts)
budget = auto_memory_budget()
config = StreamingConfig(memory_budget=budget, io_mode="direct")
with build_streaming_model(model, config) as sm:
    got = [greedy_generate(sm.model, sm.tokenizer.encode(p), tokens) for p in prompts]
    stats = sm.store.stats()
    print(json.dumps({"equal": [g == oracle.ids(i, tokens) for i, g in enumerate(got)], "budget": budget,
                      "capacity": sm.store.capacity, "experts": sm.store.index.num_experts,
                      "bytes_read": stats["bytes_read"]}))
"""

IN_MEMORY = """
import sys, mlx_lm
model, tokenizer = mlx_lm.load(sys.argv[1])
print("loaded", flush=True)
"""


@pytest.fixture(scope="session")
def bigger_than_the_limit(tmp_path_factory):
    """The small preset, written once per session, with its reference recorded in memory (it fits the machine,
    not the limit)."""
    import mlx_lm

    from mlx_streaming.decode.greedy import greedy_steps, top2_margin
    from mlx_streaming.harness.synth import preset_config
    from mlx_streaming.harness.synth_stream import write_checkpoint

    model = tmp_path_factory.mktemp("ltm") / "small"
    model.mkdir()
    write_checkpoint(model, preset_config("small", vocab_size=320), seed=0)  # streamed: in about a second
    assert reference.model_bytes(model) > LIMIT
    loaded, tokenizer = mlx_lm.load(str(model))
    runs = []
    for prompt in PROMPTS:
        steps = list(greedy_steps(loaded, tokenizer.encode(prompt), TOKENS))
        runs.append({"ids": [i for i, _ in steps], "margins": [list(top2_margin(logits)) for _, logits in steps]})
    recorded = reference.write(model.parent / "reference.json", model, "mlx-lm in memory", PROMPTS, runs)
    return model, recorded


def _limited(*argv):
    try:
        return cgroup.limited_run([sys.executable, "-c", *argv], LIMIT, timeout=600)
    except cgroup.LimitUnavailable as exc:
        pytest.skip(f"no hard memory limit here: {exc}")


def test_mlx_lm_cannot_load_it_under_the_limit(bigger_than_the_limit):
    model, _ = bigger_than_the_limit
    run = _limited(IN_MEMORY, str(model))
    assert run.killed_for_memory and run.returncode == -9 and "loaded" not in run.stdout


def test_the_streaming_model_decodes_the_recorded_reference_exactly_under_the_limit(bigger_than_the_limit):
    model, recorded = bigger_than_the_limit
    run = _limited(STREAM, str(model), str(recorded), json.dumps(PROMPTS), str(TOKENS))
    assert run.returncode == 0 and not run.killed_for_memory, run.stderr[-2000:]
    result = json.loads(run.stdout.splitlines()[-1])
    assert result["equal"] == [True] * len(PROMPTS)
    assert result["capacity"] < result["experts"] and result["bytes_read"] > 0  # a bounded pool, read from disk
    assert result["budget"] < LIMIT
    assert run.peak_bytes is not None and run.peak_bytes <= LIMIT


def _limited_cli(*args):
    try:
        return cgroup.limited_run([sys.executable, "-m", "mlx_streaming", *args], LIMIT, timeout=600)
    except cgroup.LimitUnavailable as exc:
        pytest.skip(f"no hard memory limit here: {exc}")


def test_the_commands_default_to_the_pool_the_limit_leaves(bigger_than_the_limit):
    """No pool option: every expert would not fit under the limit, so generate takes the pool
    ``--memory-budget auto`` gives and says why; bench does too, and skips its in-memory comparison, saying why,
    instead of being killed."""
    model, _ = bigger_than_the_limit
    run = _limited_cli("generate", "--model", str(model), "--max-tokens", "4", "--io-mode", "direct")
    assert run.returncode == 0 and not run.killed_for_memory, run.stderr[-2000:]
    assert "does not fit in the" in run.stderr and "--memory-budget auto" in run.stderr
    assert run.peak_bytes is not None and run.peak_bytes <= LIMIT
    bench = _limited_cli("bench", "--model", str(model), "--max-tokens", "4", "--repeat", "1", "--warmup", "0")
    assert bench.returncode == 0 and not bench.killed_for_memory, bench.stderr[-2000:]
    assert "no in-memory comparison: mlx-lm's in-memory model of" in bench.stderr
    sweep = _limited_cli("bench", "--model", str(model), "--sweep")
    assert sweep.returncode != 0 and not sweep.killed_for_memory
    assert "bench --sweep measures against mlx-lm's in-memory model" in sweep.stderr
    assert "Traceback" not in sweep.stderr
