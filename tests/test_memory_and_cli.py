"""Expert tensors are never loaded whole; the console script works end to end."""

import json
import subprocess
import sys

from mlx_streaming.run_settings import RunSettings

MEASURE = """
import json, sys
import mlx.core as mx
from mlx_streaming.config import StreamingConfig
from mlx_streaming.harness.memory import resident_dense_bytes
from mlx_streaming.model import build_streaming_model, plan_memory
config = StreamingConfig(pool_slots=int(sys.argv[2]), mtp=True)
plan = plan_memory(sys.argv[1], config)  # before anything is loaded
sm = build_streaming_model(sys.argv[1], config)
print(json.dumps({"active": mx.get_active_memory(), "dense": resident_dense_bytes(sm.model, sm.store),
                  "mtp_dense": resident_dense_bytes(sm.mtp, sm.store), "pool": sm.store.pool.nbytes,
                  "plan": [plan.dense_bytes, plan.mtp_dense_bytes, plan.pool_bytes, plan.weights_bytes, plan.allowance],
                  "experts_on_disk": sm.store.index.expert_bytes * sm.store.index.num_experts * len(sm.store.index.layers)}))
"""


def test_active_memory_after_build_is_what_the_plan_said(model_dir):
    """In a fresh process, so nothing else the suite built is counted: the plan, made from the headers before
    loading, gives each part's bytes as measured after loading, and MLX's active memory stays within the
    plan's weights plus its allowance."""
    out = subprocess.run([sys.executable, "-c", MEASURE, str(model_dir), "4"], check=True, capture_output=True, text=True)
    m = json.loads(out.stdout.strip().splitlines()[-1])
    dense, mtp_dense, pool, weights, allowance = m["plan"]
    assert (dense, mtp_dense, pool) == (m["dense"], m["mtp_dense"], m["pool"]), m
    assert m["active"] <= weights + allowance, m
    assert m["active"] <= 1.10 * (m["dense"] + m["mtp_dense"] + m["pool"]), m
    assert m["active"] < m["dense"] + m["experts_on_disk"] / 2, m  # far from everything loaded


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "mlx_streaming", *args], capture_output=True, text=True, timeout=300)


def test_generate_prints_text_and_expert_traffic(model_dir):
    out = _cli("generate", "--model", str(model_dir), "--prompt", "def f(x):", "--max-tokens", "12", "--pool-slots", "6")
    assert out.returncode == 0, out.stderr
    stats = json.loads(out.stderr.strip().splitlines()[-1])
    assert stats["misses"] > 0 and out.stdout.strip() != ""


def test_cli_reports_bad_options_by_name(model_dir):
    out = _cli("generate", "--model", str(model_dir), "--pool-slots", "2")
    assert out.returncode == 2
    assert "--pool-slots 2 gives 2 expert slots per MoE layer, below num_experts_per_tok" in out.stderr


def test_synth_cli_writes_a_loadable_checkpoint(tmp_path):
    out = _cli("synth", "--preset", "tiny", "--seed", "3", "--out", str(tmp_path / "m"))
    assert out.returncode == 0, out.stderr
    import mlx_lm

    model, tokenizer = mlx_lm.load(str(tmp_path / "m"))
    text = mlx_lm.generate(model, tokenizer, "hello", max_tokens=8)
    assert isinstance(text, str) and len(tokenizer.encode(text)) > 0


def test_bench_sweep_and_noise_floor_modes(model_dir, tmp_path):
    sweep = _cli("bench", "--model", str(model_dir), "--sweep", "--max-tokens", "4", "--warmup", "2", "--repeat", "1",
                 "--json", str(tmp_path / "sweep.json"))
    assert sweep.returncode == 0, sweep.stderr
    rows = json.loads((tmp_path / "sweep.json").read_text())
    assert [r["scenario"] for r in rows] == ["mlx-lm in-memory", "streaming 100%", "streaming 25%", "streaming 25%"]
    assert all(r["ids_match"] for r in rows) and rows[2]["disk_loads"] > 0
    noise = _cli("bench", "--model", str(model_dir), "--processes", "2", "--max-tokens", "4", "--warmup", "0", "--repeat", "1",
                 "--pool-slots", "6")
    assert noise.returncode == 0, noise.stderr
    report = json.loads(noise.stdout)
    assert report["processes"] == 2 and len(report["greedy_tok_s"]["values"]) == 2
    assert report["ids_identical_across_processes"] and report["disk_loads_identical"]


def test_bench_overhead_splits_each_token_and_counts_one_sync_per_warm_deferred_token(model_dir):
    from mlx_streaming.config import StreamingConfig
    from mlx_streaming.harness import bench

    report = bench.overhead_report(model_dir, StreamingConfig(), RunSettings(max_tokens=6, warmup_tokens=24, repeat=1))
    rows = {(r["path"], r["miss_check"]): r for r in report["rows"]}
    assert all(r["ids_match"] for r in report["rows"])
    layer, token = rows["streaming greedy", "layer"], rows["streaming greedy", "forward"]
    assert layer["host_syncs_per_token"] == 8  # one per MoE layer call, decode only (the prefill is not counted)
    assert token["host_syncs_per_token"] == 1 and token["deferred_retries"] == 0  # the warm full pool
    parts = ("sync", "route", "read", "place", "other")
    assert abs(sum(token[f"{p}_ms_per_token"] for p in parts) - token["ms_per_token"]) < 1e-6
    assert token["route_ms_per_token"] > 0 and token["cpu_ms_per_token"] > 0
    table = bench.overhead_table(report)
    assert "CPU ms over in-memory" in table and "route ms" in table


def test_plan_prints_without_loading_and_auto_budget_sizes_the_pool(model_dir):
    plan = _cli("plan", "--model", str(model_dir), "--memory-budget", "auto")
    assert plan.returncode == 0, plan.stderr
    assert "memory plan: dense weights" in plan.stdout and "margin left" in plan.stdout
    experts = json.loads((model_dir / "config.json").read_text())["num_experts"]
    assert f"{experts} of {experts} experts" in plan.stdout and f"cut to {experts}" in plan.stdout  # far more than 25 MB here
    small = _cli("plan", "--model", str(model_dir), "--memory-budget", "4M")
    assert small.returncode == 2 and "--memory-budget 4.0 MB is below the dense weights" in small.stderr
    assert "Traceback" not in small.stderr
    generate = _cli("generate", "--model", str(model_dir), "--pool-slots", "6", "--max-tokens", "2")
    assert generate.returncode == 0 and generate.stderr.startswith("memory plan:"), generate.stderr
    assert f"pool: 6 of {experts} experts per MoE layer" in generate.stderr


def test_bench_k_report_compares_auto_with_every_fixed_k(model_dir):
    from mlx_streaming.config import StreamingConfig
    from mlx_streaming.harness import bench

    report = bench.k_report(model_dir, StreamingConfig(pool_slots=12), RunSettings(max_tokens=8, warmup_tokens=2, repeat=1))
    autos = ("auto", "auto kept")  # a new chooser per run, and one kept across the arm's runs
    assert set(report["tok_s"]) == {"1", "2", "3", "4", *autos} and report["ids_equal_greedy"]
    fixed = {k: v["median"] for k, v in report["tok_s"].items() if k not in autos}
    assert str(report["best_fixed"]) == max(fixed, key=fixed.get)
    cpu = report["cpu_ms_per_token"]  # the same verdict in the process's CPU time per token
    assert set(cpu) == set(report["tok_s"]) and all(ms > 0 for ms in cpu.values())
    best_cpu = min((k for k in cpu if k not in autos), key=cpu.get)
    assert report["best_fixed_by_cpu"] == best_cpu
    for name, key in zip(autos, ("auto", "auto_kept")):
        assert report[f"{key}_over_best"] == report["tok_s"][name]["median"] / max(fixed.values())
        assert report[f"{key}_over_best_by_cpu"] == cpu[best_cpu] / cpu[name]
        assert len(report[f"{key}_k_steps_per_round"]) == len(report[f"{key}_catch_up_ms_per_round"]) == 1
    # 8 tokens: the chooser's first CLIMB_AFTER steps at K=1, then K=2 once (no more than 7 steps in all)
    assert report["auto_k_steps_per_round"] == [report["auto_k_steps"]] and report["auto_k_steps"]["1"] >= 4
    assert len(report["tok_s_per_round"]["auto"]) == 1
    (catch_up_ms,) = report["auto_catch_up_ms_per_round"]  # the K=2 probe fed the head the positions before it
    assert catch_up_ms > 0
    table = bench.auto_table(report, "K")
    assert "auto / best fixed" in table and "auto kept / best fixed" in table and "catch-ups" in table
    assert "by CPU time" in table and "CPU ms/token" in table


def test_bench_prefetch_auto_report_compares_auto_with_on_and_off(model_dir):
    from mlx_streaming.config import StreamingConfig
    from mlx_streaming.harness import bench

    report = bench.prefetch_auto_report(model_dir, StreamingConfig(pool_slots=12),
                                        RunSettings(max_tokens=8, warmup_tokens=2, repeat=1))
    assert set(report["tok_s"]) == {"off", "on", "auto"} and report["ids_identical"]
    assert report["best_fixed"] in ("off", "on")
    assert "auto / best fixed" in bench.auto_table(report, "prefetch")


def test_bench_io_compares_the_disk_with_the_engine_at_the_benchmarks_bounded_pool(tmp_path):
    """bench --io with no pool or io option measures the engine where it reads: the default benchmark's pool and
    io mode, so its demand rate is not the 0 of a pool that never misses."""
    out = subprocess.run([sys.executable, "-m", "mlx_streaming", "bench", "--io", "--max-tokens", "4", "--repeat", "1",
                          "--json", str(tmp_path / "io.json")], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "--pool-fraction 0.25, --io-mode direct: the benchmark's default" in out.stderr
    result = json.loads((tmp_path / "io.json").read_text())
    assert result["io_mode"] == "direct" and result["pool_slots"] == result["num_experts"] // 4
    assert result["demand_bytes_per_token"] > 0 and result["demand_read_gbps"] > 0
    assert "of the ceiling" in out.stdout and "x its bound" in out.stdout and result["bound"]["ids_equal"]


def test_bench_with_no_options_streams_from_disk_beside_in_memory(tmp_path):
    """The main job: no pool or io option given, bench streams at a quarter-size pool with the page cache
    bypassed, beside mlx-lm's in-memory model. Bare K and MAXTOK left in the shell change nothing."""
    import os

    env = {**{k: v for k, v in os.environ.items() if not k.startswith("MLX_STREAMING_")}, "K": "7", "MAXTOK": "50"}
    out = subprocess.run([sys.executable, "-m", "mlx_streaming", "bench", "--max-tokens", "4", "--warmup", "2",
                          "--repeat", "1", "--json", str(tmp_path / "bench.json")], capture_output=True, text=True,
                         timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    result = json.loads((tmp_path / "bench.json").read_text())
    assert result["K"] == "auto" and result["max_tokens"] == 4  # the defaults and the option, not K=7 / MAXTOK=50
    assert "K=7" not in out.stderr and "MAXTOK" not in out.stderr
    assert "--pool-fraction 0.25, --io-mode direct: the benchmark's default" in out.stderr
    assert result["io_mode"] == "direct" and result["pool_slots"] == result["num_experts"] // 4
    assert result["greedy_io"]["bytes_read"] > 0 and result["greedy_io"]["hit_rate"] < 1
    assert result["inmemory_ids_match"] and result["spec_inmemory_ids_match"]
    assert 0 < result["memory"]["weights_bytes"] < result["inmemory"]["weights_bytes"]
    assert result["memory"]["mlx_peak_growth_bytes"] > 0 and result["inmemory"]["mlx_peak_growth_bytes"] > 0
    lines = out.stdout.splitlines()
    assert lines[0].split()[:9] == ["path", "tok/s", "x", "in-memory", "hit", "rate", "disk", "loads", "MB"]
    inmemory, streaming = lines[2].split(), lines[3].split()
    assert inmemory[:3] == ["mlx-lm", "in-memory", "greedy"] and inmemory[-1] == "(reference)"
    assert streaming[:2] == ["streaming", "greedy"] and streaming[-1] == "True" and float(streaming[6]) > 0  # MB read


def test_a_setting_from_the_environment_is_named_on_stderr(monkeypatch, capsys):
    from mlx_streaming import cli

    monkeypatch.setenv("MLX_STREAMING_K", "3")
    monkeypatch.setenv("K", "7")
    args = cli.build_parser().parse_args(["bench", "--max-tokens", "4"])
    args.flags = cli._flags(cli.build_parser(), "bench")
    assert cli._run(args).k == 3 and cli._run(args).max_tokens == 4 and cli._config(args).prefill_chunk == 256
    assert capsys.readouterr().err.splitlines() == ["mlx-streaming: MLX_STREAMING_K=3 from the environment"]
    monkeypatch.setenv("MLX_STREAMING_K", "many")
    assert cli.main(["plan"]) == 2
    assert "environment variable MLX_STREAMING_K='many'" in capsys.readouterr().err


def test_bench_loops_times_stream_generate_under_both_loops_beside_in_memory(model_dir):
    from mlx_streaming.config import StreamingConfig
    from mlx_streaming.harness import bench

    report = bench.loops_report(model_dir, StreamingConfig(preload=True), RunSettings(max_tokens=6, warmup_tokens=2,
                                                                                        repeat=1))
    assert report["ids_equal"] and list(report["tok_s"]) == list(bench.loops.ARMS)
    assert report["x_in_memory"][bench.loops.ARMS[0]] == 1.0 and all(v["median"] > 0 for v in report["tok_s"].values())
    assert "streaming, engine's loop" in bench.loops_table(report)
    # each arm's host cost: main-thread CPU per decoded token, never more than the wall time the tokens took
    for name in bench.loops.ARMS:
        assert 0 < report["host_cpu_ms_per_token"][name] <= 1000 / report["tok_s"][name]["min"] * 1.05
