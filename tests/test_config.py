import pytest

from mlx_streaming.config import MAX_K, StreamingConfig, parse_size
from mlx_streaming.errors import ConfigError


def test_unknown_io_mode_names_the_option():
    with pytest.raises(ConfigError, match="io_mode"):
        StreamingConfig(io_mode="mmap")


def test_two_pool_sizing_knobs_are_refused():
    with pytest.raises(ConfigError, match="pool_slots=8, pool_bytes=1048576"):
        StreamingConfig(pool_slots=8, pool_bytes=1 << 20)


def _from_env(environ, **overrides):
    said = []
    return StreamingConfig.from_env(environ, say=said.append, **overrides), said


def test_namespaced_environment_names_map_onto_the_config_and_are_announced():
    cfg, said = _from_env({"MLX_STREAMING_MAX_TOKENS": "17", "MLX_STREAMING_PROMPT": "hi",
                           "MLX_STREAMING_MEMORY_BUDGET": "2G", "MLX_STREAMING_IO_MODE": "direct",
                           "MLX_STREAMING_K": "3", "STG_VERIFY": "1"})
    assert (cfg.max_tokens, cfg.prompt, cfg.memory_budget, cfg.io_mode, cfg.k, cfg.verify) == (17, "hi", 2 << 30,
                                                                                               "direct", 3, True)
    assert "mlx-streaming: MLX_STREAMING_K=3 from the environment" in said and len(said) == 6


def test_bare_environment_names_are_not_read():
    """A K or PROMPT left in a shell changes nothing, and is not mentioned."""
    cfg, said = _from_env({"K": "7", "MAXTOK": "17", "PROMPT": "hi", "IO_MODE": "direct", "PRELOAD": "1",
                           "POOL_SLOTS": "8", "REPEAT": "9"})
    assert cfg == StreamingConfig() and said == []


def test_explicit_values_win_over_the_environment_and_say_so():
    cfg, said = _from_env({"MLX_STREAMING_MAX_TOKENS": "17"}, max_tokens=5)
    assert cfg.max_tokens == 5 and said == ["mlx-streaming: MLX_STREAMING_MAX_TOKENS=17 in the environment is "
                                            "overridden by the command line"]


def test_an_unknown_namespaced_name_is_named_as_ignored():
    cfg, said = _from_env({"MLX_STREAMING_MAXTOK": "17", "MLX_STREAMING_NATIVE": "0"})
    assert cfg.max_tokens == StreamingConfig().max_tokens
    assert len(said) == 1 and said[0].startswith("mlx-streaming: MLX_STREAMING_MAXTOK in the environment is not a "
                                                 "setting, ignored")


def test_a_callers_defaults_sit_under_the_environment_and_a_pool_default_under_any_pool_size():
    defaults = {"pool_fraction": 0.25, "io_mode": "direct"}
    assert _from_env({}, defaults=defaults)[0].pool_fraction == 0.25
    cfg, _ = _from_env({"MLX_STREAMING_POOL_SLOTS": "8", "MLX_STREAMING_IO_MODE": "buffered"}, defaults=defaults)
    assert (cfg.pool_slots, cfg.pool_fraction, cfg.io_mode) == (8, None, "buffered")
    assert _from_env({}, defaults=defaults, pool_bytes=1 << 20)[0].pool_fraction is None


def test_bad_environment_value_names_the_variable():
    with pytest.raises(ConfigError, match="MLX_STREAMING_MAX_TOKENS"):
        _from_env({"MLX_STREAMING_MAX_TOKENS": "many"})


def test_k_is_bounded():
    assert StreamingConfig(k=MAX_K).k == MAX_K
    for k in (0, MAX_K + 1, 1000):
        with pytest.raises(ConfigError, match=f"k must be auto or 1 to {MAX_K}"):
            StreamingConfig(k=k)


@pytest.mark.parametrize("text,value", [("512M", 512 << 20), ("1.5G", 3 << 29), ("2GiB", 2 << 30), ("4096", 4096)])
def test_parse_size(text, value):
    assert parse_size(text) == value
