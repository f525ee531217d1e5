"""The slot book: which expert sits in which slot, and which goes (LFU, LRU). Pure Python, no MLX."""

import numpy as np
import pytest

from mlx_streaming.residency.policy import SlotBook
from mlx_streaming.errors import PoolTooSmallError


def _book(capacity, eviction="lru", num_experts=16):
    return SlotBook([7], num_experts, capacity, eviction)


def _place(book, expert, protected=()):
    (_, slot, evicted), = book.place(7, [expert], protected)
    return slot, evicted


def test_free_slots_are_used_before_any_eviction():
    book = _book(3)
    placed = book.place(7, [10, 11, 12])
    assert sorted(slot for _, slot, _ in placed) == [0, 1, 2]
    assert all(evicted is None for _, _, evicted in placed)


@pytest.mark.parametrize("eviction", ["lru", "lfu"])
def test_the_least_recently_used_goes_among_equally_used(eviction):
    book = _book(2, eviction)
    s10, _ = _place(book, 10)
    _place(book, 11)
    assert book.admit(7, [10]) == []  # 10 is now used twice and newest
    if eviction == "lfu":
        assert book.admit(7, [11]) == []  # both used twice: 10 is now the older
        slot, evicted = _place(book, 12)
        assert evicted == 10 and book.slot(7, 10) is None and book.slot(7, 11) is not None
    else:
        slot, evicted = _place(book, 12)
        assert evicted == 11 and book.slot(7, 11) is None and book.slot(7, 10) == s10
    assert book.slot(7, 12) == slot


def test_lfu_keeps_the_expert_used_most_where_lru_lets_it_go():
    evicted = {}
    for eviction in ("lfu", "lru"):
        book = _book(2, eviction)
        book.place(7, [0, 1])
        for _ in range(3):
            book.admit(7, [0])  # 0: used 4 times, 1 once
        book.admit(7, [1])  # 1 is the newest
        evicted[eviction] = _place(book, 2)[1]
    assert evicted == {"lfu": 1, "lru": 0}


def test_lfu_remembers_uses_across_evictions():
    book = _book(2, "lfu")
    book.place(7, [0, 1])
    for e, times in ((0, 4), (1, 5)):
        for _ in range(times):
            book.admit(7, [e])  # 0: 5 uses, 1: 6
    assert _place(book, 2)[1] == 0
    assert _place(book, 0)[1] == 2  # 0 comes back with 6 uses, not 1
    assert _place(book, 2)[1] == 1  # 0 and 1 both used 6 times: the older, 1, goes


def test_protected_experts_are_not_evicted():
    book = _book(2)
    book.place(7, [1, 2])
    assert _place(book, 3, protected={1})[1] == 2


def test_pinned_experts_are_never_evicted():
    book = _book(2, "lfu")
    _place(book, 1)
    book.pin(7, 1)
    _place(book, 2)
    for e in (3, 4, 5):
        for _ in range(5):
            book.admit(7, [e])  # used far more than the pinned one
        assert _place(book, e)[1] != 1
    assert book.slot(7, 1) is not None and book.pinned(7) == {1}


def test_no_evictable_slot_is_an_error():
    book = _book(2)
    _place(book, 1)
    book.pin(7, 1)
    _place(book, 2)
    with pytest.raises(PoolTooSmallError, match="none can be evicted"):
        _place(book, 3, protected={2})


def test_placing_a_resident_expert_or_pinning_an_absent_one_is_refused():
    book = _book(2)
    _place(book, 1)
    with pytest.raises(ValueError, match="already resident"):
        _place(book, 1)
    with pytest.raises(ValueError, match="must be resident"):
        book.pin(7, 7)
    with pytest.raises(ValueError, match="eviction must be one of"):
        _book(2, "fifo")


def test_identity_slots_put_each_expert_in_its_own_slot():
    book = _book(4, num_experts=4)
    assert [slot for _, slot, _ in book.place(7, [2, 0, 3])] == [2, 0, 3]
    assert _place(book, 1) == (1, None)
    with pytest.raises(ValueError):
        _place(book, 2)


def test_admit_touches_the_routed_experts_and_names_the_missing_ones():
    book = _book(2)
    book.place(7, [10, 11])
    assert book.admit(7, [10, 12]) == [12]  # 10 touched: 11 is now the oldest
    assert _place(book, 12, protected={10, 12}) == (book.slot(7, 12), 11)


def test_several_placed_at_once_evict_as_placed_one_by_one():
    rng = np.random.default_rng(1)
    for eviction in ("lru", "lfu"):
        together, one_by_one = _book(6, eviction, 32), _book(6, eviction, 32)
        for _ in range(300):
            routed = sorted(set(rng.zipf(1.4, 4).clip(1, 32) - 1))
            missing = together.admit(7, routed)
            assert one_by_one.admit(7, routed) == missing
            placed = together.place(7, missing, routed)
            assert placed == [(e, *_place(one_by_one, e, routed)) for e in missing]


@pytest.mark.parametrize("eviction", ["lru", "lfu"])
def test_touches_made_in_bulk_evict_as_touches_made_one_by_one(eviction):
    """A pool's resident forwards touch every layer at once (``SlotBook.touch`` of their flat keys): the evictions
    are those of admitting each layer's call one by one."""
    rng = np.random.default_rng(0)
    layers = [3, 5]
    one_by_one, bulk = (SlotBook(layers, 32, 8, eviction) for _ in range(2))
    touched, evictions = 0, 0
    for _ in range(400):
        routes = {layer: sorted(set(rng.zipf(1.5, 4).clip(1, 32) - 1)) for layer in layers}
        if all(bulk.slot(layer, e) is not None for layer, experts in routes.items() for e in experts):
            keys = np.concatenate([bulk.key_base[layer] + np.array(experts) for layer, experts in routes.items()])
            touched += bulk.touch(keys)
            assert all(one_by_one.admit(layer, experts) == [] for layer, experts in routes.items())
            continue
        for layer, experts in routes.items():
            missing = bulk.admit(layer, experts)
            assert one_by_one.admit(layer, experts) == missing
            placed = bulk.place(layer, missing, experts)
            assert placed == one_by_one.place(layer, missing, experts)
            evictions += sum(evicted is not None for _, _, evicted in placed)
    assert evictions > 20 and touched > 100  # both kinds of step happened, often
