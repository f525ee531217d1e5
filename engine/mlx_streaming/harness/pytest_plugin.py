"""The mlx-streaming pytest plugin: options, markers and session fixtures.

Fixtures build each model once per session (once per worker under pytest-xdist). Without ``--streaming-model``
the suite runs on the embedded default model (the small trained Qwen3-Next).

The plugin is installed into every pytest run of the environment (the ``pytest11`` entry point), so it acts only
on a run that asks for it: one that sets the ini option ``mlx_streaming = true`` (this project does) or gives a
``--streaming-*`` option. Anywhere else it registers no marker, deselects nothing, refuses nothing and prints
nothing.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from .oracle import ORACLE_TOKENS, GreedyOracle, file_lock

MARKERS = {
    "exact": "speculative or streaming ids against the greedy in-memory oracle, token by token",
    "perf": "benchmarks (pytest-benchmark); not run unless asked with -m perf",
}

TEST_PROMPTS = (
    "def fibonacci(n):",
    "The quick brown fox jumps over",
    "import numpy as np\n\nclass Matrix:",
    "Once upon a time, in a land far away,",
)
OPTION_PREFIX = "--streaming-"
#: The exactness checks' steps where mlx-lm's in-memory model does not fit, and the fewest allowed.
UNLOADABLE_EXACT_TOKENS = MIN_EXACT_TOKENS = 16


def pytest_addoption(parser):
    from . import perf_gate

    parser.addini("mlx_streaming", type="bool", default=False,
                  help="run the mlx-streaming suite's markers, perf gate and reports in this project")
    group = parser.getgroup("mlx-streaming")
    group.addoption("--streaming-model", default=None, help="model folder (default: the embedded trained model)")
    group.addoption("--streaming-mtp", default=None, help="MTP weights file (default: the model folder's mtp.safetensors)")
    group.addoption("--streaming-pool-slots", type=int, default=None, help="expert slots per layer for the streaming model (default: every expert)")
    group.addoption("--streaming-io-mode", default="buffered", choices=("buffered", "direct"), help="how the streaming model reads experts")
    group.addoption("--streaming-perf-tokens", type=int, default=16, help="tokens per timed perf round (default 16)")
    group.addoption("--streaming-perf-rounds", type=int, default=perf_gate.COMPUTE_ROUNDS,
                    help="timed rounds of the compute perf scenario (the full pool), each after its yardstick round "
                         f"(default {perf_gate.COMPUTE_ROUNDS}, from the power study: see docs/perf-gate.md)")
    group.addoption("--streaming-perf-disk-rounds", type=int, default=perf_gate.DISK_ROUNDS,
                    help="timed rounds of each perf scenario that reads experts from disk "
                         f"(default {perf_gate.DISK_ROUNDS})")
    group.addoption("--streaming-perf-threshold", type=float, default=None,
                    help="the slowdown the perf gate tolerates before failing, when it is also statistically clear "
                         "(default: each scenario's own, set from the power study: see docs/perf-gate.md)")
    group.addoption("--streaming-record-reference", action="store_true", default=False,
                    help="record the greedy oracle's ids and top-2 margins for the test prompts into "
                         "baselines/references/ (in memory where the model fits, else layer by layer), for checking "
                         "a model the machine cannot hold in memory")
    group.addoption("--streaming-exact-tokens", type=int, default=None, metavar="N",
                    help="greedy steps each exactness check compares, at most (default: each check's own, up to "
                         f"{ORACLE_TOKENS}, where mlx-lm's in-memory model fits; {UNLOADABLE_EXACT_TOKENS} where it does "
                         "not, since such a model decodes slowly; at least "
                         f"{MIN_EXACT_TOKENS}, which every accept length of K=4 needs)")
    group.addoption("--streaming-perf-base", default=None, metavar="REV",
                    help="measure git revision REV's engine on this machine, round for round beside the current tree's, "
                         "and judge speed against it (default: only where the stored baseline's machine profile "
                         "differs from this machine's, against the baseline's own revision)")


def _active(config) -> bool:
    """Whether this run asked for the plugin: its ini option, or a ``--streaming-*`` option on the command line."""
    return bool(config.getini("mlx_streaming")) or any(
        arg.startswith(OPTION_PREFIX) for arg in config.invocation_params.args)


def _perf_selected(config) -> bool:
    """Whether the marker expression (``-m``, read by pytest's own parser) selects a test marked ``perf``."""
    expression = config.getoption("markexpr", "") or ""
    if not expression:
        return False
    from _pytest.mark.expression import Expression  # pytest's parser of -m; no public name for it

    return Expression.compile(expression).evaluate(lambda name, **kwargs: name == "perf" and not kwargs)


CONFIG_FILES = ("pytest.ini", ".pytest.ini", "pyproject.toml", "tox.ini", "setup.cfg")


def _path_taken_for_rootdir(config):
    """The ``--streaming-* VALUE`` option whose value pytest took for a path when it chose its root directory (it
    does so before any installed plugin's options are known), so that it read no configuration file where the run
    was started from one's reach, or None."""
    args = list(config.invocation_params.args)
    invoked = Path(config.invocation_params.dir).resolve()
    above = [invoked, *invoked.parents]
    config_near = any((d / name).exists() for d in above for name in CONFIG_FILES)
    if config.rootpath in above and (config.inipath is not None or not config_near):
        return None
    for option, value in zip(args, args[1:]):
        if option.startswith(OPTION_PREFIX) and "=" not in option and Path(invoked, value).exists():
            return option, value
    return None


def pytest_configure(config):
    config._mlx_streaming_active = _active(config)
    if not config._mlx_streaming_active:
        return
    taken = _path_taken_for_rootdir(config)
    if taken:
        option, value = taken
        raise pytest.UsageError(
            f"pytest took {value} (the value of {option}) for its root directory ({config.rootpath}), so this "
            f"project's configuration was not read: write {option}={value}")
    tokens = config.getoption("--streaming-exact-tokens")
    if tokens is not None and not MIN_EXACT_TOKENS <= tokens <= ORACLE_TOKENS:
        raise pytest.UsageError(f"--streaming-exact-tokens={tokens}: give {MIN_EXACT_TOKENS} to {ORACLE_TOKENS}")
    for name, text in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {text}")
    if _perf_selected(config) and (config.getoption("numprocesses", None) or hasattr(config, "workerinput")):
        raise pytest.UsageError(
            "perf tests need a single process: pytest-benchmark disables itself under pytest-xdist and would record "
            "nothing. Run `pytest -m perf` without -n (exact and unit tests may use -n)."
        )


def _acting(config) -> bool:
    return getattr(config, "_mlx_streaming_active", False)


def pytest_collection_modifyitems(config, items):
    """``perf`` tests run only when asked for with ``-m perf``."""
    if not _acting(config) or _perf_selected(config):
        return
    kept = [item for item in items if item.get_closest_marker("perf") is None]
    if len(kept) != len(items):
        config.hook.pytest_deselected(items=[item for item in items if item.get_closest_marker("perf") is not None])
        items[:] = kept


def pytest_benchmark_update_machine_info(config, machine_info):
    if _acting(config):
        import mlx.core as mx

        machine_info["mlx_version"] = mx.__version__


def pytest_benchmark_compare_machine_info(config, benchmarksession, machine_info, compared_benchmark):
    """pytest-benchmark hands the compared baseline run (its saved JSON) here, when the session starts: keep it
    for the gate and for choosing its mode."""
    config._mlx_perf_baseline = (compared_benchmark, machine_info)


@pytest.hookimpl(hookwrapper=True)
def pytest_benchmark_group_stats(config, benchmarks, group_by):
    """The current run's scenarios (the entries without a baseline path), for the gate."""
    config._mlx_perf_current = {b["fullname"]: b.get("extra_info", {}) for b in benchmarks if b.get("path") is None}
    yield


def _same_profile(config) -> bool:
    from . import perf_gate

    baseline_run, machine_info = config._mlx_perf_baseline
    return perf_gate.machine_profile(machine_info) == perf_gate.machine_profile(baseline_run.get("machine_info", {}))


def _side_by_side_base(config):
    """(the revision the gate measures beside the current tree, why), or None: asked for with
    ``--streaming-perf-base``, or the compared baseline's own revision where its machine profile is not this
    machine's."""
    asked = config.getoption("--streaming-perf-base")
    if asked:
        return asked, "asked for with --streaming-perf-base"
    baseline_run, _ = getattr(config, "_mlx_perf_baseline", (None, None))
    if baseline_run is None or _same_profile(config):
        return None
    commit = baseline_run.get("commit_info", {}).get("id")
    return commit, "this machine's profile differs from the stored baseline's"


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    """The perf gate: each scenario's counters against the stored baseline's, its cost against the stored rounds
    (same machine profile) or against the base revision's rounds measured beside it (side by side)."""
    from . import perf_gate

    config = session.config
    baseline_run, _ = getattr(config, "_mlx_perf_baseline", (None, None))
    current = getattr(config, "_mlx_perf_current", None)
    mode = getattr(config, "_mlx_perf_mode", None)
    if not _acting(config) or not current or (baseline_run is None and mode is None):
        return
    baseline = {b["fullname"]: b.get("extra_info", {}) for b in baseline_run["benchmarks"]} if baseline_run else {}
    same = baseline_run is not None and _same_profile(config)
    if mode is not None:
        why_not = "no base revision measured beside it"
    else:
        why_not = None if same else "another machine profile"
    rows = perf_gate.check(current, baseline, why_not, config.getoption("--streaming-perf-threshold"))
    if baseline_run is not None:
        recorded = (f"stored run of {baseline_run.get('datetime', '?')} "
                    f"(commit {baseline_run.get('commit_info', {}).get('id', '?')[:10]})")
    else:
        recorded = "none stored (counters not judged)"
    if mode is None:
        mode = "stored: costs against the stored rounds" if same else "counters only: another machine profile"
    yardsticks = sorted({info.get("yardstick", "mlx-lm in memory, this model") for info in current.values()})
    config._mlx_perf_gate = (rows, recorded, mode, "; ".join(yardsticks))
    if any(row.fail for row in rows):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(scope="session")
def model_dir(request) -> Path:
    from ..defaults import default_model

    chosen = request.config.getoption("--streaming-model")
    return Path(chosen) if chosen else default_model()


@pytest.fixture(scope="session")
def mtp_path(request, model_dir) -> Path:
    chosen = request.config.getoption("--streaming-mtp")
    return Path(chosen) if chosen else model_dir / "mtp.safetensors"


def _workers(config) -> int:
    """Processes of this session that each build their own models (pytest-xdist workers, else 1)."""
    return int(getattr(config, "workerinput", {}).get("workercount", 1))


@pytest.fixture(scope="session")
def memory_plan(request, model_dir):
    """Whether mlx-lm's in-memory model of the suite's model fits (``reference.InMemoryPlan``)."""
    from .reference import InMemoryPlan

    return InMemoryPlan(model_dir, _workers(request.config))


@pytest.fixture(scope="session")
def perf_yardstick(model_dir, memory_plan, prompt_ids):
    """Whose in-memory decode the perf gate's yardstick rounds run (``perf_rounds.Yardstick``)."""
    from .perf_rounds import Yardstick

    return Yardstick.choose(model_dir, prompt_ids[0], memory_plan.fits)


#: Streaming models the suite holds at once (the model, the model with its MTP head, one a test builds).
MODELS_AT_ONCE = 3


@pytest.fixture(scope="session")
def streaming_config(request, memory_plan):
    """The suite's engine settings. With no pool option, every expert is resident where the in-memory model
    fits. Where it does not, the models the suite holds at once share the memory budget this process may take,
    and byte-truth verification is on: then the oracle is a recorded reference, and verification shows the
    streamed bytes are the checkpoint's."""
    from ..config import StreamingConfig
    from ..plan import AUTO_BUDGET_SHARE

    slots = request.config.getoption("--streaming-pool-slots")
    io_mode = request.config.getoption("--streaming-io-mode")
    if slots or memory_plan.fits:
        return StreamingConfig(pool_slots=slots, io_mode=io_mode)
    budget = int(memory_plan.available * AUTO_BUDGET_SHARE / MODELS_AT_ONCE)
    return StreamingConfig(memory_budget=budget, io_mode=io_mode, verify=True)


@pytest.fixture(scope="session")
def pool_config(model_dir, streaming_config):
    """``pool_config(slots, **changes)``: the suite's engine settings with ``changes`` and a pool of ``slots``
    experts per MoE layer, or of what the suite's budget gives one model where that is less
    (``model.within_budget``)."""
    from ..model import within_budget

    return lambda slots, **changes: within_budget(model_dir, streaming_config.replace(**changes), slots)


@pytest.fixture(scope="session")
def exact_tokens(request, memory_plan) -> int:
    """The most greedy steps an exactness check compares (``--streaming-exact-tokens``)."""
    chosen = request.config.getoption("--streaming-exact-tokens")
    return chosen or (ORACLE_TOKENS if memory_plan.fits else UNLOADABLE_EXACT_TOKENS)


@pytest.fixture(scope="session")
def streaming_model(model_dir, streaming_config):
    from ..model import build_streaming_model

    with build_streaming_model(model_dir, streaming_config) as sm:
        yield sm


@pytest.fixture(scope="session")
def mtp_model(model_dir, mtp_path, streaming_config):
    """The streaming model with its MTP head (experts of both in one pool)."""
    from ..model import build_streaming_model

    with build_streaming_model(model_dir, streaming_config.replace(mtp=True, mtp_path=str(mtp_path))) as sm:
        yield sm


@pytest.fixture(scope="session")
def reference_model(model_dir, memory_plan):
    """mlx-lm's own in-memory model on the same checkpoint: the oracle. Where it does not fit, the tests that
    need it are skipped, saying why, before anything is loaded (never killed by the kernel)."""
    import mlx_lm

    if not memory_plan.fits:
        pytest.skip(f"{memory_plan.why_not}: the checks that need it are skipped")
    model, _ = mlx_lm.load(str(model_dir))
    return model


@pytest.fixture(scope="session")
def prompt_ids(streaming_model):
    """Token ids of the standard test prompts."""
    return [streaming_model.tokenizer.encode(p) for p in TEST_PROMPTS]


class PerfBase:
    """The side-by-side gate's base engine for the perf scenarios, or nothing (stored mode, or a base that cannot
    be measured: then ``why_not`` is the one line the gate reports and the costs are not compared)."""

    def __init__(self, config, engine=None, why_not=None):
        self.config, self.engine = config, engine
        if why_not:
            self.unavailable(why_not)

    def unavailable(self, why: str) -> None:
        self.engine = None
        self.config._mlx_perf_mode = f"counters only: {why}"


@pytest.fixture(scope="session")
def perf_base(request, model_dir, mtp_path, streaming_config, prompt_ids, perf_yardstick):
    """The base revision's engine beside the current tree (``side_by_side``), where the gate compares side by
    side; it goes (worker stopped, exported tree removed) when the session ends, Ctrl-C included."""
    from .side_by_side import BaseEngine, BaseUnavailable

    config = request.config
    chosen = _side_by_side_base(config)
    if chosen is None:
        yield PerfBase(config)
        return
    rev, why = chosen
    if streaming_config.memory_budget is not None:
        yield PerfBase(config, why_not=f"{model_dir} does not fit in memory, and a base revision's engine beside "
                                       "this one would need as much again")
        return
    if not rev:
        yield PerfBase(config, why_not="the stored baseline names no commit to measure beside")
        return
    engine_config = {"io_mode": streaming_config.io_mode, "pool_slots": streaming_config.pool_slots}
    try:
        engine = BaseEngine(Path(config.invocation_params.dir), rev, model_dir, mtp_path, prompt_ids[0],
                            config.getoption("--streaming-perf-tokens"), engine_config, perf_yardstick.as_dict())
    except BaseUnavailable as exc:
        yield PerfBase(config, why_not=str(exc))
        return
    named = engine.commit[:10] if engine.commit.startswith(rev) else f"{rev} ({engine.commit[:10]})"
    config._mlx_perf_mode = f"side by side: base revision {named} on this machine, {why}"
    with engine:
        yield PerfBase(config, engine)


@pytest.fixture(scope="session")
def oracle(request, model_dir, memory_plan, prompt_ids, exact_tokens, tmp_path_factory):
    """The greedy oracle of ``TEST_PROMPTS``: live on mlx-lm's in-memory model where it fits (``GreedyOracle``,
    shared by every test and every xdist worker of the session: workers' temp folders sit in one folder per
    session; a lone process's is its own), else the recorded reference of this model
    (``reference.RecordedOracle``), else the tests that need one are skipped, saying why. With
    ``--streaming-record-reference`` the oracle's answers are recorded first."""
    from . import reference

    path = reference.reference_path(_references_folder(request.config), model_dir)
    base = tmp_path_factory.getbasetemp()
    session_folder = base.parent if hasattr(request.config, "workerinput") else base
    if request.config.getoption("--streaming-record-reference"):
        with file_lock(session_folder / "reference.lock"):  # one recording per session, whatever the workers
            if not (session_folder / "reference.recorded").exists():
                _record_reference(request, path, model_dir, memory_plan, prompt_ids, exact_tokens, session_folder)
                (session_folder / "reference.recorded").touch()
    if memory_plan.fits:
        return GreedyOracle(request.getfixturevalue("reference_model"), prompt_ids, session_folder)
    if not path.exists():
        pytest.skip(f"{memory_plan.why_not}, and no recorded reference ({path}): record one with "
                    "--streaming-record-reference")
    return reference.RecordedOracle(path, model_dir, TEST_PROMPTS)


ORACLE_KEY = "oracle"


@pytest.fixture(autouse=True)
def _name_the_oracle(request):
    """Each test that uses the oracle says which (``ORACLE_KEY``), for the report, under pytest-xdist too."""
    if _acting(request.config) and "oracle" in request.fixturenames:
        request.node.user_properties.append((ORACLE_KEY, request.getfixturevalue("oracle").kind))
    yield


def _references_folder(config) -> Path:
    """Where recorded references live: beside the perf baselines (pytest-benchmark's storage folder, this
    project's ``baselines/``), in ``references/``."""
    storage = str(config.getoption("benchmark_storage", None) or "file://./.benchmarks")
    folder = Path(storage[len("file://"):] if storage.startswith("file://") else storage)
    return Path(config.invocation_params.dir, folder) / "references"


def _record_reference(request, path: Path, model_dir: Path, memory_plan, prompt_ids, tokens: int,
                      folder: Path) -> None:
    """The greedy oracle's ids and margins for every test prompt, ``tokens`` steps, into ``path``: mlx-lm's
    in-memory model where it fits, else mlx-lm's model computed layer by layer (one layer's weights in memory)."""
    from . import reference

    if memory_plan.fits:
        live = GreedyOracle(request.getfixturevalue("reference_model"), prompt_ids, folder, tokens)
        runs = [{"ids": live.ids(p, tokens), "margins": [list(m) for m in live.margins(p, tokens)]}
                for p in range(len(prompt_ids))]
        kind = "mlx-lm in memory"
    else:
        from . import layerwise_oracle

        runs = []
        for ids in prompt_ids:
            got, margins = layerwise_oracle.greedy(model_dir, ids, tokens)
            runs.append({"ids": got, "margins": [list(m) for m in margins]})
        kind = "mlx-lm layer by layer"
    reference.write(path, model_dir, kind, TEST_PROMPTS, runs)


EXACTNESS_KEY = "exactness"


def pytest_terminal_summary(terminalreporter):
    """The exactness table: every speculative-vs-greedy run the tests recorded (with ``record_property``
    under ``EXACTNESS_KEY``), how many were exact, and every divergence with its greedy top-2 gap. Reports
    carry the rows, so this works under pytest-xdist too."""
    if not _acting(terminalreporter.config):
        return
    rows = _properties(terminalreporter, EXACTNESS_KEY)
    _report_perf_gate(terminalreporter)
    oracles = sorted(set(_properties(terminalreporter, ORACLE_KEY)))
    if oracles:
        terminalreporter.section("mlx-streaming oracle")
        terminalreporter.write_line("greedy oracle: " + "; ".join(oracles))
    if not rows:
        return
    from tabulate import tabulate

    exact = sum(r["divergence"] is None for r in rows)
    terminalreporter.section("mlx-streaming exactness")
    terminalreporter.write_line(f"{len(rows)} speculative runs, {exact} token-for-token equal to greedy")
    diverged = [r for r in rows if r["divergence"] is not None]
    if diverged:
        table = [[r["prompt"], r["K"], r["commit_mode"], r["pool"], d["step"], d["top1"], d["top2"], f"{d['gap']:.5f}",
                  "near-tie" if d["near_tie"] else "BUG"] for r in diverged for d in [r["divergence"]]]
        terminalreporter.write_line(tabulate(table, headers=["prompt", "K", "mode", "pool", "step", "top-1", "top-2", "gap", "verdict"]))


def _properties(terminalreporter, name: str) -> list:
    """Every value the session's tests recorded under ``name`` in their reports' ``user_properties`` (the reports
    carry them, so this works under pytest-xdist too)."""
    return [value for reports in terminalreporter.stats.values() for report in reports
            if getattr(report, "when", None) == "call"
            for key, value in getattr(report, "user_properties", ()) if key == name]


def _report_perf_gate(terminalreporter) -> None:
    gate = getattr(terminalreporter.config, "_mlx_perf_gate", None)
    if gate is None:
        return
    from .perf_gate import report

    rows, recorded, mode, yardstick = gate
    terminalreporter.section("mlx-streaming perf gate")
    terminalreporter.write_line(f"mode: {mode}")
    terminalreporter.write_line(f"baseline: {recorded}")
    terminalreporter.write_line(f"yardstick: {yardstick}")
    failed = any(row.fail for row in rows)
    terminalreporter.write_line(report(rows), red=failed)
    terminalreporter.write_line("PERF GATE FAILED" if failed else "perf gate passed", red=failed, green=not failed)
