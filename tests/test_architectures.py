"""Every MoE architecture mlx-lm builds from switch_layers streams exactly, against mlx-lm's own in-memory model.

Each architecture's tiny checkpoint is written once per session (per worker) by ``synth --arch``, through
mlx-lm's own model classes, quantizer and save code. With every expert resident the logits are bit-identical
at every greedy step; at the minimum pool (the experts one token routes to: the prompt's prefill runs in groups)
and at a 25% pool, in both io modes, with prefetch on and off, the greedy ids are equal.
"""

import json

import mlx.core as mx
import pytest
from mlx_lm.utils import load_model

from mlx_streaming.runtime.sites import experts_per_token
from mlx_streaming.harness.arch_synth import TINY_ARCHS, synth_arch
from mlx_streaming.config import StreamingConfig
from mlx_streaming.errors import UnsupportedModelError
from mlx_streaming.decode.greedy import greedy_generate, greedy_steps
from mlx_streaming.model import build_streaming_model

pytestmark = pytest.mark.exact

ARCHS = sorted(TINY_ARCHS)
PROMPT = list(b"def add(a, b):\n    return")
TOKENS = 8


@pytest.fixture(scope="session")
def arch_checkpoints(tmp_path_factory):
    """``get(arch)``: the tiny checkpoint of ``arch``, written on first use, and its in-memory greedy ids."""
    root, made = tmp_path_factory.mktemp("archs"), {}

    def get(arch):
        if arch not in made:
            path = synth_arch(root / arch, arch)
            reference, _ = load_model(path)
            made[arch] = (path, reference, greedy_generate(reference, PROMPT, TOKENS))
        return made[arch]

    return get


@pytest.mark.parametrize("arch", ARCHS)
def test_every_expert_resident_gives_bit_identical_logits(arch, arch_checkpoints):
    path, reference, _ = arch_checkpoints(arch)
    with build_streaming_model(path, StreamingConfig()) as sm:
        assert sm.store.capacity == sm.store.index.num_experts == 16
        steps = zip(greedy_steps(sm.model, PROMPT, TOKENS), greedy_steps(reference, PROMPT, TOKENS))
        for step, ((token, logits), (ref_token, ref_logits)) in enumerate(steps):
            assert token == ref_token and mx.array_equal(logits, ref_logits).item(), f"{arch} step {step}"
        assert sm.store.stats()["evictions"] == 0


@pytest.mark.parametrize("prefetch", [False, True], ids=["lru", "prefetch"])
@pytest.mark.parametrize("io_mode", ["buffered", "direct"])
@pytest.mark.parametrize("pool", ["minimum", "25%"])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_ids_equal_at_small_pools(arch, pool, io_mode, prefetch, arch_checkpoints):
    path, _, expected = arch_checkpoints(arch)
    top_k = experts_per_token(json.loads((path / "config.json").read_text()))
    config = StreamingConfig(io_mode=io_mode, prefetch=prefetch, verify=True)
    config = config.with_pool(pool_fraction=0.25) if pool == "25%" else config.with_pool(pool_slots=top_k)
    with build_streaming_model(path, config) as sm:
        assert sm.store.capacity == (4 if pool == "25%" else top_k)
        ids = greedy_generate(sm.model, PROMPT, TOKENS)
        stats = sm.store.stats()
    assert ids == expected
    assert stats["misses"] > 0 and stats["verify_calls"] == stats["misses"] and stats["verify_bad"] == 0
    if pool == "minimum":  # the prompt's prefill routes past top_k experts: its layers run in groups
        assert stats["grouped"] > 0
    if prefetch:
        assert stats["prefetch_submitted"] > 0


def test_a_dense_model_is_refused_by_model_type(tmp_path):
    from mlx_lm.models import llama
    from mlx.utils import tree_flatten

    config = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
              "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "vocab_size": 256}
    model = llama.Model(llama.ModelArgs.from_dict(config))
    mx.save_safetensors(str(tmp_path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="model_type 'llama' has no routed experts to stream"):
        build_streaming_model(tmp_path)


def test_a_model_type_mlx_lm_does_not_know_is_refused_in_one_line(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "not_a_model"}))
    (tmp_path / "model.safetensors").write_bytes(b"\x02\x00\x00\x00\x00\x00\x00\x00{}")
    with pytest.raises(UnsupportedModelError, match="model_type 'not_a_model' cannot be built by mlx-lm"):
        build_streaming_model(tmp_path)
