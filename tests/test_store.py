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
from mlx_streaming.residency import loader
from mlx_streaming.residency import pool as pool_module
from mlx_streaming.residency.pool import WRITES


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


def test_every_way_of_writing_a_load_leaves_the_same_pool(model_dir, prompt_ids):
    """Host writes (through a view of the pool's memory: this CPU's default), staged writes (through a view of
    staging rows, each copied into its slot), the GPU's scatters (one per expert tensor for a load's experts) and
    slot writes (one per tensor per expert) leave the same pool and decode the same ids; each is forced here on this
    backend. Host, staged and slot writes write each placed expert's tensors one by one; the scatters each tensor
    once per load. The staging rows are taken again many times over (more tensors are placed than a staging array
    has rows), each only once the copies from it have run: the byte verifier reads every placed slot back."""
    pools, ids, stats = {}, {}, {}
    for writes in WRITES:
        with build_streaming_model(model_dir, StreamingConfig(pool_slots=12, verify=True)) as sm:
            assert sm.store.pool.writes == "host"  # the CPU backend computes in host memory
            sm.store.pool.use_writes(writes)
            ids[writes] = greedy_generate(sm.model, prompt_ids[1], 12)
            stats[writes] = sm.store.stats()
            assert stats[writes]["verify_calls"] > 0  # each placed expert's slot read back against its bytes
            tensors = len(sm.store.index.tensor_specs)
            layer = sm.store.index.layers[0]
            pools[writes] = (sm.store.pool.slots[layer].copy(),
                             {name: np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a)
                              for name, a in sm.store.pool.arrays[layer].items()})
    assert ids["host"] == ids["staged"] == ids["scatter"] == ids["slots"]
    for writes in ("host", "staged", "slots"):
        assert stats[writes]["pool_writes"] == tensors * stats[writes]["misses"]
    # at least one load per MoE layer call that missed, and fewer writes than one per tensor per expert
    assert tensors * stats["scatter"]["fallback"] <= stats["scatter"]["pool_writes"] < stats["slots"]["pool_writes"]
    for writes in ("staged", "scatter", "slots"):
        assert (pools["host"][0] == pools[writes][0]).all()
        assert all((pools["host"][1][n] == pools[writes][1][n]).all() for n in pools["host"][1])


@pytest.mark.parametrize("writes", ["host", "staged"])
def test_a_loads_reads_land_in_the_pool_or_its_staging_rows_with_no_copy_after(model_dir, prompt_ids, writes):
    """Where the pool can take a tensor's bytes in place (host writes: the slot's own memory; staged: a staging row)
    the reader's threads put them there: the loader copies nothing of a demand load, each placed expert still
    matches its bytes, and the ids are greedy's."""
    with build_streaming_model(model_dir, StreamingConfig(pool_slots=12, verify=True)) as sm:
        reference = greedy_generate(sm.model, prompt_ids[1], 12)
    with build_streaming_model(model_dir, StreamingConfig(pool_slots=12, verify=True)) as sm:
        pool = sm.store.pool
        pool.use_writes(writes)
        copies, write_tensor = [], pool.write_tensor
        pool.write_tensor = lambda *args: copies.append(args) or write_tensor(*args)
        assert greedy_generate(sm.model, prompt_ids[1], 12) == reference
        stats = sm.store.stats()
    assert stats["misses"] > 0 and stats["verify_ok"] == stats["misses"] and stats["verify_bad"] == 0
    assert copies == []  # every tensor read in place: none handed to the pool to copy


def test_prefetched_experts_and_a_loads_reads_never_share_a_staging_row(model_dir, prompt_ids, monkeypatch):
    """A load places the prefetcher's experts (copied into staging rows at once) before its own reads claim rows
    to land in; with a few rows the ring comes round within loads, and no row is written twice before its copy
    has run: every placed expert matches its bytes and the ids are greedy's."""
    with build_streaming_model(model_dir, StreamingConfig(pool_slots=16)) as sm:
        reference = greedy_generate(sm.model, prompt_ids[1], 24)
    monkeypatch.setattr(pool_module, "STAGING_ROWS", 4)
    config = StreamingConfig(pool_slots=16, verify=True, prefetch=True, prefetch_ahead=0, prefetch_mult=2)
    with build_streaming_model(model_dir, config) as sm:
        sm.store.pool.use_writes("staged")
        assert greedy_generate(sm.model, prompt_ids[1], 24) == reference
        stats = sm.store.stats()
    assert stats["prefetched"] > 0 and stats["misses"] > stats["prefetched"]  # loads of both kinds
    assert stats["verify_ok"] == stats["misses"] and stats["verify_bad"] == 0


class _Reported:
    """A started batch whose reads have all run, reporting ``arrived`` of them finished whenever asked (as a batch
    still being read would), and recording each wait's ``upto``."""

    def __init__(self, pending, arrived: int, waits: list):
        self.pending, self.arrived, self.waits = pending, arrived, waits
        self.elapsed, self.in_place = pending.elapsed, pending.in_place

    def finished(self):
        return self.arrived

    def wait(self, upto):
        self.waits.append(upto)
        return self.pending.wait(upto)


@pytest.mark.parametrize("writes,batch,arrived,waits", [
    ("host", "tensor", "none", "each tensor"),  # nothing arrived when asked: each tensor once its bytes are in
    ("host", "expert", "none", "each expert"),  # at least an expert's bytes per batch
    ("host", "tensor", "all", "once"),  # everything had arrived: one batch
    ("host", None, "none", "once"),  # the tiny model's experts are far below the batch bytes: one batch
    ("slots", "tensor", "none", "each tensor"),
    ("staged", "tensor", "none", "each tensor"),
    ("scatter", "tensor", "none", "once"),  # one scatter per tensor for the whole load: every byte first
])
def test_a_load_writes_the_tensors_that_have_arrived_while_the_rest_are_read(model_dir, monkeypatch, writes, batch,
                                                                             arrived, waits):
    with build_streaming_model(model_dir, StreamingConfig(pool_slots=8, verify=True)) as sm:
        store, layer = sm.store, sm.store.index.layers[0]
        store.pool.use_writes(writes)
        per_expert, expert_bytes = len(store.index.slices(layer, 0)), store.index.expert_bytes
        if batch is not None:  # batches of at least one tensor's or one expert's bytes
            monkeypatch.setattr(loader, "PLACE_BATCH_BYTES", 1 if batch == "tensor" else expert_bytes)
        seen = []
        real_start = store.reader._read_start

        def start(requests):
            pending = real_start(requests)
            assert pending.wait(len(requests)) is None
            return _Reported(pending, len(requests) if arrived == "all" else 0, seen)

        store.reader._read_start = start
        store.acquire(layer, [0, 1, 2, 3])
        stats = store.stats()
        tensors = 4 * per_expert
        assert seen == {"each tensor": list(range(1, tensors + 1)), "each expert": list(range(per_expert, tensors + 1, per_expert)),
                        "once": [tensors]}[waits]
        assert stats["misses"] == stats["verify_ok"] == 4 and stats["verify_bad"] == 0  # each slot holds its bytes
        assert all(store.pool.book.slot(layer, e) is not None for e in range(4))


def test_host_writes_reach_the_arrays_the_model_computes_with(model_dir):
    """A host write lands in the pool array at once (no array operation), the bytes MLX then reads; a backend
    whose views do not reach the arrays is refused host writes."""
    with build_streaming_model(model_dir, StreamingConfig(pool_slots=8)) as sm:
        pool, layer = sm.store.pool, sm.store.index.layers[0]
        name, array = next(iter(pool.arrays[layer].items()))
        row = np.arange(pool.host_views[layer][name].shape[1], dtype=np.uint8)
        pool.host_views[layer][name][3] = row
        seen = array[3].view(mx.uint16) if array.dtype == mx.bfloat16 else array[3]
        assert np.array_equal(np.array(seen).reshape(-1).view(np.uint8), row)
        pool.host_views = {}
        with pytest.raises(ValueError, match="host memory"):
            pool.use_writes("host")
