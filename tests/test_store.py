"""Expert index, reader and store on the tiny checkpoint."""

import errno

import mlx.core as mx
import numpy as np
import pytest

from mlx_streaming.config import StreamingConfig
from mlx_streaming.errors import PoolTooSmallError
from mlx_streaming.decode.greedy import greedy_generate
from mlx_streaming.io.reader import ExpertReader
from mlx_streaming.model import build_streaming_model


def test_index_ranges_hold_exactly_each_experts_bytes(streaming_model, model_dir):
    index = streaming_model.store.index
    layer, expert = index.layers[-1], index.num_experts - 1
    slices = index.slices(layer, expert)
    assert [s.tensor for s in slices] == [f"{p}.{q}" for p in ("gate_proj", "up_proj", "down_proj")
                                          for q in ("weight", "scales", "biases")]
    shard_arrays = {}
    reader = ExpertReader("buffered")
    for s, buf in zip(slices, reader.read([(s.path, s.offset, s.nbytes) for s in slices])):
        arrays = shard_arrays.setdefault(s.path, mx.load(str(s.path)))
        whole = arrays[f"model.layers.{layer}.mlp.switch_mlp.{s.tensor}"][expert]
        expected = np.array(whole.view(mx.uint16) if whole.dtype == mx.bfloat16 else whole).tobytes()
        assert buf.tobytes() == expected, s.tensor
    reader.close()
    assert index.expert_bytes == sum(s.nbytes for s in slices)


def test_direct_and_buffered_reads_give_the_same_bytes(streaming_model):
    index = streaming_model.store.index
    ranges = [(s.path, s.offset, s.nbytes) for e in (0, 5, 17) for s in index.slices(index.layers[0], e)]
    buffered, direct = ExpertReader("buffered"), ExpertReader("direct")
    try:
        assert [b.tobytes() for b in buffered.read(ranges)] == [b.tobytes() for b in direct.read(ranges)]
        assert set(direct.effective_modes.values()) == {"direct"}
    finally:
        buffered.close()
        direct.close()


def test_direct_mode_on_a_filesystem_without_o_direct_falls_back_with_a_warning(streaming_model):
    """The kernel's answer for such a filesystem (EINVAL from open) is simulated: this machine's
    filesystems, tmpfs included, all accept O_DIRECT."""

    class RefusingReader(ExpertReader):
        @staticmethod
        def _open_direct(path):
            raise OSError(errno.EINVAL, "Invalid argument", path)

    s = streaming_model.store.index.slices(0, 0)[0]
    reader, plain = RefusingReader("direct"), ExpertReader("buffered")
    try:
        with pytest.warns(UserWarning, match="refuses cache-bypass reads"):
            (buf,) = reader.read([(s.path, s.offset, s.nbytes)])
        assert reader.effective_modes[str(s.path)] == "buffered"
        assert buf.tobytes() == plain.read([(s.path, s.offset, s.nbytes)])[0].tobytes()
    finally:
        reader.close()
        plain.close()


def test_counters_add_up_and_reset(model_dir, prompt_ids):
    with build_streaming_model(model_dir, StreamingConfig(pool_slots=6)) as sm:
        store = sm.store
        greedy_generate(sm.model, prompt_ids[0], 8)
        stats = store.stats()
        assert stats["misses"] > 0 and stats["evictions"] > 0
        assert stats["bytes_read"] == stats["misses"] * store.index.expert_bytes
        assert stats["fastpath"] + stats["fallback"] > 0
        sm.reset_stats()
        assert all(v == 0 for v in store.stats().values())


def test_pinned_experts_stay_resident_and_overpinning_is_an_error(model_dir, prompt_ids):
    with build_streaming_model(model_dir, StreamingConfig(pool_slots=8, record=True)) as sm:
        store = sm.store
        top_k = store.top_k
        greedy_generate(sm.model, prompt_ids[1], 8)
        layer = store.routed.layers()[0]
        hot = store.routed.hot(layer, 8 - top_k)
        counts = store.routed.of(layer)
        assert [counts[e] for e in hot] == sorted((counts[e] for e in hot), reverse=True)
        store.pin(layer, hot)
        greedy_generate(sm.model, prompt_ids[2], 16)
        assert store.pool.book.pinned(layer) == set(hot)
        assert all(store.pool.book.slot(layer, e) is not None for e in hot)
        with pytest.raises(PoolTooSmallError, match="pinning"):
            store.pin(layer, [e for e in range(store.index.num_experts) if e not in hot][:1])


def test_pool_sized_by_bytes_and_by_memory_budget(model_dir):
    with build_streaming_model(model_dir, StreamingConfig(pool_slots=4)) as sm:
        per_slot = sm.store.index.expert_bytes * len(sm.store.index.layers)
        dense = sm.plan.dense_bytes
    with build_streaming_model(model_dir, StreamingConfig(pool_bytes=10 * per_slot)) as sm:
        assert sm.store.capacity == 10
    budget = dense + (1 << 20) + 12 * per_slot
    with build_streaming_model(model_dir, StreamingConfig(memory_budget=budget, memory_allowance=1 << 20)) as sm:
        assert sm.store.capacity == 12


def test_pin_hot_pins_the_calibration_runs_hottest_experts(model_dir):
    config = StreamingConfig(pool_slots=8, pin_hot=2, pin_cal_tokens=8)
    with build_streaming_model(model_dir, config) as sm:
        store = sm.store
        for layer in store.index.layers:
            assert len(store.pool.book.pinned(layer)) == 2
            assert set(store.routed.hot(layer, 2)) == store.pool.book.pinned(layer)
        assert all(v == 0 for v in store.stats().values())


def test_batched_placement_writes_the_bytes_slot_writes_write(model_dir, prompt_ids):
    """The GPU backend's placement (one scatter per expert tensor for a load's experts) and the CPU backend's (a
    write per slot) leave the same pool and decode the same ids; each is forced here on this backend. The slot
    writes write each placed expert's tensors one by one; the scatters each tensor once per load."""
    pools, ids, stats = {}, {}, {}
    for batched in (False, True):
        with build_streaming_model(model_dir, StreamingConfig(pool_slots=12, verify=True)) as sm:
            sm.store.pool.batched = batched
            ids[batched] = greedy_generate(sm.model, prompt_ids[1], 12)
            stats[batched] = sm.store.stats()
            assert stats[batched]["verify_calls"] > 0  # each placed expert's slot read back against its bytes
            tensors = len(sm.store.index.tensor_specs)
            layer = sm.store.index.layers[0]
            pools[batched] = (sm.store.pool.slots[layer].copy(),
                              {name: np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a)
                               for name, a in sm.store.pool.arrays[layer].items()})
    assert ids[False] == ids[True]
    assert stats[False]["pool_writes"] == tensors * stats[False]["misses"]
    # at least one load per MoE layer call that missed, and fewer writes than one per tensor per expert
    assert tensors * stats[True]["fallback"] <= stats[True]["pool_writes"] < stats[False]["pool_writes"]
    assert (pools[False][0] == pools[True][0]).all()
    assert all((pools[False][1][n] == pools[True][1][n]).all() for n in pools[False][1])
