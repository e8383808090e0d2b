"""Cross-request prefix caching: the boundary rule against the dense diffusion mask, chained
content keys, the refcounted LRU cache, the allocator's hits / eviction / publish, the
registry's seal on a real cpu worker, and the scheduler end to end against the same requests
run without prefix caching."""

from __future__ import annotations

import dataclasses
import hashlib
import random
from collections.abc import Callable
from typing import Any

import pytest
import torch

from diffusion_kv.core.allocation import RequestAllocation
from diffusion_kv.core.allocator import (
    AdmissionError,
    DiffusionKVAllocator,
    FreeListPool,
    KVRequest,
    SequenceRequest,
)
from diffusion_kv.core.capabilities import AttentionMode
from diffusion_kv.core.errors import GenerationError, StateError, ValidationError
from diffusion_kv.core.layer_context import AttentionMetadata
from diffusion_kv.core.prefix_cache import (
    ContentSpan,
    PrefixCache,
    PrefixNamespace,
    block_keys,
    cacheable_cut,
    check_content,
)
from diffusion_kv.core.rows import PagedRow
from diffusion_kv.core.runner import PagedLayerSpec, PagedWorker, RunnerConfig
from diffusion_kv.core.scheduler import (
    DiffusionRequest,
    DiffusionScheduler,
    StepBatch,
    row_prefix_keys,
    scales_version,
    worker_namespace,
)
from diffusion_kv.platforms.cpu import CpuPlatform
from diffusion_kv.platforms.interface import ENV_BACKEND

from .registry_helpers import state_of

# -- 1. the boundary rule ---------------------------------------------------------------------


def diffusion_mask(n: int, spans: list[tuple[int, int]]) -> torch.Tensor:
    """``mask[q, k]``: query ``q`` sees key ``k`` (causal, plus bidirectional inside a span)."""
    pos = torch.arange(n)
    mask = pos[None, :] <= pos[:, None]
    for a, b in spans:
        inside = (pos >= a) & (pos < b)
        mask |= inside[:, None] & inside[None, :]
    return mask


def leaks(mask: torch.Tensor, m: int) -> bool:
    """A query before ``m`` attends to a key at or after ``m``."""
    return bool(mask[:m, m:].any())


def random_spans(rng: random.Random, n: int) -> list[tuple[int, int]]:
    spans, pos = [], 0
    while pos < n and rng.random() < 0.85:
        a = rng.randint(pos, min(n - 1, pos + 12))
        b = rng.randint(a + 1, min(n, a + rng.choice((2, 6, 12, 24, 48))))
        spans.append((a, b))
        pos = b + rng.randint(0, 3)  # touching spans too
    return spans


def test_cut_property_against_the_dense_diffusion_mask() -> None:
    rng = random.Random(20261204)
    pulled_back = zero = 0
    for _ in range(400):
        block = rng.choice((1, 2, 3, 4, 8, 16))
        n = rng.randint(1, 64)
        limit = rng.randint(n // 2, n)
        spans = random_spans(rng, n)
        mask = diffusion_mask(n, spans)
        cut = cacheable_cut(limit, spans, block)
        case = f"limit={limit} block={block} spans={spans} -> cut {cut}"
        assert cut % block == 0 and 0 <= cut <= limit, case
        assert not leaks(mask, cut), case
        # maximal: every block-aligned position above the cut, up to the limit, leaks
        for m in range(cut + block, limit + 1, block):
            assert leaks(mask, m), f"{case}: {m} does not leak"
        pulled_back += cut < limit - limit % block
        zero += cut == 0 and limit >= block
    assert pulled_back >= 80 and zero >= 15  # the property exercised the crossing path


@pytest.mark.parametrize(
    ("limit", "spans", "block", "cut"),
    [
        (40, [(40, 48)], 16, 32),  # limit not aligned: down to 32
        (48, [(40, 48)], 16, 48),  # a span ending at the cut does not cross it
        (60, [(20, 50)], 16, 16),  # crosses 48 and 32: back to the block holding its start
        (48, [(16, 50)], 16, 16),  # a span starting at the cut does not cross it
        (64, [(5, 20), (30, 70)], 16, 0),  # (30, 70) pulls back to 16, which (5, 20) crosses
        (64, [(5, 9), (60, 70)], 4, 60),
        (15, [], 16, 0),
        (0, [], 4, 0),
        (7, [(0, 3)], 1, 7),
        (7, [(0, 30)], 1, 0),
    ],
)
def test_cut_worked_examples(limit: int, spans: list[tuple[int, int]], block: int, cut: int) -> None:
    assert cacheable_cut(limit, spans, block) == cut


@pytest.mark.parametrize(
    ("limit", "block", "fact"),
    [
        (-1, 4, "limit must be an int >= 0; got -1"),
        (True, 4, "limit must be an int >= 0; got True"),
        (8.0, 4, "limit must be an int >= 0; got 8.0"),
        (8, 0, "block_size must be a positive int; got 0"),
        (8, None, "block_size must be a positive int; got None"),
    ],
)
def test_cut_bad_arguments(limit: Any, block: Any, fact: str) -> None:
    with pytest.raises(ValidationError, match=fact.replace("(", r"\(").replace(")", r"\)")):
        cacheable_cut(limit, [], block)


# -- 2. keys ----------------------------------------------------------------------------------

NS = PrefixNamespace("model@rev1", "causal/8/float32/2x8")
CONTENT = (ContentSpan(0, 20, "system prompt"), ContentSpan(20, 40, b"\x01image digest"))


def test_equal_content_and_namespace_give_equal_chained_keys() -> None:
    keys = block_keys(CONTENT, NS, 40, 8)
    assert len(keys) == 5 and all(type(k) is bytes and len(k) == 16 for k in keys)
    assert len(set(keys)) == 5
    twin = (ContentSpan(0, 20, "system prompt"), ContentSpan(20, 40, b"\x01image digest"))
    assert block_keys(twin, PrefixNamespace("model@rev1", "causal/8/float32/2x8"), 40, 8) == keys
    assert block_keys(CONTENT, NS, 16, 8) == keys[:2]  # a shorter cut is a leading run
    assert block_keys(CONTENT, NS, 0, 8) == ()


@pytest.mark.parametrize(
    ("content", "first_differing"),
    [
        (
            (ContentSpan(0, 20, "system prompt"), ContentSpan(20, 40, b"\x01other image")),
            2,
        ),  # block 2 holds 20
        ((ContentSpan(0, 20, "system prompt"), ContentSpan(20, 40, "\x01image digest")), 2),  # str vs bytes
        ((ContentSpan(0, 20, "system prompt!"), ContentSpan(20, 40, b"\x01image digest")), 0),
        ((ContentSpan(0, 24, "system prompt"), ContentSpan(24, 40, b"\x01image digest")), 2),  # moved border
        # the same keys split differently name different tokens
        ((ContentSpan(0, 8, "system prompt"), ContentSpan(8, 20, "system prompt"), CONTENT[1]), 1),
    ],
)
def test_changed_content_changes_every_key_from_its_block_on(
    content: tuple[ContentSpan, ...], first_differing: int
) -> None:
    keys = block_keys(CONTENT, NS, 40, 8)
    other = block_keys(content, NS, 40, 8)
    assert other[:first_differing] == keys[:first_differing]
    assert all(a != b for a, b in zip(other[first_differing:], keys[first_differing:], strict=True))
    assert set(other[first_differing:]).isdisjoint(keys)


@pytest.mark.parametrize(
    "change",
    [
        {"model": "model@rev2"},
        {"adapter": "lora-a"},
        {"kv_layout": "causal/8/bfloat16/2x8"},
        {"ranks": "ulysses 2:0"},
        {"branch": 1},
    ],
)
def test_every_namespace_field_changes_every_key(change: dict[str, Any]) -> None:
    keys = block_keys(CONTENT, NS, 40, 8)
    other = block_keys(CONTENT, dataclasses.replace(NS, **change), 40, 8)
    assert len(other) == 5 and set(other).isdisjoint(keys)
    assert dataclasses.replace(NS, **change).digest() != NS.digest()


def test_adapters_differ_from_each_other_and_from_none() -> None:
    digests = {dataclasses.replace(NS, adapter=a).digest() for a in (None, "a", "b")}
    assert len(digests) == 3


def test_spans_inside_the_cut_are_part_of_the_keys() -> None:
    keys = block_keys(CONTENT, NS, 40, 8)
    assert block_keys(CONTENT, NS, 40, 8, [(40, 48)]) == keys  # the target's span: after the cut
    with_span = block_keys(CONTENT, NS, 40, 8, [(17, 22), (40, 48)])
    assert with_span[:2] == keys[:2] and set(with_span[2:]).isdisjoint(keys)  # from block 2 on
    moved = block_keys(CONTENT, NS, 40, 8, [(17, 23)])
    assert moved[:2] == keys[:2] and set(moved[2:]).isdisjoint(with_span)


def test_blocks_a_span_joins_are_keyed_as_one_run() -> None:
    """(4, 12) crosses the boundary 8: block 0's K/V depend on tokens 8-11, so a change there
    changes block 0's key as well; blocks after the run's end (16) keep their keys."""
    spans = [(4, 12), (40, 48)]
    keys = block_keys(CONTENT, NS, 40, 8, spans)
    late = (ContentSpan(0, 10, "system prompt"), ContentSpan(10, 40, "tail"))  # differs from 10 on
    assert set(block_keys(late, NS, 40, 8, spans)).isdisjoint(keys)
    assert block_keys(late, NS, 40, 8)[:1] == block_keys(CONTENT, NS, 40, 8)[:1]  # causal: block 0 same
    after = (ContentSpan(0, 20, "system prompt"), ContentSpan(20, 40, "other"))  # differs from 20 on
    other = block_keys(after, NS, 40, 8, spans)
    assert other[:2] == keys[:2] and set(other[2:]).isdisjoint(keys)
    assert block_keys(CONTENT, NS, 16, 8, spans) == keys[:2]


@pytest.mark.parametrize(
    ("spans", "fact"),
    [
        ([(12, 20)], r"cut 16 is crossed by full_attn_spans \[\(12, 20\)\]"),
        ([(0, 4), (15, 17)], r"cut 16 is crossed by full_attn_spans \[\(15, 17\)\]"),
    ],
)
def test_a_cut_a_span_crosses_is_refused(spans: list[tuple[int, int]], fact: str) -> None:
    with pytest.raises(ValidationError, match=fact):
        block_keys(CONTENT, NS, 16, 8, spans)


@pytest.mark.parametrize(
    ("content", "cut", "fact"),
    [
        (CONTENT, 48, "cut 48 lies past the 40 leading tokens the content spans name"),
        ((ContentSpan(0, 20, "a"), ContentSpan(24, 40, "b")), 24, "cut 24 lies past the 20 leading tokens"),
        ((ContentSpan(8, 40, "a"),), 8, "cut 8 lies past the 0 leading tokens"),
        (CONTENT, 12, "cut must be a multiple of the block size 8; got 12"),
        (CONTENT, -8, "cut must be a multiple of the block size 8; got -8"),
    ],
)
def test_a_cut_past_the_named_content_is_refused(
    content: tuple[ContentSpan, ...], cut: int, fact: str
) -> None:
    with pytest.raises(ValidationError, match=fact):
        block_keys(content, NS, cut, 8)


@pytest.mark.parametrize(
    ("make", "fact"),
    [
        (lambda: ContentSpan(5, 5, "k"), r"integer bounds 0 <= start < end; got \[5, 5\)"),
        (lambda: ContentSpan(-1, 3, "k"), r"got \[-1, 3\)"),
        (lambda: ContentSpan(0.0, 3, "k"), r"got \[0.0, 3\)"),  # type: ignore[arg-type]
        (lambda: ContentSpan(True, 3, "k"), r"got \[True, 3\)"),
        (
            lambda: ContentSpan(0, 3, ""),
            r"content span \[0, 3\) key must be a non-empty str or bytes; got ''",
        ),
        (lambda: ContentSpan(0, 3, b""), r"key must be a non-empty str or bytes; got b''"),
        (lambda: ContentSpan(0, 3, 7), r"key must be a non-empty str or bytes; got 7"),  # type: ignore[arg-type]
        (lambda: check_content("abc"), "content must be a sequence of ContentSpan; got 'abc'"),
        (lambda: check_content([(0, 3, "k")]), r"content must hold ContentSpan; got \(0, 3, 'k'\)"),
        (
            lambda: check_content([ContentSpan(0, 4, "a"), ContentSpan(3, 6, "b")]),
            "content spans must be sorted and disjoint",
        ),
        (lambda: PrefixNamespace("", "L"), "needs a non-empty model identity; got ''"),
        (lambda: PrefixNamespace("m", ""), "needs the KV layout; got ''"),
        (lambda: PrefixNamespace("m", "L", None), "ranks must be a string; got None"),  # type: ignore[arg-type]
        (lambda: PrefixNamespace("m", "L", adapter=""), "adapter must be None or a non-empty string; got ''"),
        (lambda: PrefixNamespace("m", "L", branch=-1), "branch must be an int >= 0; got -1"),
        (lambda: PrefixNamespace("m", "L", branch=True), "branch must be an int >= 0; got True"),
    ],
)
def test_bad_content_and_namespaces_are_refused(make: Callable[[], object], fact: str) -> None:
    with pytest.raises(ValidationError, match=fact):
        make()


# -- 3. PrefixCache ---------------------------------------------------------------------------

K = [hashlib.blake2b(bytes([i]), digest_size=16).digest() for i in range(12)]


def cache_state(cache: PrefixCache) -> tuple[object, ...]:
    return (cache.stats(), cache.blocks(), list(cache._idle), {k: cache.refs(k) for k in K})


def test_cache_refcounts_lookup_and_idle_lru_order() -> None:
    cache = PrefixCache()
    assert [cache.publish(k, b) for k, b in zip(K[:3], (10, 11, 12), strict=True)] == [True] * 3
    assert cache.publish(K[0], 13) is False  # cached already: the block stays its publisher's
    with pytest.raises(ValidationError, match="block 10 is already cached under another key"):
        cache.publish(K[5], 10)
    assert cache.blocks() == {10: 1, 11: 1, 12: 1} and cache.num_idle == 0 and len(cache) == 3
    assert cache.lookup([K[0], K[1], K[9], K[2]]) == [10, 11]  # stops at the first miss
    assert cache.lookup([K[9], K[0]]) == []
    assert cache.block_of(K[1]) == 11 and cache.key_of(12) == K[2] and cache.block_of(K[9]) is None
    cache.acquire([K[0], K[1]])
    assert [cache.refs(k) for k in K[:3]] == [2, 2, 1]
    cache.release(K[:3])  # the publisher's chain
    assert [cache.refs(k) for k in K[:3]] == [1, 1, 0] and list(cache._idle) == [K[2]]
    cache.release(K[:2])  # the hit's chain: its tail goes idle first
    assert list(cache._idle) == [K[2], K[1], K[0]] and cache.evictable() == 3
    assert cache.evictable(keep=[K[1], K[9]]) == 2
    assert cache.evict(1) == [12]
    assert cache.evict(5, keep=[K[1]]) == [10]
    assert K[2] not in cache and K[0] not in cache and K[1] in cache
    assert cache.stats() == {
        "cached_blocks": 1,
        "idle_blocks": 1,
        "hit_blocks": 0,
        "published_blocks": 3,
        "evictions": 2,
    }
    cache.acquire([K[1]])  # a hit takes an idle block back out of the eviction order
    assert cache.num_idle == 0 and cache.evict(3) == [] and cache.refs(K[1]) == 1


def test_touch_moves_idle_blocks_to_the_back() -> None:
    cache = PrefixCache()
    for i in range(3):
        cache.publish(K[i], i)
    cache.release([K[0]])
    cache.release([K[1]])
    cache.release([K[2]])
    cache.touch([K[0], K[7]])  # an unknown key is ignored
    assert list(cache._idle) == [K[1], K[2], K[0]] and cache.evict(2) == [1, 2]


def test_max_blocks_caps_what_is_published() -> None:
    cache = PrefixCache(max_blocks=2)
    assert cache.room() == 2
    assert [cache.publish(K[i], i) for i in range(3)] == [True, True, False]
    assert len(cache) == 2 and cache.room() == 0 and cache.stats()["published_blocks"] == 2
    cache.release([K[0]])
    assert cache.room() == 1  # an idle block may be evicted to make room
    assert PrefixCache(max_blocks=0).publish(K[0], 0) is False
    assert PrefixCache().room() == 1 << 62
    for bad in (-1, 1.5, "2"):
        with pytest.raises(ValidationError, match=f"max_blocks must be None or an int >= 0; got {bad!r}"):
            PrefixCache(max_blocks=bad)  # type: ignore[arg-type]


def test_bad_release_and_acquire_change_nothing() -> None:
    cache = PrefixCache()
    for i in range(3):
        cache.publish(K[i], i)
    cache.release([K[2]])
    before = cache_state(cache)
    with pytest.raises(
        ValidationError, match=f"release of prefix keys not held: \\['{K[2].hex()}', '{K[9].hex()}'\\]"
    ):
        cache.release([K[0], K[2], K[9]])
    assert cache_state(cache) == before
    with pytest.raises(ValidationError, match=f"release of prefix keys not held: \\['{K[1].hex()}'\\]"):
        cache.release([K[1], K[1]])  # one reference cannot be released twice
    assert cache_state(cache) == before
    with pytest.raises(ValidationError, match=f"acquire of uncached prefix keys \\['{K[9].hex()}'\\]"):
        cache.acquire([K[0], K[9]])
    assert cache_state(cache) == before


# -- 4. the allocator -------------------------------------------------------------------------


def pc_alloc(num_blocks: int = 16, max_blocks: int | None = None) -> DiffusionKVAllocator:
    return DiffusionKVAllocator(
        block_size=4,
        max_model_len=32,
        max_rows_per_request=2,
        worker_rows=8,
        pool=FreeListPool(num_blocks),
        prefix_cache=PrefixCache(max_blocks),
    )


def kreq(rid: str, prefix: int, target: int, *keys: tuple[bytes, ...]) -> KVRequest:
    rows = keys or ((),)
    return KVRequest(
        rid, tuple(SequenceRequest(i, prefix, target, prefix_keys=k) for i, k in enumerate(rows))
    )


def alloc_state(a: DiffusionKVAllocator) -> tuple[object, ...]:
    assert a.prefix_cache is not None and isinstance(a.pool, FreeListPool)
    return (
        sorted(a.pool._free),
        a.generation,
        a.blocks_held,
        {
            rid: (r.allocation, list(r.block_ids), list(r.private), [list(h) for h in r.held])
            for rid, r in a._reserved.items()
        },
        cache_state(a.prefix_cache),
    )


def test_a_hit_reuses_the_cached_blocks_and_declares_them_cached() -> None:
    a = pc_alloc()
    cache = a.prefix_cache
    assert cache is not None
    first = a.reserve(kreq("a", 12, 4, tuple(K[:3])))
    assert first is not None and first.sequences[0].block_ids == ((0, 1, 2, 3),)
    assert first.sequences[0].cached_prefix_len == 0 and len(cache) == 0  # nothing published yet
    sealed = a.publish("a")
    assert sealed is not None and sealed.allocation_generation == 2 == a.generation
    assert sealed.sequences[0] == dataclasses.replace(first.sequences[0], cached_prefix_len=12)
    assert cache.blocks() == {0: 1, 1: 1, 2: 1} and a.publish("a") is None  # sealed already
    hit = a.reserve(kreq("b", 12, 4, tuple(K[:3])))
    assert hit is not None and hit.sequences[0].block_ids == ((0, 1, 2, 4),)
    assert hit.sequences[0].cached_prefix_len == 12 and hit.allocation_generation == 3
    assert cache.blocks() == {0: 2, 1: 2, 2: 2} and cache.stats()["hit_blocks"] == 3
    partial = a.reserve(kreq("c", 12, 8, (K[0], K[1], K[7])))  # the third block differs
    assert partial is not None and partial.sequences[0].block_ids == ((0, 1, 5, 6, 7),)
    assert partial.sequences[0].cached_prefix_len == 8
    assert a.pool.num_free == 8 and a.blocks_held == 8
    assert a.publish("b") is None  # every keyed block of b was a hit
    assert a.free("a") == 1 and cache.blocks() == {0: 2, 1: 2, 2: 1}  # only its private block 3
    assert a.free("b") == 1 and a.free("c") == 3  # c's unpublished block 5 goes back too
    assert cache.blocks() == {0: 0, 1: 0, 2: 0} and list(cache._idle) == [K[2], K[1], K[0]]
    assert a.pool.num_free == 13 and a.blocks_held == 0 and a.free("c") == 0


def test_two_cfg_rows_hit_and_publish_independently() -> None:
    a = pc_alloc()
    assert a.reserve(kreq("a", 8, 4, (K[0], K[1]), (K[2],))) is not None
    sealed = a.publish("a")
    assert sealed is not None
    assert [s.cached_prefix_len for s in sealed.sequences] == [8, 4]
    hit = a.reserve(kreq("b", 8, 4, (K[0], K[1]), (K[3],)))
    assert hit is not None and [s.cached_prefix_len for s in hit.sequences] == [8, 0]
    assert hit.sequences[0].block_ids[0][:2] == sealed.sequences[0].block_ids[0][:2]
    assert set(hit.sequences[1].block_ids[0]).isdisjoint(sealed.sequences[1].block_ids[0])


def test_idle_cached_blocks_are_evicted_for_a_request_that_needs_them() -> None:
    a = pc_alloc(num_blocks=8)
    cache = a.prefix_cache
    assert cache is not None
    assert a.reserve(kreq("a", 12, 4, tuple(K[:3]))) is not None
    a.publish("a")
    assert a.free("a") == 1 and a.pool.num_free == 5 and cache.num_idle == 3 and a.blocks_held == 0
    big = a.reserve(kreq("big", 0, 28))  # 7 blocks: 5 free, so the chain's tail goes first
    assert big is not None and sorted(big.sequences[0].block_ids[0]) == [1, 2, 3, 4, 5, 6, 7]
    assert cache.blocks() == {0: 0} and list(cache._idle) == [K[0]]
    assert cache.stats()["evictions"] == 2 and a.pool.num_free == 0 and a.blocks_held == 7
    assert a.free("big") == 7


def test_a_request_that_cannot_fit_even_with_eviction_changes_nothing() -> None:
    a = pc_alloc(num_blocks=10)
    assert a.reserve(kreq("a", 12, 4, tuple(K[:3]))) is not None  # blocks 0-3
    a.publish("a")
    assert a.reserve(kreq("b", 8, 4, (K[4], K[5]))) is not None  # blocks 4-6
    a.publish("b")
    a.free("b")  # 2 idle cached blocks, 4 free
    assert a.pool.num_free == 4 and a.prefix_cache is not None and a.prefix_cache.num_idle == 2
    before = alloc_state(a)
    # hits b's 2 idle blocks (not evictable for it), needs 6 more: 4 free + 0 evictable
    assert a.reserve(kreq("c", 8, 24, (K[4], K[5]))) is None
    assert alloc_state(a) == before
    # a stranger needing 7: 4 free + 2 evictable are not enough, so nothing is evicted
    assert a.reserve(kreq("d", 0, 28)) is None
    assert alloc_state(a) == before
    assert a.reserve(kreq("e", 0, 24)) is not None  # 6 fit once both idle blocks go
    assert a.prefix_cache.stats()["evictions"] == 2 and a.pool.num_free == 0


def test_publish_with_a_failing_install_changes_nothing() -> None:
    a = pc_alloc()
    assert a.reserve(kreq("a", 12, 4, tuple(K[:3]))) is not None
    before = alloc_state(a)
    seen: list[RequestAllocation] = []

    def refuse(snapshot: RequestAllocation) -> None:
        seen.append(snapshot)
        raise RuntimeError("worker refused the seal")

    with pytest.raises(RuntimeError, match="worker refused the seal"):
        a.publish("a", refuse)
    assert alloc_state(a) == before and a.generation == 1
    assert seen[0].allocation_generation == 2 and seen[0].sequences[0].cached_prefix_len == 12
    installed: list[RequestAllocation] = []
    sealed = a.publish("a", installed.append)
    assert installed == [sealed] and sealed is not None and sealed.allocation_generation == 2
    assert a.prefix_cache is not None and len(a.prefix_cache) == 3


def test_publishing_a_key_already_cached_leaves_that_block_private() -> None:
    a = pc_alloc()
    cache = a.prefix_cache
    assert cache is not None
    first = a.reserve(kreq("a", 12, 4, tuple(K[:3])))
    twin = a.reserve(kreq("b", 12, 4, tuple(K[:3])))  # both missed: reserved before any publish
    assert first is not None and twin is not None and twin.sequences[0].cached_prefix_len == 0
    a.publish("a")
    cached = cache.blocks()
    sealed = a.publish("b")
    assert sealed is not None and sealed.sequences[0].cached_prefix_len == 12  # sealed all the same
    assert cache.blocks() == cached == {0: 1, 1: 1, 2: 1}
    assert a.free("b") == 4 and a.free("a") == 1 and cache.num_idle == 3


def test_the_cap_publishes_what_fits_and_evicts_idle_blocks_for_room() -> None:
    a = pc_alloc(max_blocks=2)
    cache = a.prefix_cache
    assert cache is not None
    assert a.reserve(kreq("a", 12, 4, tuple(K[:3]))) is not None
    sealed = a.publish("a")
    assert sealed is not None and sealed.sequences[0].cached_prefix_len == 12
    assert cache.blocks() == {0: 1, 1: 1}
    hit = a.reserve(kreq("b", 12, 4, tuple(K[:3])))
    assert hit is not None and hit.sequences[0].cached_prefix_len == 8  # the third was not cached
    assert a.free("a") == 2 and a.free("b") == 2 and cache.num_idle == 2
    assert a.reserve(kreq("c", 8, 4, (K[6], K[7]))) is not None
    a.publish("c")  # both idle blocks make room, the chain's tail first
    assert set(cache.blocks()) == set(a.blocks_of("c")[:2]) and cache.stats()["evictions"] == 2


@pytest.mark.parametrize(
    ("keys", "prefix", "fact"),
    [
        ([K[0]], 8, r"sequence 0 prefix_keys must be a tuple of non-empty bytes; got \["),
        ((b"",), 8, "prefix_keys must be a tuple of non-empty bytes; got \\(b'',\\)"),
        (("k",), 8, "prefix_keys must be a tuple of non-empty bytes; got \\('k',\\)"),
        ((K[0], K[1]), 7, "has 2 prefix keys of 4 tokens each, more than its prefix_len 7"),
        ((K[0], K[1], K[0]), 12, "lists a prefix key twice"),
    ],
)
def test_bad_prefix_keys_are_admission_errors(keys: Any, prefix: int, fact: str) -> None:
    a = pc_alloc()
    before = alloc_state(a)
    bad = KVRequest("r", (SequenceRequest(0, prefix, 4, prefix_keys=keys),))
    for call in (a.check, a.reserve):
        with pytest.raises(AdmissionError, match=fact):
            call(bad)
    assert alloc_state(a) == before


def test_publish_of_unknown_requests_and_without_a_cache() -> None:
    a = pc_alloc()
    with pytest.raises(ValidationError, match="publish of request 'zz', which is not reserved"):
        a.publish("zz")
    with pytest.raises(ValidationError, match="publish takes a non-empty request id string; got ''"):
        a.publish("")
    plain = DiffusionKVAllocator(
        block_size=4, max_model_len=32, max_rows_per_request=2, worker_rows=8, pool=FreeListPool(8)
    )
    assert plain.reserve(kreq("a", 8, 4, (K[0], K[1]))) is not None
    assert plain.publish("a") is None and plain.generation == 1
    assert a.reserve(kreq("n", 8, 4)) is not None and a.publish("n") is None  # no keys: nothing
    with pytest.raises(ValidationError, match="prefix_cache must be a PrefixCache or None; got dict"):
        DiffusionKVAllocator(
            block_size=4,
            max_model_len=32,
            max_rows_per_request=2,
            worker_rows=8,
            pool=FreeListPool(8),
            prefix_cache={},  # type: ignore[arg-type]
        )


# -- 5. the registry's seal, on a real cpu worker ---------------------------------------------

H, HKV, D = 4, 2, 8
LAYERS = ("l0", "l1")


def cached_allocator(runner: PagedWorker, num_blocks: int = 48) -> DiffusionKVAllocator:
    """An allocator with a prefix cache describing ``runner``'s worker."""
    assert runner.layout is not None
    return DiffusionKVAllocator(
        block_size=BS,
        max_model_len=MAX_LEN,
        max_rows_per_request=2,
        worker_rows=runner.layout.max_num_reqs,
        pool=FreeListPool(num_blocks),
        prefix_cache=PrefixCache(),
    )


def make_runner(
    block: int = 4,
    num_blocks: int = 32,
    max_len: int = 64,
    modes: dict[str, AttentionMode] | None = None,
    kv_cache_dtype: str = "auto",
    k_scale: float = 1.0,
) -> PagedWorker:
    runner = PagedWorker(
        CpuPlatform(),
        RunnerConfig(
            max_model_len=max_len,
            max_rows_per_request=2,
            max_num_seqs=8,
            max_num_batched_tokens=512,
            kv_cache_dtype=kv_cache_dtype,
        ),
    )
    modes = modes or dict.fromkeys(LAYERS, AttentionMode.CAUSAL)
    runner.register_kv_cache_layers(
        {n: PagedLayerSpec(H, HKV, D, torch.float32, mode=m, k_scale=k_scale) for n, m in modes.items()}
    )
    runner.initialize_kv_cache(num_blocks=num_blocks, block_size=block)
    return runner


def write_rows(runner: PagedWorker, rows: list[PagedRow], layers: tuple[str, ...] = LAYERS) -> None:
    n = sum(r.query_len for r in rows)
    meta = AttentionMetadata(full_attn_spans=tuple(((r.seq_len - 4, r.seq_len),) for r in rows))
    with runner.stepper() as rt:
        rt.ensure_rows(rows)
        for layer in layers:
            x = torch.randn(n, H, D)
            runner.forward(layer, x, x[:, :HKV], x[:, :HKV], meta)


def seal_of(snap: RequestAllocation, cached: int) -> RequestAllocation:
    seqs = tuple(dataclasses.replace(s, cached_prefix_len=cached) for s in snap.sequences)
    return RequestAllocation(snap.request_id, snap.allocation_generation + 1, seqs, snap.contexts)


def test_a_seal_needs_written_tokens_and_lets_other_rows_share() -> None:
    runner = make_runner()
    reg = runner.registry
    assert reg is not None
    a = pc_alloc(num_blocks=32)
    pub = a.reserve(kreq("a", 8, 4, (K[0], K[1])))
    assert pub is not None and runner.install(pub) is True  # blocks 0, 1, 2
    sealed = seal_of(pub, 8)
    before = state_of(reg)
    with pytest.raises(
        StateError,
        match=r"row \('a', 0, None\) cannot seal its first 8 tokens .*\[\(0, 8\)\] were never written",
    ):
        runner.install(sealed)
    assert state_of(reg) == before and reg.generation_of("a") == 1
    # a reader before the seal: a's row still writes the blocks it would share
    reader = RequestAllocation(
        "b", 5, (dataclasses.replace(pub.sequences[0], block_ids=((0, 1, 7),), cached_prefix_len=8),)
    )
    with pytest.raises(
        ValidationError,
        match=r"block 0 lies in its cached prefix, but row \('a', 0, None\) of request 'a' writes it",
    ):
        runner.install(reader)
    assert state_of(reg) == before
    write_rows(runner, [PagedRow("a", 12, 12, 0, sequence_id=0)], layers=("l0",))  # one layer only
    with pytest.raises(StateError, match="never written"):  # not written until every layer ran
        runner.install(sealed)
    assert state_of(reg) == before
    write_rows(runner, [PagedRow("a", 12, 12, 0, sequence_id=0)])
    assert reg.written_spans(("a", 0, None)) == ((0, 12),)
    assert runner.install(sealed) is False  # a seal keeps the rows
    assert reg.generation_of("a") == 2 and reg.snapshot_of("a") == sealed
    assert reg.holders_of(0, 0) == {("a", 0, None): False} and reg.holders_of(0, 2) == {("a", 0, None): True}
    assert runner.resolve("a", 0).read_only_tokens == 8
    assert runner.install(sealed) is False and reg.generation_of("a") == 2  # idempotent
    assert runner.install(reader) is True  # shares blocks 0 and 1 read-only while a lives
    assert reg.holders_of(0, 1) == {("a", 0, None): False, ("b", 0, None): False}
    with pytest.raises(
        ValidationError, match=r"would write tokens \[0, 12\) inside its read-only cached prefix \[0, 8\)"
    ):
        write_rows(runner, [PagedRow("a", 12, 12, 0, sequence_id=0)])
    write_rows(runner, [PagedRow("a", 4, 12, 8, sequence_id=0), PagedRow("b", 4, 12, 8, sequence_id=0)])
    assert runner.remove("a") == 1 and reg.holders_of(0, 0) == {("b", 0, None): False}


def test_a_seal_that_changes_more_than_the_cached_prefix_is_a_conflict() -> None:
    runner = make_runner()
    reg = runner.registry
    assert reg is not None
    a = pc_alloc(num_blocks=32)
    pub = a.reserve(kreq("a", 8, 4, (K[0], K[1])))
    assert pub is not None and runner.install(pub)
    write_rows(runner, [PagedRow("a", 12, 12, 0, sequence_id=0)])
    row = pub.sequences[0]
    before = state_of(reg)
    for bad in (
        RequestAllocation("a", 2, (dataclasses.replace(row, block_ids=((0, 1, 9),), cached_prefix_len=8),)),
        RequestAllocation("a", 2, (dataclasses.replace(row, target_len=3, cached_prefix_len=8),)),
        RequestAllocation("a", 1, (dataclasses.replace(row, cached_prefix_len=8),)),  # not newer
    ):
        with pytest.raises(
            GenerationError, match="conflicting allocation snapshot for installed request 'a'"
        ):
            runner.install(bad)
        assert state_of(reg) == before
    assert runner.install(seal_of(pub, 4)) is False and runner.resolve("a", 0).read_only_tokens == 4
    after = state_of(reg)
    with pytest.raises(GenerationError, match="conflicting allocation snapshot"):  # never shrinks back
        runner.install(RequestAllocation("a", 3, (row,)))
    with pytest.raises(GenerationError, match="stale allocation generation 1 for request 'a'"):
        runner.install(RequestAllocation("a", 1, (dataclasses.replace(row, cached_prefix_len=8),)))
    assert state_of(reg) == after
    assert (
        runner.install(RequestAllocation("a", 3, (dataclasses.replace(row, cached_prefix_len=8),))) is False
    )
    assert runner.resolve("a", 0).read_only_tokens == 8 and reg.generation_of("a") == 3


# -- 6. the scheduler end to end --------------------------------------------------------------

BS = 8
VOCAB = 101
MAX_LEN = 64


def token(*parts: object) -> int:
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=4).digest(), "little") % VOCAB


def tokens(request: DiffusionRequest, sid: int, step: int) -> list[int]:
    """The row's token ids at ``step``: named prefix content by its key and offset (equal across
    requests), the rest of the prefix and the target (noise, changing per step) per request."""
    spans = request.prefix_content[sid] if request.prefix_content else ()
    out = []
    for p in range(request.seq_len):
        span = next((s for s in spans if s.start <= p < s.end), None)
        if span is not None:
            out.append(token("content", span.key, p - span.start))
        elif p < request.prefix_len:
            out.append(token("prefix", request.request_id, sid, p))
        else:
            out.append(token("target", request.request_id, sid, step, p))
    return out


class TwoLayerModel:
    """A two-layer model over the paged layers: ``l0``'s Q/K/V come from the token and position
    embeddings, ``l1``'s from ``l0``'s output, so a block's ``l1`` K/V depend on every token its
    queries reached in ``l0``. Projections run one token at a time, so a token's values never
    depend on what else is in the batch. Records every row's ``l1`` output per position."""

    def __init__(self, runner: PagedWorker, full: tuple[str, ...] = ()) -> None:
        g = torch.Generator().manual_seed(7)
        width = H * D
        self.runner = runner
        self.full = full  # layers registered non-causal, called without spans: every key
        self.emb = torch.randn(VOCAB, width, generator=g)
        self.pos = torch.randn(MAX_LEN, width, generator=g)
        self.w = [torch.randn(width, (H + 2 * HKV) * D, generator=g) * width**-0.5 for _ in LAYERS]
        self.out: dict[tuple[str, int, int], dict[int, torch.Tensor]] = {}
        self.rows: dict[tuple[str, int, int], tuple[int, int]] = {}

    def __call__(self, batch: StepBatch) -> None:
        ids: list[int] = []
        pos: list[int] = []
        where: list[tuple[str, int, int]] = []
        for e in batch.entries:
            for row in e.rows:
                sid = int(row.sequence_id or 0)
                toks = tokens(e.request, sid, e.step)
                span = range(row.kv_start_pos, row.kv_start_pos + row.query_len)
                ids += [toks[p] for p in span]
                pos += list(span)
                where += [(e.request.request_id, sid, e.step)] * row.query_len
                self.rows[(e.request.request_id, sid, e.step)] = (row.kv_start_pos, row.query_len)
        x = self.emb[ids] + self.pos[pos]
        meta = AttentionMetadata(full_attn_spans=batch.full_attn_spans)
        for name, w in zip(LAYERS, self.w, strict=True):
            qkv = torch.cat([x[i : i + 1] @ w for i in range(len(ids))])
            q, k, v = qkv.split([H * D, HKV * D, HKV * D], dim=1)
            o = self.runner.forward(
                name,
                q.reshape(-1, H, D),
                k.reshape(-1, HKV, D),
                v.reshape(-1, HKV, D),
                None if name in self.full else meta,
            )
            x = x + o.reshape(len(ids), H * D)
        for i, (key, p) in enumerate(zip(where, pos, strict=True)):
            self.out.setdefault(key, {})[p] = o[i].clone()


Schedule = list[list[DiffusionRequest]]
"""Requests submitted before each step."""


def run(
    schedule: Schedule,
    cached: bool,
    monkeypatch: pytest.MonkeyPatch,
    modes: dict[str, AttentionMode] | None = None,
    full: tuple[str, ...] = (),
    max_blocks: int | None = None,
) -> tuple[DiffusionScheduler, TwoLayerModel]:
    monkeypatch.setenv(ENV_BACKEND, "cpu:reference")
    runner = make_runner(block=BS, num_blocks=48, max_len=MAX_LEN, modes=modes)
    assert [b.name for b in runner.backends] == ["reference"] * len(runner.backends)
    assert runner.layout is not None
    alloc = DiffusionKVAllocator(
        block_size=BS,
        max_model_len=MAX_LEN,
        max_rows_per_request=2,
        worker_rows=runner.layout.max_num_reqs,
        pool=FreeListPool(48),
        num_groups=len(runner.layout.groups),
        prefix_cache=PrefixCache(max_blocks) if cached else None,
    )
    model = TwoLayerModel(runner, full)
    sched = DiffusionScheduler(runner, alloc, model_id="two-layer@1" if cached else None)
    for batch in schedule:
        for request in batch:
            sched.submit(request)
        sched.step(model)
    records = sched.run(model)
    assert {r.status.value for r in records.values()} == {"finished"}, {
        rid: r.error for rid, r in records.items()
    }
    return sched, model


def assert_same_outputs(cached: TwoLayerModel, plain: TwoLayerModel, exact: bool = True) -> None:
    """Every output the cached run computed equals the plain run's at the same request, row, step
    and position: bit for bit (torch.equal) when ``exact``, else within float32 rounding."""
    assert cached.out.keys() == plain.out.keys()
    for key, outs in cached.out.items():
        assert set(outs) <= set(plain.out[key]), key
        for p, o in outs.items():
            if exact:
                assert torch.equal(o, plain.out[key][p]), (key, p, (o - plain.out[key][p]).abs().max())
            else:
                torch.testing.assert_close(o, plain.out[key][p], rtol=1e-5, atol=1e-5, msg=f"{key} {p}")


def shared(rid: str, spans: tuple[tuple[int, int], ...] | None = None, **kw: Any) -> DiffusionRequest:
    content = kw.pop("content", ((ContentSpan(0, 36, "system"),), (ContentSpan(0, 20, "negative"),)))
    return DiffusionRequest(
        rid, 36, 8, steps=3, cfg_rows=2, full_attn_spans=spans, prefix_content=content, **kw
    )


def test_hits_compute_only_uncached_tokens_and_match_the_uncached_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Three requests with one prefix: the first and a twin admitted with it miss (the twin's
    blocks stay its own), the two admitted after the first's prefill hit -- row 0 from the cut
    32 (prefix 36, block 8), row 1 from 16 (its content names 20 tokens). Every attention output
    of the cached run equals the uncached run's exactly (torch.equal: the reference backend
    computes each row alone, the model one token at a time)."""
    schedule = [[shared("a"), shared("twin")], [shared("b"), shared("c")]]
    sched, model = run(schedule, True, monkeypatch)
    _, plain = run(schedule, False, monkeypatch)
    assert_same_outputs(model, plain)
    starts = {(rid, sid): model.rows[(rid, sid, 0)] for rid in ("a", "twin", "b", "c") for sid in (0, 1)}
    assert starts == {
        ("a", 0): (0, 44),
        ("a", 1): (0, 44),
        ("twin", 0): (0, 44),
        ("twin", 1): (0, 44),
        ("b", 0): (32, 12),
        ("b", 1): (16, 28),
        ("c", 0): (32, 12),
        ("c", 1): (16, 28),
    }
    assert (sched.prefix_hit_tokens, sched.prefix_hit_blocks) == (2 * (32 + 16), 2 * 6)
    cache = sched.allocator.prefix_cache
    assert cache is not None
    assert cache.stats() == {
        "cached_blocks": 6,
        "idle_blocks": 6,
        "hit_blocks": 12,
        "published_blocks": 6,
        "evictions": 0,
    }
    # 4 requests of 2 rows x 6 blocks; the hits shared 6 of their 12 each
    assert sched.peak_blocks_held == 4 * 12 - 2 * 6
    assert sched.allocator.pool.num_free == 48 - 6 and sched.allocator.blocks_held == 0
    keys = sched.prefix_keys(shared("x"))
    ns = sched.namespace(1)
    assert [len(k) for k in keys] == [4, 2]
    assert keys[1] == block_keys(shared("x").prefix_content[1], ns, 16, BS, ((36, 44),))
    assert ns == PrefixNamespace(
        "two-layer@1",
        "causal/8/torch.float32/pages float32/2x8/layers l0,l1",
        "cp 1:0:1, cfg 1:0, ParallelConfig(ulysses_degree=1, ring_degree=1, allgather_degree=1, "
        "ulysses_mode='strict')",
        None,
        1,
    )
    sched.close()


def test_a_span_inside_the_prefix_is_part_of_the_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tokens 0-3 attend to each other in x but not in a: their l1 K/V differ, so x must not hit."""
    schedule = [[shared("a")], [shared("x", ((0, 4), (36, 44)))]]
    sched, model = run(schedule, True, monkeypatch)
    _, plain = run(schedule, False, monkeypatch)
    assert model.rows[("x", 0, 0)] == (0, 44) and sched.prefix_hit_tokens == 0
    assert_same_outputs(model, plain)


def test_a_hit_never_stops_at_a_boundary_a_span_crosses(monkeypatch: pytest.MonkeyPatch) -> None:
    """The span (4, 12) crosses the block boundary 8: block 0's l1 K/V depend on tokens 8-11,
    where y's content differs from a's, so y must not reuse a's block 0."""
    spans = ((4, 12), (36, 44))
    other = ((ContentSpan(0, 8, "system"), ContentSpan(8, 36, "other")), (ContentSpan(0, 20, "negative"),))
    schedule = [[shared("a", spans)], [shared("y", spans, content=other), shared("z", spans)]]
    sched, model = run(schedule, True, monkeypatch)
    _, plain = run(schedule, False, monkeypatch)
    assert model.rows[("y", 0, 0)] == (0, 44) and model.rows[("z", 0, 0)] == (32, 12)
    assert model.rows[("y", 1, 0)] == (16, 28)  # row 1's own content is a's
    assert sched.prefix_hit_tokens == 16 + 32 + 16
    assert_same_outputs(model, plain)


def test_a_hit_inside_a_run_reuses_blocks_of_the_very_same_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """With room for one cached block, a publishes only block 0 of the run [0, 16) that (4, 12)
    joins; z, with a's content, hits it and starts inside the span at 8. Its outputs equal the
    uncached run's within float32 rounding (rtol = atol = 1e-5; the largest difference is under
    2e-6): block 0 was computed from the same run, but z's row now starts inside the span, so its
    attention is cut into different pieces than the uncached row's and summed in another order."""
    spans = ((4, 12), (36, 44))
    schedule = [[shared("a", spans)], [shared("z", spans)]]
    sched, model = run(schedule, True, monkeypatch, max_blocks=1)
    _, plain = run(schedule, False, monkeypatch)
    assert model.rows[("z", 0, 0)] == (8, 36) and model.rows[("z", 1, 0)] == (0, 44)
    assert sched.prefix_hit_tokens == 8
    assert_same_outputs(model, plain, exact=False)


def test_a_full_attention_layer_disables_prefix_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    """A layer registered non-causal (and called without spans) lets prefix queries reach the
    target: no prefix block may be shared."""
    modes = {"l0": AttentionMode.FULL, "l1": AttentionMode.CAUSAL}
    schedule = [[shared("a")], [shared("b")]]
    sched, model = run(schedule, True, monkeypatch, modes, full=("l0",))
    _, plain = run(schedule, False, monkeypatch, modes, full=("l0",))
    assert sched.prefix_keys(shared("x")) == () and sched.prefix_hit_tokens == 0
    assert_same_outputs(model, plain)


def test_prefix_caching_needs_a_model_id() -> None:
    runner = make_runner(block=BS, num_blocks=48, max_len=MAX_LEN)
    assert runner.layout is not None
    alloc = cached_allocator(runner)
    for bad in (None, ""):
        with pytest.raises(
            ValidationError,
            match=f"prefix caching needs the model/weights identity: pass model_id .*got {bad!r}",
        ):
            DiffusionScheduler(runner, alloc, model_id=bad)
    assert alloc.generation == 0


def test_no_content_different_adapters_and_branches_never_share(monkeypatch: pytest.MonkeyPatch) -> None:
    mirrored = ((ContentSpan(0, 20, "negative"),), (ContentSpan(0, 36, "system"),))
    schedule = [
        [shared("a")],
        [
            DiffusionRequest("plain", 36, 8, steps=3, cfg_rows=2),  # names no content
            shared("lora", adapter="lora-1"),
            shared("swapped", content=mirrored),  # a's row-0 content on row 1 and back
        ],
    ]
    sched, model = run(schedule, True, monkeypatch)
    assert sched.prefix_hit_tokens == 0
    assert {model.rows[(rid, sid, 0)] for rid in ("plain", "lora", "swapped") for sid in (0, 1)} == {(0, 44)}
    assert sched.prefix_keys(schedule[1][0]) == ()
    a_keys = sched.prefix_keys(shared("a"))
    for rid in ("lora", "swapped"):
        keys = sched.prefix_keys(next(r for r in schedule[1] if r.request_id == rid))
        assert set(keys[0] + keys[1]).isdisjoint(a_keys[0] + a_keys[1])
    cache = sched.allocator.prefix_cache
    assert cache is not None and len(cache) == 6 + 6 + 6  # a, lora and swapped published their own
    _, plain = run(schedule, False, monkeypatch)
    assert_same_outputs(model, plain)


def test_a_seal_the_worker_refuses_fails_the_request_and_publishes_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    runner = make_runner(block=BS, num_blocks=48, max_len=MAX_LEN)
    assert runner.layout is not None
    alloc = cached_allocator(runner)
    seal = runner.seal

    def refuse_seals(snapshot: RequestAllocation) -> bool:
        if any(s.cached_prefix_len for s in snapshot.sequences):
            raise StateError("injected seal refusal")
        return seal(snapshot)

    monkeypatch.setattr(runner, "seal", refuse_seals)
    with DiffusionScheduler(runner, alloc, model_id="m") as sched:
        sched.submit(shared("a"))
        report = sched.step(TwoLayerModel(runner))
        assert report is not None and report.failed == ("a",) and report.finished == ()
        record = sched.records["a"]
        assert (record.status.value, record.steps_done) == ("failed", 0)
        assert record.error == (
            "sealing its prefix for the prefix cache failed: StateError: injected seal refusal"
        )
        assert alloc.prefix_cache is not None and len(alloc.prefix_cache) == 0
        assert alloc.pool.num_free == 48 and alloc.generation == 1 and alloc.reserved() == ()
        assert runner.registry is not None and runner.registry.installed_requests() == ()


# -- 7. what else the identity covers: page dtype, fp8 scales, block size, layers, model --------

PREFIX = (ContentSpan(0, 32, "system"),)


def worker_keys(runner: PagedWorker, model: str = "m", block: int = BS) -> tuple[bytes, ...]:
    return row_prefix_keys(runner, worker_namespace(runner, model), PREFIX, 32, ((32, 40),), block)


def test_keys_differ_across_page_dtype_scales_block_size_layer_set_and_model() -> None:
    """A hit must never return pages written under another page dtype (16-bit vs e4m3), other
    fp8 scales, another block size, another set of layers or another model: each of those gives
    keys disjoint from the base worker's (and from each other's); the same worker built twice
    gives the same keys."""
    base = worker_keys(make_runner(block=BS))
    assert len(base) == 4
    assert worker_keys(make_runner(block=BS)) == base
    variants = {
        "fp8 pages": worker_keys(make_runner(block=BS, kv_cache_dtype="fp8_e4m3")),
        "fp8, k_scale 0.25": worker_keys(make_runner(block=BS, kv_cache_dtype="fp8_e4m3", k_scale=0.25)),
        "block 16": worker_keys(make_runner(block=16), block=16),
        "layers l0, l2": worker_keys(
            make_runner(block=BS, modes=dict.fromkeys(("l0", "l2"), AttentionMode.CAUSAL))
        ),
        "layers l0, l1, l2": worker_keys(
            make_runner(block=BS, modes=dict.fromkeys(("l0", "l1", "l2"), AttentionMode.CAUSAL))
        ),
        "model": worker_keys(make_runner(block=BS), model="m2"),
    }
    assert {name: len(keys) for name, keys in variants.items()} == {
        "fp8 pages": 4,
        "fp8, k_scale 0.25": 4,
        "block 16": 2,
        "layers l0, l2": 4,
        "layers l0, l1, l2": 4,
        "model": 4,
    }
    every = [base, *variants.values()]
    assert len({k for keys in every for k in keys}) == sum(len(keys) for keys in every)


def test_a_scale_set_at_run_time_changes_the_keys_and_setting_it_back_restores_them() -> None:
    runner = make_runner(block=BS, kv_cache_dtype="fp8_e4m3")
    before = worker_keys(runner)
    scales = runner.layers["l1"].kv_scales
    assert scales is not None and scales_version(runner) == 0
    scales.set([1.0, 0.1], 1.0)
    assert scales.values == ((1.0, 0.10000000149011612), (1.0, 1.0))  # as float32 holds them
    assert scales_version(runner) == 1
    changed = worker_keys(runner)
    assert set(changed).isdisjoint(before)
    with pytest.raises(ValidationError, match=r"layer 'l1' v_scale must be a finite positive number"):
        scales.set(0.5, [1.0, float("nan")])
    assert scales_version(runner) == 1 and worker_keys(runner) == changed  # nothing changed
    scales.set(1.0, 1.0)
    assert worker_keys(runner) == before and scales_version(runner) == 2


def fp8_scheduler(num_blocks: int = 48) -> tuple[DiffusionScheduler, TwoLayerModel]:
    runner = make_runner(block=BS, num_blocks=num_blocks, max_len=MAX_LEN, kv_cache_dtype="fp8_e4m3")
    return DiffusionScheduler(runner, cached_allocator(runner, num_blocks), model_id="m"), TwoLayerModel(
        runner
    )


def set_l0_k_scale(sched: DiffusionScheduler, value: float) -> None:
    scales = sched.runner.layers["l0"].kv_scales
    assert scales is not None
    scales.set(value, 1.0)


def test_after_a_scale_change_no_block_written_before_is_served(monkeypatch: pytest.MonkeyPatch) -> None:
    """a publishes its 6 prefix blocks under k_scale 1.0; after l0's k_scale becomes 0.5 the idle
    ones go back to the pool at the next step, and b (same content) computes its whole prefix
    and publishes its own, under keys of the new scales."""
    monkeypatch.setenv(ENV_BACKEND, "cpu:reference")
    sched, model = fp8_scheduler()
    cache = sched.allocator.prefix_cache
    assert cache is not None
    sched.submit(shared("a"))
    sched.run(model)
    old_keys = sched.prefix_keys(shared("x"))
    assert len(cache) == 6 and cache.num_idle == 6 and all(k in cache for k in old_keys[0] + old_keys[1])
    set_l0_k_scale(sched, 0.5)
    sched.submit(shared("b"))
    records = sched.run(model)
    assert records["b"].status.value == "finished"
    assert model.rows[("b", 0, 0)] == (0, 44) and model.rows[("b", 1, 0)] == (0, 44)
    assert sched.prefix_hit_tokens == 0
    new_keys = sched.prefix_keys(shared("x"))
    assert set(new_keys[0] + new_keys[1]).isdisjoint(old_keys[0] + old_keys[1])
    assert [k in cache for k in new_keys[0] + new_keys[1]] == [True] * 6
    assert cache.stats() == {
        "cached_blocks": 6,
        "idle_blocks": 6,
        "hit_blocks": 0,
        "published_blocks": 12,
        "evictions": 6,
    }
    assert sched.allocator.pool.num_free == 48 - 6 and sched.allocator.blocks_held == 0
    sched.close()


def test_a_request_submitted_before_a_scale_change_is_keyed_again_at_admission(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """b's keys were made under k_scale 1.0; it is admitted (and writes) under 0.5, so it
    publishes under the keys of 0.5 -- never under keys a request at 1.0 would look up."""
    monkeypatch.setenv(ENV_BACKEND, "cpu:reference")
    sched, model = fp8_scheduler()
    cache = sched.allocator.prefix_cache
    assert cache is not None
    old_keys = sched.prefix_keys(shared("x"))
    sched.submit(shared("b"))
    set_l0_k_scale(sched, 0.5)
    sched.run(model)
    new_keys = sched.prefix_keys(shared("x"))
    assert [k in cache for k in new_keys[0] + new_keys[1]] == [True] * 6
    assert not any(k in cache for k in old_keys[0] + old_keys[1])
    sched.close()


def test_a_scale_set_during_the_prefill_step_publishes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """The model callback sets l0's k_scale after l0 wrote a's prefix: a's pages hold the old
    scale, its keys neither old nor new describe them all -- nothing is published, the request
    still finishes and every block goes back to the pool."""
    monkeypatch.setenv(ENV_BACKEND, "cpu:reference")
    sched, model = fp8_scheduler()
    cache = sched.allocator.prefix_cache
    assert cache is not None

    def calibrate_then_run(batch: StepBatch) -> None:
        model(batch)
        if batch.tick == 0:
            set_l0_k_scale(sched, 0.5)

    sched.submit(shared("a"))
    records = sched.run(calibrate_then_run)
    assert records["a"].status.value == "finished" and records["a"].steps_done == 3
    assert len(cache) == 0 and cache.stats()["published_blocks"] == 0
    assert sched.allocator.pool.num_free == 48 and sched.allocator.blocks_held == 0
    sched.close()
