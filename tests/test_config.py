import pytest

from mlx_streaming.config import StreamingConfig, parse_size
from mlx_streaming.errors import ConfigError


def test_unknown_io_mode_names_the_option():
    with pytest.raises(ConfigError, match="io_mode"):
        StreamingConfig(io_mode="mmap")


def test_two_pool_sizing_knobs_are_refused():
    with pytest.raises(ConfigError, match="pool_slots=8, pool_bytes=1048576"):
        StreamingConfig(pool_slots=8, pool_bytes=1 << 20)


def test_seed_environment_names_map_onto_the_config():
    cfg = StreamingConfig.from_env({"MAXTOK": "17", "PROMPT": "hi", "MEMORY_BUDGET": "2G", "IO_MODE": "direct"})
    assert (cfg.max_tokens, cfg.prompt, cfg.memory_budget, cfg.io_mode) == (17, "hi", 2 << 30, "direct")


def test_explicit_values_win_over_the_environment():
    assert StreamingConfig.from_env({"MAXTOK": "17"}, max_tokens=5).max_tokens == 5


def test_bad_environment_value_names_the_variable():
    with pytest.raises(ConfigError, match="MAXTOK"):
        StreamingConfig.from_env({"MAXTOK": "many"})


@pytest.mark.parametrize("text,value", [("512M", 512 << 20), ("1.5G", 3 << 29), ("2GiB", 2 << 30), ("4096", 4096)])
def test_parse_size(text, value):
    assert parse_size(text) == value
