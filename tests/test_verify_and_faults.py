"""Byte-truth verification (STG_VERIFY) and I/O faults in the middle of decoding."""

import errno
import shutil
import time

import pytest

from mlx_streaming.residency.checksums import ExpertVerifyError
from mlx_streaming.config import StreamingConfig
from mlx_streaming.errors import ExpertIOError
from mlx_streaming.decode.greedy import greedy_generate
from mlx_streaming.io.reader import ExpertReader, PendingRead
from mlx_streaming.model import build_streaming_model
from mlx_streaming.residency import loader


@pytest.mark.parametrize("io_mode", ["buffered", "direct"])
def test_every_placed_expert_matches_disk(model_dir, reference_model, prompt_ids, io_mode):
    config = StreamingConfig(pool_slots=6, verify=True, io_mode=io_mode)
    with build_streaming_model(model_dir, config) as sm:
        ids = greedy_generate(sm.model, prompt_ids[0], 16)
        stats = sm.store.stats()
    assert stats["verify_calls"] > 0  # the check ran: "0 bad" is not vacuous
    assert stats["verify_calls"] == stats["misses"] == stats["verify_ok"] and stats["verify_bad"] == 0
    assert ids == greedy_generate(reference_model, prompt_ids[0], 16)


def test_verification_env_name_turns_it_on():
    from mlx_streaming.cli.environment import settings

    assert settings({"STG_VERIFY": "1"})[0].verify and not settings({})[0].verify


def test_a_byte_changed_on_disk_after_indexing_is_caught(tmp_path, model_dir, prompt_ids):
    copy = tmp_path / "model"
    shutil.copytree(model_dir, copy)
    with build_streaming_model(copy, StreamingConfig(pool_slots=4, verify=True)) as sm:
        target = sm.store.index.slices(0, 0)[3]  # expert 0 of layer 0: up_proj.weight
        with open(target.path, "r+b") as f:
            f.seek(target.offset + 5)
            byte = f.read(1)
            f.seek(target.offset + 5)
            f.write(bytes([byte[0] ^ 0xFF]))
        with pytest.raises(ExpertVerifyError, match=f"layer 0 expert 0 tensor up_proj.weight: .*{target.path.name}"):
            sm.store.acquire(0, [0])
        assert sm.store.stats()["verify_bad"] == 1


class FaultyReader(ExpertReader):
    """Fails the ``fail_at``-th system read (counting from 1) with EIO or a short read, once: the batch
    runs for real, then reports that read as the native layer would."""

    def __init__(self, fault: str, fail_at: int):
        super().__init__("buffered")
        self.fault, self.fail_at, self.calls = fault, fail_at, 0

    def _read_start(self, requests):
        pending = super()._read_start(requests)
        first = self.calls + 1
        self.calls += len(requests)
        if first <= self.fail_at <= self.calls:
            i = self.fail_at - first
            return _FailingRead(pending, (i, errno.EIO, 0) if self.fault == "eio" else (i, 0, requests[i][2] // 2))
        return pending


class _FailingRead:
    """A started batch whose read ``failure[0]`` is reported failed (``failure``), as the native layer would."""

    def __init__(self, pending, failure):
        self.pending, self.failure = pending, failure
        self.finished = pending.finished

    @property
    def elapsed(self):
        return self.pending.elapsed

    def wait(self, upto):
        failure = self.pending.wait(upto)
        return self.failure if failure is None and self.failure[0] < upto else failure


@pytest.mark.parametrize("fault,message", [("eio", "failed \\(Input/output error\\)"), ("short", "short read")])
def test_io_fault_mid_decode_raises_clearly_and_the_next_request_succeeds(model_dir, reference_model, prompt_ids, fault, message):
    reader = FaultyReader(fault, fail_at=200)
    with build_streaming_model(model_dir, StreamingConfig(pool_slots=4, verify=True), reader=reader) as sm:
        start = time.monotonic()
        with pytest.raises(ExpertIOError, match=rf"layer \d+ expert \d+: .*model[-\w]*\.safetensors: .*{message}"):
            greedy_generate(sm.model, prompt_ids[0], 64)
        assert time.monotonic() - start < 60  # raised, not hung
        store = sm.store
        # no half-written expert: every resident expert's bytes are still the disk's
        book = store.pool.book
        for layer in store.index.layers:
            for expert in book.resident(layer):
                store.verifier.check(layer, expert, store.pool.arrays[layer], book.slot(layer, expert))
        assert store.stats()["verify_bad"] == 0
        # the fault has cleared: decoding works again and still equals the oracle
        assert greedy_generate(sm.model, prompt_ids[1], 16) == greedy_generate(reference_model, prompt_ids[1], 16)


@pytest.mark.parametrize("fault", ["eio", "short"])
def test_a_read_failing_mid_load_leaves_the_experts_before_it_placed_and_the_rest_out(model_dir, monkeypatch, fault):
    """Tensors are written as their bytes arrive, so a load can fail with some experts written: those are resident
    and hold the disk's bytes; the failing expert and the ones after it give their slots back, half-written or not
    begun; the same acquire then succeeds."""
    monkeypatch.setattr(loader, "PLACE_BATCH_BYTES", 1)  # a batch per tensor,
    monkeypatch.setattr(PendingRead, "arrived", lambda self: 0)  # each taken alone, as if none had arrived yet
    with build_streaming_model(model_dir, StreamingConfig(pool_slots=8, verify=True)) as sm:
        store, layer = sm.store, sm.store.index.layers[0]
        per_expert = len(store.index.slices(layer, 0))
        reader = FaultyReader(fault, fail_at=per_expert + 3)  # the second expert's third tensor
        store.reader = store.loader.reader = reader
        with pytest.raises(ExpertIOError, match=f"layer {layer} expert 1: "):
            store.acquire(layer, [0, 1, 2, 3])
        book = store.pool.book
        assert book.resident(layer) == [0]
        assert store.stats()["verify_ok"] == 1 and store.stats()["verify_bad"] == 0
        # every other slot is free again: seven more experts fill the pool of eight, evicting none
        assert store.acquire(layer, list(range(1, 8))) == [book.slot(layer, e) for e in range(1, 8)]
        assert book.resident(layer) == list(range(8))
        assert store.stats()["evictions"] == 0 and store.stats()["verify_ok"] == 8
        reader.close()


def test_a_shard_that_will_not_open_fails_the_load_and_leaves_its_experts_out(model_dir, monkeypatch):
    """The reads start after the load's experts are given their slots: a shard that cannot be opened then (moved
    away mid-run) fails the load with the reader's own message, and its experts give their slots back."""
    with build_streaming_model(model_dir, StreamingConfig(pool_slots=8)) as sm:
        store, layer = sm.store, sm.store.index.layers[0]

        def refused(path):
            raise ExpertIOError(f"{path}: cannot open expert shard (No such file or directory)")

        monkeypatch.setattr(store.reader, "_file", refused)
        with pytest.raises(ExpertIOError, match="cannot open expert shard"):
            store.acquire(layer, [0, 1, 2])
        assert store.pool.book.resident(layer) == []
        monkeypatch.undo()
        assert len(store.acquire(layer, [0, 1, 2])) == 3 and store.pool.book.resident(layer) == [0, 1, 2]
