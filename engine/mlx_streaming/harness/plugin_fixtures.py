"""The mlx-streaming pytest plugin's session fixtures: each model built once per session (once per worker under
pytest-xdist), the memory plan that decides whether mlx-lm's in-memory model fits, the greedy oracle (live,
recorded or layer by layer), the perf gate's yardstick and its side-by-side base engine. Registered by
``pytest_plugin`` (its ``pytest_plugins``), so they act only where it does."""

from __future__ import annotations

from pathlib import Path

import pytest

from .oracle import ORACLE_TOKENS, GreedyOracle, file_lock
from .pytest_plugin import ORACLE_KEY, TEST_PROMPTS, UNLOADABLE_EXACT_TOKENS, _acting, _side_by_side_base
from ..checkpoint import MTP_FILE


@pytest.fixture(scope="session")
def model_dir(request) -> Path:
    from ..defaults import default_model

    chosen = request.config.getoption("--streaming-model")
    return Path(chosen) if chosen else default_model()


@pytest.fixture(scope="session")
def mtp_path(request, model_dir) -> Path:
    chosen = request.config.getoption("--streaming-mtp")
    return Path(chosen) if chosen else model_dir / MTP_FILE


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
    fits. Where it does not, the models the suite holds at once share the memory budget this process may take
    (or each takes the pool ``--streaming-pool-slots`` pins), and byte-truth verification is on: then the oracle is a recorded reference, and verification shows the
    streamed bytes are the checkpoint's."""
    from ..config import StreamingConfig
    from ..plan import AUTO_BUDGET_SHARE

    slots = request.config.getoption("--streaming-pool-slots")
    io_mode = request.config.getoption("--streaming-io-mode")
    if memory_plan.fits:
        return StreamingConfig(pool_slots=slots, io_mode=io_mode)
    if slots:  # a pool pinned instead of the budget's (a perf baseline's, whose counters compare at its pool)
        return StreamingConfig(pool_slots=slots, io_mode=io_mode, verify=True)
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
