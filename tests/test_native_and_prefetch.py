"""The native extension against its pure-Python twins, the background prefetcher and the expert predictor."""

import errno
import os
import subprocess
import sys
import threading
import time
import zlib

import numpy as np
import pytest

from mlx_streaming.config import StreamingConfig
from mlx_streaming.errors import ConfigError, ExpertIOError
from mlx_streaming.decode.greedy import greedy_generate
from mlx_streaming.io import native
from mlx_streaming.io.reader import ExpertReader
from mlx_streaming.model import build_streaming_model
from mlx_streaming.residency.stats import ResidencyStats
from mlx_streaming.prefetch.prefetcher import Prefetcher

TWIN_FORCED = os.environ.get("MLX_STREAMING_NATIVE") == "0"


def test_the_extension_was_built():
    """The install compiles it; only MLX_STREAMING_NATIVE=0 may leave the twins in charge."""
    assert native.NATIVE or TWIN_FORCED


def _ranges(model_dir):
    """Unaligned byte ranges of real expert tensors, a few per shard."""
    with build_streaming_model(model_dir, StreamingConfig(pool_slots=4)) as sm:
        index = sm.store.index
        return [(str(s.path), s.offset, s.nbytes) for layer in index.layers[:3] for e in (0, 7)
                for s in index.slices(layer, e)]


@pytest.mark.parametrize("aligned", [False, True])
def test_native_and_twin_read_the_disks_bytes(model_dir, aligned):
    ranges = _ranges(model_dir)
    assert any(offset % native.ALIGN for _, offset, _ in ranges)  # the aligned path has work to do
    fds = {path: (native.open_uncached(path) if aligned else os.open(path, os.O_RDONLY)) for path, _, _ in ranges}
    try:
        results = []
        for read_start in (native._native.read_start, native.py_read_start) if native.NATIVE else (native.py_read_start,):
            buffers = [np.empty(n, dtype=np.uint8) for _, _, n in ranges]
            pending = read_start([(fds[p], o, n, b, aligned) for (p, o, n), b in zip(ranges, buffers)], 4)
            assert pending.wait(len(ranges)) is None
            assert pending.finished() == len(ranges) and pending.elapsed > 0
            results.append(buffers)
        for (path, offset, n), *copies in zip(ranges, *results):
            with open(path, "rb") as f:
                f.seek(offset)
                truth = f.read(n)
            assert all(c.tobytes() == truth for c in copies)
    finally:
        for fd in fds.values():
            os.close(fd)


@pytest.mark.parametrize("aligned", [False, True])
@pytest.mark.parametrize("impl", ["native", "twin"])
def test_one_read_lands_in_several_buffers_in_order(tmp_path, impl, aligned):
    """A read's destination can be a list of buffers (the pool slots a merged read fills): its bytes fill them in
    order; a short read fills them as far as the file goes; a list that does not sum to the read is refused."""
    if impl == "native" and not native.NATIVE:
        assert TWIN_FORCED
        return
    read_start = native._native.read_start if impl == "native" else native.py_read_start
    data = np.random.default_rng(1).integers(0, 256, 3 * native.ALIGN + 123, dtype=np.uint8)
    path = tmp_path / "f"
    path.write_bytes(data.tobytes())
    try:
        fd = native.open_uncached(str(path)) if aligned else os.open(path, os.O_RDONLY)
    except OSError as exc:  # tmpfs, for one, refuses O_DIRECT
        pytest.skip(f"{tmp_path}'s filesystem refuses cache-bypass reads ({exc.strerror})")
    try:
        pieces = [np.zeros(n, np.uint8) for n in (1000, 5000, 3)]
        assert read_start([(fd, 77, 6003, pieces, aligned)], 2).wait(1) is None
        assert np.concatenate(pieces).tobytes() == data[77:77 + 6003].tobytes()
        tail = [np.zeros(n, np.uint8) for n in (100, 400)]  # 123 + 4096 * 3 bytes: 300 of 500 are there
        assert read_start([(fd, data.size - 300, 500, tail, aligned)], 1).wait(1) == (0, 0, 300)
        assert np.concatenate(tail)[:300].tobytes() == data[-300:].tobytes()
        with pytest.raises(ValueError):
            read_start([(fd, 0, 100, [np.zeros(60, np.uint8), np.zeros(60, np.uint8)], aligned)], 1)
    finally:
        os.close(fd)


def _page_aligned(n: int, shift: int = 0) -> np.ndarray:
    """``n`` zero bytes starting ``shift`` bytes past a 4096-byte boundary."""
    raw = np.zeros(n + shift + native.ALIGN, np.uint8)
    start = -raw.ctypes.data % native.ALIGN + shift
    return raw[start:start + n]


def _uncached_file(tmp_path, pages: int, seed: int):
    """(its bytes, a descriptor past the page cache) of a new file of ``pages`` random pages; the test is skipped
    where the temp folder's filesystem refuses O_DIRECT (tmpfs, for one)."""
    data = np.random.default_rng(seed).integers(0, 256, pages * native.ALIGN, dtype=np.uint8)
    path = tmp_path / "f"
    path.write_bytes(data.tobytes())
    try:
        return data, native.open_uncached(str(path))
    except OSError as exc:
        pytest.skip(f"{tmp_path}'s filesystem refuses cache-bypass reads ({exc.strerror})")


@pytest.mark.parametrize("impl", ["native", "twin"])
def test_an_aligned_read_into_aligned_memory_skips_the_bounce_buffer(tmp_path, impl):
    """O_DIRECT reads whose offset and every destination's address and length are multiples of 4096 go straight
    into the destination (counted by ``in_place``); any other goes through the bounce buffer. Both deliver the
    file's bytes, a read into several buffers included."""
    if impl == "native" and not native.NATIVE:
        assert TWIN_FORCED
        return
    read_start = native._native.read_start if impl == "native" else native.py_read_start
    page = native.ALIGN
    data, fd = _uncached_file(tmp_path, 8, seed=2)
    try:
        whole, several = _page_aligned(2 * page), [_page_aligned(page), _page_aligned(3 * page)]
        shifted, odd_length = _page_aligned(2 * page, shift=64), _page_aligned(page + 8)
        requests = [(fd, 2 * page, 2 * page, whole, True),  # in place
                    (fd, 4 * page, 4 * page, several, True),  # in place, in two buffers
                    (fd, page, 2 * page, shifted, True),  # memory not aligned: bounce
                    (fd, 100, page + 8, odd_length, True)]  # offset and length not aligned: bounce
        pending = read_start(requests, 2)
        assert pending.wait(len(requests)) is None
        assert pending.in_place == 2
        assert whole.tobytes() == data[2 * page:4 * page].tobytes()
        assert np.concatenate(several).tobytes() == data[4 * page:].tobytes()
        assert shifted.tobytes() == data[page:3 * page].tobytes()
        assert odd_length.tobytes() == data[100:100 + page + 8].tobytes()
        past_the_end = _page_aligned(2 * page)
        assert read_start([(fd, 7 * page, 2 * page, past_the_end, True)], 1).wait(1) == (0, 0, page)
        assert past_the_end[:page].tobytes() == data[7 * page:].tobytes()
    finally:
        os.close(fd)


@pytest.mark.parametrize("refusal", [errno.EFAULT, errno.EINVAL])
def test_a_read_in_place_the_kernel_refuses_is_read_again_through_the_bounce_buffer(tmp_path, monkeypatch, refusal):
    """A read in place that the kernel refuses is read again through the bounce buffer. EFAULT (memory it cannot
    read into directly, such as some device memory) turns the path off: no later read tries in place; EINVAL (which
    a short read can cause) does not. The twin here; the extension does the same."""
    page = native.ALIGN
    data, fd = _uncached_file(tmp_path, 4, seed=3)
    calls, preadv = [], os.preadv

    def refusing(fd, buffers, offset):
        calls.append(len(buffers))
        if len(buffers) == 2 and len(calls) == 1:  # the first read in place, into the two aligned buffers
            raise OSError(refusal, os.strerror(refusal))
        return preadv(fd, buffers, offset)

    monkeypatch.setattr(native.os, "preadv", refusing)
    monkeypatch.setattr(native, "_in_place_refused", False)
    try:
        first = [_page_aligned(page), _page_aligned(page)]
        pending = native.py_read_start([(fd, 0, 2 * page, first, True)])
        assert pending.wait(1) is None and pending.in_place == 0
        assert np.concatenate(first).tobytes() == data[:2 * page].tobytes()
        assert calls == [2, 1]  # refused in place, then the bounce buffer's read
        later = [_page_aligned(page), _page_aligned(page)]
        again = native.py_read_start([(fd, 2 * page, 2 * page, later, True)])
        assert again.wait(1) is None and np.concatenate(later).tobytes() == data[2 * page:].tobytes()
        if refusal == errno.EFAULT:
            assert native._in_place_refused and again.in_place == 0 and calls == [2, 1, 1]
        else:
            assert not native._in_place_refused and again.in_place == 1 and calls == [2, 1, 2]
    finally:
        os.close(fd)


@pytest.mark.parametrize("impl", ["native", "twin"])
def test_reads_past_the_end_and_bad_descriptors_are_reported(tmp_path, impl):
    if impl == "native" and not native.NATIVE:
        assert TWIN_FORCED
        return
    read_start = native._native.read_start if impl == "native" else native.py_read_start
    path = tmp_path / "f"
    path.write_bytes(bytes(range(256)) * 40)  # 10240 bytes
    fd = os.open(path, os.O_RDONLY)
    try:
        ok, short = np.empty(100, np.uint8), np.empty(1000, np.uint8)
        pending = read_start([(fd, 0, 100, ok, False), (fd, 9740, 1000, short, False)], 2)
        assert pending.wait(1) is None  # the first read alone delivered its length
        assert pending.wait(2) == (1, 0, 500)
        assert ok.tobytes() == (bytes(range(256)) * 40)[:100]
    finally:
        os.close(fd)
    index, err, _ = read_start([(fd, 0, 10, np.empty(10, np.uint8), False)], 1).wait(1)
    assert (index, err) == (0, errno.EBADF)


def test_crc32c_native_and_twin_agree():
    assert native.py_crc32c(b"123456789") == 0xE3069283  # the CRC32C check value
    data = np.random.default_rng(0).integers(0, 256, 100_003, dtype=np.uint8).tobytes()
    twin = native.py_crc32c(data)
    assert native.py_crc32c(data[50_000:], native.py_crc32c(data[:50_000])) == twin
    if native.NATIVE:
        assert native._native.crc32c(b"123456789") == 0xE3069283
        assert native._native.crc32c(data) == twin
        assert native._native.crc32c(data[3:], native._native.crc32c(data[:3])) == twin
    assert twin != zlib.crc32(data)  # Castagnoli, not the zlib polynomial


def test_env_forces_the_twins():
    code = "from mlx_streaming.io import native; print(native.NATIVE, native.read_start is native.py_read_start)"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "MLX_STREAMING_NATIVE": "0"},
                         capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "True"]


def test_the_reader_gives_identical_bytes_with_native_and_twin(model_dir, monkeypatch):
    ranges = _ranges(model_dir)
    reader = ExpertReader("direct")
    first = [a.tobytes() for a in reader.read(ranges)]
    monkeypatch.setattr(native, "read_start", native.py_read_start)
    assert [a.tobytes() for a in reader.read(ranges)] == first
    reader.close()


# ---------------------------------------------------------------- prefetcher


@pytest.fixture
def index_and_reader(model_dir):
    with build_streaming_model(model_dir, StreamingConfig(pool_slots=4)) as sm:
        reader = ExpertReader("buffered")
        yield sm.store.index, reader
        reader.close()


def test_prefetcher_merges_bounds_staging_serves_and_drops_stale(index_and_reader):
    index, reader = index_and_reader
    counters = ResidencyStats()
    pf = Prefetcher(index, reader, staging_limit=2 * index.expert_bytes, counters=counters, threads=2)
    try:
        assert pf.submit(0, [1, 1, 2, 3]) == 2  # 1 again is merged, 3 would pass the staging limit
        assert (counters.prefetch_merged, counters.prefetch_over_budget, pf.staging_bytes) == (1, 1, 2 * index.expert_bytes)
        deadline = time.monotonic() + 30
        while pf.state(0, 1) != "ready" and time.monotonic() < deadline:
            time.sleep(0.001)
        buffers = pf.take(0, 1)
        truth = reader.read([(s.path, s.offset, s.nbytes) for s in index.slices(0, 1)])
        assert [b.tobytes() for b in buffers] == [t.tobytes() for t in truth]
        assert counters.prefetch_hits == 1 and pf.take(0, 1) is None  # taken once
        # read before it was taken: all of its read time was hidden from the taker
        assert counters.prefetch_read_s > 0 and counters.prefetch_hidden_s == counters.prefetch_read_s
        pf.drop_layer(0)  # expert 2 is stale once layer 0 has its experts
        assert counters.prefetch_dropped == 1 and pf.take(0, 2) is None
        while pf.staging_bytes and time.monotonic() < deadline:  # an in-flight read is discarded
            time.sleep(0.001)                                               # when it ends
        assert pf.staging_bytes == 0 and counters.prefetch_staging_peak == 2 * index.expert_bytes
    finally:
        pf.close()
    assert pf.alive_threads == 0 and pf.submit(0, [4]) == 0


@pytest.mark.parametrize("ahead,mult", [(0, 1), (1, 2)])
def test_prefetching_decodes_the_same_ids_and_every_prefetched_expert_is_verified(model_dir, reference_model, prompt_ids, ahead, mult):
    config = StreamingConfig(pool_slots=8, prefetch=True, prefetch_ahead=ahead, prefetch_mult=mult, diagnostics=True,
                             verify=True)
    with build_streaming_model(model_dir, config) as sm:
        ids = greedy_generate(sm.model, prompt_ids[2], 24)
        stats = sm.store.stats()
        diag = sm.store.predictor.diagnostics.stats()
        prefetcher = sm.store.prefetcher
    assert prefetcher.alive_threads == 0  # close() stopped them
    assert ids == greedy_generate(reference_model, prompt_ids[2], 24)
    assert stats["prefetched"] == stats["prefetch_hits"] > 0
    assert stats["prefetch_read_s"] > 0 and 0 <= stats["prefetch_hidden_s"] <= stats["prefetch_read_s"]
    demand_hidden = max(0.0, stats["read_s"] - stats["read_wait_s"])  # a demand read's part run while placing
    assert stats["hidden_read_share"] == (stats["prefetch_hidden_s"] + demand_hidden) / (stats["read_s"] + stats["prefetch_read_s"])
    assert stats["verify_calls"] == stats["misses"] == stats["verify_ok"] > stats["demand_loads"]
    assert stats["verify_bad"] == 0
    decode = diag["decode"]
    assert decode["routed"] == decode["resident"] + decode["prefetch_served"] + decode["a_not_finished"] + \
        decode["a_evicted"] + decode["b_not_predicted"]
    assert 0 < decode["recall"] <= 1 and diag["predict_s"] > 0 and decode["avg_window_ms"] > 0


@pytest.mark.parametrize("ahead", [0, 1])
def test_a_prediction_of_the_next_layer_has_no_wait_of_its_own(model_dir, reference_model, prompt_ids, ahead):
    """Layer by layer each MoE layer call waits once, for its routes; a prediction of the next layer's experts comes
    to the host with them, while one of the layer's own experts (ahead 0) is needed sooner and waits for itself."""
    config = StreamingConfig(pool_slots=64, prefetch=True, prefetch_ahead=ahead, miss_check="layer")
    with build_streaming_model(model_dir, config) as sm:
        predictions = []
        predict = sm.store.predictor.predict

        def counted(*args):
            prediction = predict(*args)
            if prediction is not None:
                predictions.append(prediction)
            return prediction

        sm.store.predictor.predict = counted
        ids = greedy_generate(sm.model, prompt_ids[2], 16)
        stats = sm.store.stats()
    assert ids == greedy_generate(reference_model, prompt_ids[2], 16)
    assert stats["grouped"] == 0 and len(predictions) > 0 and stats["prefetch_hits"] > 0
    assert stats["host_syncs"] == stats["fastpath"] + stats["fallback"] + (len(predictions) if ahead == 0 else 0)


def test_budgets_cap_what_is_submitted(model_dir, prompt_ids):
    config = StreamingConfig(pool_slots=4, prefetch=True, prefetch_ahead=0, prefetch_mult=2, prefetch_forward_budget=3)
    with build_streaming_model(model_dir, config) as sm:
        forwards = []
        original = sm.store.predictor.start_forward
        sm.store.predictor.start_forward = lambda tokens: (forwards.append(tokens), original(tokens))
        greedy_generate(sm.model, prompt_ids[0], 8)
        assert 0 < sm.store.stats()["prefetch_submitted"] <= 3 * len(forwards)
    config = config.replace(prefetch_forward_budget=0, prefetch_layer_budget=1)
    with build_streaming_model(model_dir, config) as sm:
        greedy_generate(sm.model, prompt_ids[0], 8)
        layers = len(sm.model.layers)
        assert 0 < sm.store.stats()["prefetch_submitted"] <= 9 * layers  # 1 prefill + 8 decode forwards


def test_a_failed_prefetch_read_is_dropped_and_the_demand_read_serves(model_dir, reference_model, prompt_ids):
    class FailingPrefetchReads(ExpertReader):
        failures = 0

        def read(self, ranges):
            if threading.current_thread().name.startswith("mlx-streaming-prefetch") and self.failures < 5:
                self.failures += 1
                raise ExpertIOError("planted prefetch failure")
            return super().read(ranges)

    reader = FailingPrefetchReads("buffered")
    config = StreamingConfig(pool_slots=6, prefetch=True, prefetch_ahead=0, verify=True)
    with build_streaming_model(model_dir, config, reader=reader) as sm:
        ids = greedy_generate(sm.model, prompt_ids[1], 16)
        stats = sm.store.stats()
    assert reader.failures == 5 and stats["prefetch_read_failures"] == 5
    assert ids == greedy_generate(reference_model, prompt_ids[1], 16) and stats["verify_bad"] == 0


def test_prefetch_threads_end_at_interpreter_exit_without_close(model_dir):
    code = ("from mlx_streaming.model import build_streaming_model; from mlx_streaming.config import StreamingConfig;"
            "from mlx_streaming.decode.greedy import greedy_generate;"
            f"sm = build_streaming_model({str(model_dir)!r}, StreamingConfig(pool_slots=4, prefetch=True));"
            "greedy_generate(sm.model, sm.tokenizer.encode('def f(x):'), 4); print('done')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "done", out.stderr


def test_prefetch_settings_are_checked():
    with pytest.raises(ConfigError, match="prefetch_ahead"):
        StreamingConfig(prefetch_ahead=2)
    with pytest.raises(ConfigError, match="staging_bytes"):
        StreamingConfig(staging_bytes=0)


def test_demand_reads_run_with_the_read_threads_configured(model_dir, prompt_ids, monkeypatch):
    """``read_threads`` (``--read-threads``) is the depth every demand read call runs at."""
    depths = []
    real = native.read_start
    monkeypatch.setattr(native, "read_start", lambda requests, threads: depths.append(threads) or real(requests, threads))
    with build_streaming_model(model_dir, StreamingConfig(pool_slots=8, read_threads=3)) as sm:
        greedy_generate(sm.model, prompt_ids[0], 4)
        assert sm.store.stats()["misses"] > 0
    assert depths and set(depths) == {3}
