import pytest

from mlx_streaming.cli.environment import settings
from mlx_streaming.config import StreamingConfig, parse_size
from mlx_streaming.run_settings import MAX_K, RunSettings
from mlx_streaming.errors import ConfigError


def test_unknown_io_mode_names_the_option():
    with pytest.raises(ConfigError, match="io_mode"):
        StreamingConfig(io_mode="mmap")


def test_two_pool_sizing_knobs_are_refused():
    with pytest.raises(ConfigError, match="pool_slots=8, pool_bytes=1048576"):
        StreamingConfig(pool_slots=8, pool_bytes=1 << 20)


def _from_env(environ, **overrides):
    """(engine config, run settings, the lines said)."""
    said = []
    return (*settings(environ, say=said.append, **overrides), said)


def test_namespaced_environment_names_map_onto_the_settings_and_are_announced():
    cfg, run, said = _from_env({"MLX_STREAMING_MAX_TOKENS": "17", "MLX_STREAMING_PROMPT": "hi",
                                "MLX_STREAMING_MEMORY_BUDGET": "2G", "MLX_STREAMING_IO_MODE": "direct",
                                "MLX_STREAMING_K": "3", "STG_VERIFY": "1"})
    assert (run.max_tokens, run.prompt, run.k) == (17, "hi", 3)
    assert (cfg.memory_budget, cfg.io_mode, cfg.verify, cfg.calibration_prompt) == (2 << 30, "direct", True, "hi")
    assert "mlx-streaming: MLX_STREAMING_K=3 from the environment" in said and len(said) == 6


def test_bare_environment_names_are_not_read():
    """A K or PROMPT left in a shell changes nothing, and is not mentioned."""
    cfg, run, said = _from_env({"K": "7", "MAXTOK": "17", "PROMPT": "hi", "IO_MODE": "direct", "PRELOAD": "1",
                                "POOL_SLOTS": "8", "REPEAT": "9"})
    assert cfg == StreamingConfig() and run == RunSettings() and said == []


def test_explicit_values_win_over_the_environment_and_say_so():
    _, run, said = _from_env({"MLX_STREAMING_MAX_TOKENS": "17"}, max_tokens=5)
    assert run.max_tokens == 5 and said == ["mlx-streaming: MLX_STREAMING_MAX_TOKENS=17 in the environment is "
                                            "overridden by the command line"]


def test_an_unknown_namespaced_name_is_named_as_ignored():
    _, run, said = _from_env({"MLX_STREAMING_MAXTOK": "17", "MLX_STREAMING_NATIVE": "0"})
    assert run.max_tokens == RunSettings().max_tokens
    assert len(said) == 1 and said[0].startswith("mlx-streaming: MLX_STREAMING_MAXTOK in the environment is not a "
                                                 "setting, ignored")


def test_a_callers_defaults_sit_under_the_environment_and_a_pool_default_under_any_pool_size():
    defaults = {"pool_fraction": 0.25, "io_mode": "direct"}
    assert _from_env({}, defaults=defaults)[0].pool_fraction == 0.25
    cfg, _, _ = _from_env({"MLX_STREAMING_POOL_SLOTS": "8", "MLX_STREAMING_IO_MODE": "buffered"}, defaults=defaults)
    assert (cfg.pool_slots, cfg.pool_fraction, cfg.io_mode) == (8, None, "buffered")
    assert _from_env({}, defaults=defaults, pool_bytes=1 << 20)[0].pool_fraction is None


def test_bad_environment_value_names_the_variable():
    with pytest.raises(ConfigError, match="MLX_STREAMING_MAX_TOKENS"):
        _from_env({"MLX_STREAMING_MAX_TOKENS": "many"})


def test_k_is_bounded():
    assert RunSettings(k=MAX_K).k == MAX_K
    for k in (0, MAX_K + 1, 1000):
        with pytest.raises(ConfigError, match=f"k must be auto or 1 to {MAX_K}"):
            RunSettings(k=k)


def test_the_engine_config_holds_no_run_setting():
    """The engine's knobs and the runner's settings are two objects with no field in common."""
    import dataclasses

    engine = {f.name for f in dataclasses.fields(StreamingConfig)}
    assert not engine & {f.name for f in dataclasses.fields(RunSettings)}
    with pytest.raises(TypeError):
        StreamingConfig(max_tokens=5)


@pytest.mark.parametrize("text,value", [("512M", 512 << 20), ("1.5G", 3 << 29), ("2GiB", 2 << 30), ("4096", 4096)])
def test_parse_size(text, value):
    assert parse_size(text) == value
