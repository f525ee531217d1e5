"""The packed expert layout: one aligned record per expert, one read per expert, identical output."""

import subprocess
import sys

import pytest

from mlx_streaming.config import StreamingConfig
from mlx_streaming.errors import CheckpointError
from mlx_streaming.decode.greedy import greedy_generate
from mlx_streaming.model import build_streaming_model


@pytest.fixture(scope="module")
def packed_dir(tmp_path_factory, model_dir):
    out = tmp_path_factory.mktemp("packed")
    done = subprocess.run([sys.executable, "-m", "mlx_streaming", "repack", "--model", str(model_dir), "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return out


@pytest.mark.parametrize("io_mode", ["buffered", "direct"])
def test_packed_layout_reads_once_per_expert_and_decodes_identically(model_dir, packed_dir, reference_model, prompt_ids, io_mode):
    config = StreamingConfig(pool_slots=6, io_mode=io_mode, verify=True)
    with build_streaming_model(model_dir, config.replace(packed_dir=str(packed_dir))) as packed:
        ids = greedy_generate(packed.model, prompt_ids[0], 24)
        stats, reads = packed.store.stats(), packed.store.reader.reads
        assert all(s.offset % 4096 == 0 for s in packed.store.index.slices(0, 3)[:1])
    with build_streaming_model(model_dir, config) as scattered:
        assert greedy_generate(scattered.model, prompt_ids[0], 24) == ids
        assert scattered.store.reader.reads == 9 * scattered.store.stats()["misses"]
        assert scattered.store.stats()["misses"] == stats["misses"]
    assert reads == stats["misses"] > 0  # one read per expert
    assert stats["verify_calls"] == stats["misses"] and stats["verify_bad"] == 0
    assert ids == greedy_generate(reference_model, prompt_ids[0], 24)


def test_packed_layout_covers_the_mtp_layer(model_dir, packed_dir, prompt_ids):
    with build_streaming_model(model_dir, StreamingConfig(mtp=True, pool_slots=6, packed_dir=str(packed_dir))) as sm:
        mtp_layer = sm.model_config["num_hidden_layers"]
        assert sm.store.index.slices(mtp_layer, 0)[0].path.parent == packed_dir


def test_missing_or_truncated_packed_files_are_named(tmp_path, model_dir, packed_dir):
    with pytest.raises(CheckpointError, match="packed_index.json: missing"):
        build_streaming_model(model_dir, StreamingConfig(packed_dir=str(tmp_path)))
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(packed_dir, broken)
    victim = broken / "experts-layer002.bin"
    victim.write_bytes(victim.read_bytes()[:-4096])
    with pytest.raises(CheckpointError, match="experts-layer002.bin: packed experts of layer 2 missing or truncated"):
        build_streaming_model(model_dir, StreamingConfig(packed_dir=str(broken)))


def test_raw_read_probe_reads_one_expert_per_call(model_dir, packed_dir):
    from mlx_streaming.harness.bench import raw_read_probe
    from mlx_streaming.model import open_checkpoint

    scattered = open_checkpoint(model_dir, StreamingConfig()).index
    packed = open_checkpoint(model_dir, StreamingConfig(packed_dir=str(packed_dir))).index
    a, b = raw_read_probe(scattered, "direct", experts=16), raw_read_probe(packed, "direct", experts=16)
    assert (a["reads_per_expert"], b["reads_per_expert"]) == (9.0, 1.0)
    assert a["bytes"] == b["bytes"] == 16 * scattered.expert_bytes and a["gbps"] > 0 and b["gbps"] > 0


def test_io_report_measures_a_ceiling_over_request_sizes_and_threads(model_dir):
    from mlx_streaming.harness.bench import io_report, io_table
    from mlx_streaming.run_settings import RunSettings

    report = io_report(model_dir, StreamingConfig(pool_slots=6, io_mode="direct", read_threads=3),
                       RunSettings(max_tokens=4, warmup_tokens=0, repeat=1))
    cells = report["ceiling"]["cells"]
    assert {(c["batch"], c["threads"]) for c in cells} == {(b, t) for b in (1, 4, 16) for t in (1, 2, 4, 8, 16)}
    assert report["ceiling"]["best"]["gbps"] == max(c["gbps"] for c in cells) > 0
    assert report["demand_read_gbps"] > 0
    assert report["demand_over_ceiling"] == report["demand_read_gbps"] / report["ceiling"]["best"]["gbps"]
    placement = report["placement"]
    assert placement["bytes"] == placement["experts"] * report["expert_bytes"] and placement["experts"] == 32
    assert placement["place_over_copy"] == pytest.approx(placement["place_gbps"] / placement["copy_gbps"])
    assert placement["place_over_one_array"] == pytest.approx(placement["place_gbps"] / placement["one_array_gbps"])
    assert "of the ceiling" in io_table(report) and "a plain copy of the same bytes" in io_table(report)
    assert all(0 <= c["in_place"] <= 1 for c in cells)
    assert f"{report['demand_in_place']:.2f} of its reads in place" in io_table(report)
    assert placement["writes"] == "host" and "into a pool (host writes)" in io_table(report)  # this CPU's way
    assert f"placement {placement['place_over_copy']:.2f} and {placement['place_over_one_array']:.2f} of them" in io_table(report)
    # the engine read with the threads it was given (no cell of the grid runs 3): the table names the best depth
    best = report["ceiling"]["best"]["threads"]
    assert report["read_threads"] == 3 and f"--read-threads 3): " in io_table(report)
    assert f"try --read-threads {best})" in io_table(report)
    # nine reads per expert in this layout: the table points to the packed one, and says nothing of it once packed
    assert (f"Each expert took 9 reads in this layout; the packed layout reads it in one: mlx-streaming repack "
            f"--model {model_dir} --out DIR, then --packed DIR.") in io_table(report)
    packed = {**report, "ceiling": {**report["ceiling"], "best": {**report["ceiling"]["best"], "reads_per_expert": 1.0}}}
    assert "repack" not in io_table(packed)
    # the bound: the misses' bytes at the ceiling plus in-memory's time per token, from rounds alternated with it
    bound = report["bound"]
    assert bound["ids_equal"] and report["demand_bytes_per_token"] > 0
    ceiling = report["ceiling"]["best"]["gbps"] * 1e9
    assert bound["read_ms"] == pytest.approx(1000 * report["demand_bytes_per_token"] / ceiling)
    assert bound["compute_ms"] == pytest.approx(1000 / bound["inmemory_tok_s"]["median"])
    engine_ms = 1000 / report["greedy_tok_s"]["median"]
    assert bound["over_bound"] == pytest.approx(engine_ms / (bound["read_ms"] + bound["compute_ms"]))
    assert f"= {bound['over_bound']:.2f}x its bound" in io_table(report) and "ids equal" in io_table(report)
    assert "No bound" in io_table({k: v for k, v in report.items() if k != "bound"})


def test_placement_against_a_copy_that_reaches_a_device_with_memory_of_its_own(model_dir, monkeypatch):
    """Where the device has memory of its own (CUDA), each yardstick copies its host arrays on the device too (an
    array made from host bytes stays in host memory there until a kernel reads it), and the pool writes by
    scatter or by slot, not through host views: run here with the CPU taken for such a device."""
    from mlx_streaming.harness.bench.io_report import placement_probe
    from mlx_streaming.model import open_checkpoint
    from mlx_streaming.residency import pool

    monkeypatch.setattr(pool, "computes_in_host_memory", lambda: False)
    index = open_checkpoint(model_dir, StreamingConfig()).index
    assert pool.ExpertPool(index, 4, layers=index.layers[:1]).writes == "slots"
    placement = placement_probe(index, "buffered", experts=8)
    assert placement["writes"] == "slots" and placement["bytes"] == 8 * index.expert_bytes and placement["place_gbps"] > 0
    assert placement["copy_gbps"] > 0 and placement["one_array_gbps"] > 0
    assert placement["place_over_copy"] == pytest.approx(placement["place_gbps"] / placement["copy_gbps"])


def test_a_gpu_with_memory_of_its_own_scatters_small_experts_and_writes_large_ones_by_slot(model_dir, monkeypatch):
    import mlx.core as mx

    from mlx_streaming.model import open_checkpoint
    from mlx_streaming.residency import pool

    index = open_checkpoint(model_dir, StreamingConfig()).index
    monkeypatch.setattr(pool, "computes_in_host_memory", lambda: False)
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.gpu))
    assert index.expert_bytes < pool.SCATTER_BELOW
    assert pool.ExpertPool(index, 4, layers=index.layers[:1]).writes == "scatter"
    monkeypatch.setattr(pool, "SCATTER_BELOW", index.expert_bytes)  # experts as large as the bound: slot writes
    assert pool.ExpertPool(index, 4, layers=index.layers[:1]).writes == "slots"


def test_staged_writes_take_a_staging_row_again_only_once_its_copies_have_run(model_dir, monkeypatch):
    """More experts placed at once than the staging arrays have rows: every slot still holds its own expert's
    bytes (a row written again before the device ran the copy from it would leave a later expert's bytes in an
    earlier slot)."""
    import mlx.core as mx
    import numpy as np

    from mlx_streaming.io.reader import ExpertReader
    from mlx_streaming.model import open_checkpoint
    from mlx_streaming.residency import pool

    monkeypatch.setattr(pool, "STAGING_ROWS", 2)
    index = open_checkpoint(model_dir, StreamingConfig()).index
    layer, experts = index.layers[0], list(range(5))
    reader = ExpertReader("buffered")
    try:
        staged = {e: reader.read([(s.path, s.offset, s.nbytes) for s in index.slices(layer, e)]) for e in experts}
    finally:
        reader.close()
    expert_pool = pool.ExpertPool(index, 8, layers=[layer])
    expert_pool.use_writes("staged")
    placed, _, writes = expert_pool.place(layer, experts, staged, set())
    assert writes == len(experts) * len(index.slices(layer, 0))
    for expert, slot in placed:
        for s, buf in zip(index.slices(layer, expert), staged[expert]):
            held = pool.numpy_exportable(expert_pool.arrays[layer][s.tensor][slot])
            assert np.array(held).reshape(-1).view(np.uint8).tobytes() == buf.tobytes(), (expert, s.tensor)


def test_a_gpu_with_memory_of_its_own_stages_large_experts_where_the_driver_takes_the_advice(model_dir, monkeypatch):
    import mlx.core as mx

    from mlx_streaming.model import open_checkpoint
    from mlx_streaming.residency import pool

    index = open_checkpoint(model_dir, StreamingConfig()).index
    monkeypatch.setattr(pool, "computes_in_host_memory", lambda: False)
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.gpu))
    monkeypatch.setattr(pool, "SCATTER_BELOW", index.expert_bytes)
    advised = []
    monkeypatch.setattr(pool, "advise_read_in_place", lambda view: advised.append(view.nbytes) or True)
    staged = pool.ExpertPool(index, 4, layers=index.layers[:1])
    assert staged.writes == "staged" and set(staged.staging) == set(index.tensor_specs)
    assert sorted(advised) == sorted(rows.array.nbytes for rows in staged.staging.values())  # every staging array
    monkeypatch.setattr(pool, "advise_read_in_place", lambda view: False)  # no CUDA driver, or advice refused
    unadvised = pool.ExpertPool(index, 4, layers=index.layers[:1])
    assert unadvised.writes == "slots" and not unadvised.staging


def test_packed_experts_read_past_the_page_cache_land_in_the_pool_with_no_bounce(tmp_path):
    """The small preset's expert tensors are multiples of 4096 bytes, so its packed records read with O_DIRECT go
    straight into the pool's rows (this CPU backend's pool arrays start page-aligned) and into the reader's own
    block: every demand read skips the bounce buffer (of the MLX layout's reads, only those whose tensor happens to
    start on a page), and both decode in-memory greedy's ids with every placed expert matching its bytes."""
    import mlx_lm

    from mlx_streaming.harness.synth import preset_config
    from mlx_streaming.harness.synth_stream import write_checkpoint

    model, packed = tmp_path / "small", tmp_path / "packed"
    model.mkdir()
    write_checkpoint(model, preset_config("small", vocab_size=320, layers=4), seed=0)
    done = subprocess.run([sys.executable, "-m", "mlx_streaming", "repack", "--model", str(model), "--out",
                           str(packed)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    prompt = [1, 5, 9, 40, 77]  # the byte tokenizer's ids (its vocabulary is 320)
    reference = greedy_generate(mlx_lm.load(str(model))[0], prompt, 8)
    config = StreamingConfig(pool_slots=16, io_mode="direct", verify=True)
    runs = {}
    for layout, run_config in (("packed", config.replace(packed_dir=str(packed))), ("mlx", config)):
        with build_streaming_model(model, run_config) as sm:
            assert greedy_generate(sm.model, prompt, 8) == reference
            if "buffered" in sm.store.reader.effective_modes.values():  # tmpfs, for one, refuses O_DIRECT
                pytest.skip(f"{tmp_path}'s filesystem refuses cache-bypass reads")
            runs[layout] = sm.store.stats()
            if layout == "packed":  # the reader's own block, as the prefetcher and `bench --io` read into
                first = sm.store.index.slices(sm.store.index.layers[0], 0)
                reading = sm.store.reader.start([(s.path, s.offset, s.nbytes) for s in first])
                reading.take(len(first))
                assert reading.in_place == 1
    for stats in runs.values():
        assert stats["misses"] > 0 and stats["verify_ok"] == stats["misses"] and stats["verify_bad"] == 0
    for stats in runs.values():
        assert stats["demand_reads"] == stats["read_calls"]  # no prefetch: every read a demand read
    assert runs["packed"]["reads_in_place"] == runs["packed"]["demand_reads"] > 0
    assert runs["mlx"]["reads_in_place"] < runs["mlx"]["demand_reads"]
