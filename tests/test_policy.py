"""LRU slot policy: pure Python, no MLX."""

import pytest

from mlx_streaming.residency.policy import LRUSlots
from mlx_streaming.errors import PoolTooSmallError


def test_free_slots_are_used_before_any_eviction():
    p = LRUSlots(3)
    placed = [p.place(e) for e in (10, 11, 12)]
    assert sorted(slot for slot, _ in placed) == [0, 1, 2]
    assert all(evicted is None for _, evicted in placed)


def test_least_recently_used_is_evicted_and_its_slot_reused():
    p = LRUSlots(2)
    s10, _ = p.place(10)
    p.place(11)
    p.touch(10)  # 11 is now the oldest
    slot, evicted = p.place(12)
    assert evicted == 11 and p.slot(11) is None
    assert p.slot(10) == s10 and p.slot(12) == slot


def test_protected_experts_are_not_evicted():
    p = LRUSlots(2)
    p.place(1)
    p.place(2)
    slot, evicted = p.place(3, protected={1})
    assert evicted == 2


def test_pinned_experts_are_never_evicted():
    p = LRUSlots(2)
    p.place(1)
    p.pin(1)
    p.place(2)
    for e in (3, 4, 5):
        _, evicted = p.place(e)
        assert evicted != 1
    assert p.slot(1) is not None and p.pinned == {1}


def test_no_evictable_slot_is_an_error():
    p = LRUSlots(2)
    p.place(1)
    p.pin(1)
    p.place(2)
    with pytest.raises(PoolTooSmallError, match="none can be evicted"):
        p.place(3, protected={2})


def test_placing_a_resident_expert_or_pinning_an_absent_one_is_refused():
    p = LRUSlots(2)
    p.place(1)
    with pytest.raises(ValueError):
        p.place(1)
    with pytest.raises(ValueError):
        p.pin(7)


def test_identity_slots_put_each_expert_in_its_own_slot():
    p = LRUSlots(4, identity=True)
    assert [p.place(e)[0] for e in (2, 0, 3)] == [2, 0, 3]
    assert p.place(1) == (1, None)
    with pytest.raises(ValueError):
        p.place(2)


def test_admit_touches_the_routed_experts_and_names_the_missing_ones():
    p = LRUSlots(2)
    p.place(10)
    p.place(11)
    assert p.admit([10, 12]) == [12]  # 10 touched: 11 is now the oldest
    assert p.place(12, protected={10, 12}) == (p.slot(12), 11)


def test_touches_made_in_bulk_evict_as_touches_made_one_by_one():
    """A pool's resident forwards touch every layer's LRU order at once (``ExpertPool.touch`` writes ticks into a
    row ``LRUSlots`` applies before its order is next read): the evictions are those of touching one by one."""
    import numpy as np

    rng = np.random.default_rng(0)
    pending = np.full(32, -1, dtype=np.int64)
    one_by_one, bulk = LRUSlots(8), LRUSlots(8, pending=pending)
    tick, evictions = 0, 0
    for _ in range(400):
        routed = sorted(set(rng.zipf(1.5, 4).clip(1, 32) - 1))
        if all(bulk.slot(e) is not None for e in routed):  # a resident forward: touched in bulk
            pending[routed] = tick + np.arange(len(routed))
            tick += len(routed)
            assert one_by_one.admit(routed) == []
            continue
        assert bulk.admit(routed) == one_by_one.admit(routed)
        for e in [e for e in routed if bulk.slot(e) is None]:
            placed = bulk.place(e, set(routed))
            assert placed == one_by_one.place(e, set(routed))
            evictions += placed[1] is not None
    assert evictions > 20 and tick > 100  # both kinds of step happened, often
