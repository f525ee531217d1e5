"""The mlx-streaming pytest plugin: options, markers, the perf gate's hooks and the session's reports; its
session fixtures are in ``plugin_fixtures``.

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

from .oracle import ORACLE_TOKENS

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
#: ``user_properties`` keys: which oracle a test used; a speculative run's exactness row.
ORACLE_KEY = "oracle"
EXACTNESS_KEY = "exactness"
#: The session fixtures (models, oracle, perf base), registered with this plugin.
pytest_plugins = ("mlx_streaming.harness.plugin_fixtures",)


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
    from . import perf_gate, perf_rounds

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
    yardsticks = sorted({info.get("yardstick", perf_rounds.OWN_YARDSTICK) for info in current.values()})
    config._mlx_perf_gate = (rows, recorded, mode, "; ".join(yardsticks))
    if any(row.fail for row in rows):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


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
