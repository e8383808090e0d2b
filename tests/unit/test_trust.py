"""The worker trusts nothing it is handed: ownership, provenance, generations, clean errors.

Each test states one guarantee of ``docs/architecture.md`` ("Guarantees") and checks that the
refusal names the facts and leaves every piece of state as it was.
"""

from __future__ import annotations

import gc
import math
import weakref
from typing import Any

import pytest
import torch

from diffusion_kv import (
    AttentionMetadata,
    AttentionMode,
    DiffusionKVError,
    GenerationError,
    KVPageLayout,
    NativeBackendError,
    StateError,
    UnknownLayerError,
    UnsupportedFeatureError,
    ValidationError,
)
from diffusion_kv.core.allocation import RequestAllocation, SequenceAllocation
from diffusion_kv.core.allocator import (
    AdmissionError,
    ContextRequest,
    DiffusionKVAllocator,
    FreeListPool,
    KVRequest,
    SequenceRequest,
)
from diffusion_kv.core.rows import PagedRow, PhaseRows
from diffusion_kv.core.runner import PagedLayerSpec, PagedWorker, ParallelConfig, RunnerConfig
from diffusion_kv.platforms.cpu import CpuPlatform
from diffusion_kv.platforms.cpu.backend import CpuReferenceBackend

from .registry_helpers import context, make_registry, request, seq, state_of

H, HKV, D, BS = 2, 1, 8, 4
LAYERS = ("l0", "l1")


def runner(
    platform: CpuPlatform | None = None, mode: AttentionMode = AttentionMode.CAUSAL, **cfg: Any
) -> PagedWorker:
    base: dict[str, Any] = dict(
        max_model_len=32, max_rows_per_request=2, max_num_seqs=3, max_num_batched_tokens=96
    )
    base.update(cfg)
    r = PagedWorker(platform or CpuPlatform(), RunnerConfig(**base))
    r.register_kv_cache_layers({n: PagedLayerSpec(H, HKV, D, torch.float32, mode=mode) for n in LAYERS})
    r.initialize_kv_cache(num_blocks=16, block_size=BS)
    return r


def snap(rid: str, gen: int, *rows: tuple[int, int, list[int]], cached: int = 0) -> RequestAllocation:
    """``rows[i] = (prefix_len, target_len, blocks)`` for sequence ``i``."""
    return RequestAllocation(
        rid,
        gen,
        tuple(
            SequenceAllocation(i, p, t, p + t, (tuple(b),), cached_prefix_len=cached)
            for i, (p, t, b) in enumerate(rows)
        ),
    )


def kv(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(tokens, H, D, generator=g),
        torch.randn(tokens, HKV, D, generator=g),
        torch.randn(tokens, HKV, D, generator=g),
    )


def forward_all(r: PagedWorker, rows: tuple[PagedRow, ...], seed: int, meta: Any = None) -> torch.Tensor:
    assert r.translator is not None
    q, k, v = kv(sum(x.query_len for x in rows), seed)
    batch = r.translator.prepare(rows)
    with r.translator.activate(batch):
        outs = [r.forward(name, q, k, v, meta) for name in LAYERS]
    return outs[0]


def caches(r: PagedWorker) -> list[torch.Tensor]:
    return [c.clone() for c in r.kv_caches.values()]  # type: ignore[union-attr]


# --- 1. block ownership ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("second", "message"),
    [
        (
            request("b", 0, (seq(0, 8, [5, 2]),)),
            r"row \('b', 0, None\) group 0: block 2 backs tokens this row writes, but row \('a', 0, None\) "
            r"of request 'a' holds it",
        ),
        (
            request("a2", 0, (seq(0, 4, [9]), seq(1, 4, [9]))),
            r"row \('a2', 1, None\) group 0: block 9 backs tokens this row writes, but row \('a2', 0, None\)",
        ),
        (
            request("c", 0, (seq(0, 4, [8], context_ids=("ref",)),), (context("ref", 4, [8]),)),
            r"row \('c', None, 'ref'\) group 0: block 8 .* row \('c', 0, None\) of request 'c'",
        ),
        (
            RequestAllocation("d", 0, (SequenceAllocation(0, 4, 4, 8, ((1, 6),), cached_prefix_len=4),)),
            r"row \('d', 0, None\) group 0: block 1 lies in its cached prefix, but row \('a', 0, None\) of "
            r"request 'a' writes it",
        ),
    ],
)
def test_a_written_block_belongs_to_one_live_row(second: RequestAllocation, message: str) -> None:
    reg, bt = make_registry()
    reg.install(request("a", 0, (seq(0, 8, [1, 2]),)))
    before, appends = state_of(reg), bt.appends
    with pytest.raises(ValidationError, match=message):
        reg.install(second)
    assert state_of(reg) == before and bt.appends == appends


def test_cached_prefix_blocks_are_shared_read_only() -> None:
    reg, _ = make_registry()
    shared = [SequenceAllocation(0, 8, 4, 12, ((3, 4, b),), cached_prefix_len=8) for b in (5, 6)]
    reg.install(RequestAllocation("a", 0, (shared[0],)))
    reg.install(RequestAllocation("b", 0, (shared[1],)))
    assert reg.holders_of(0, 3) == {("a", 0, None): False, ("b", 0, None): False}
    assert reg.holders_of(0, 5) == {("a", 0, None): True}
    # a third row may not write a block others read
    with pytest.raises(
        ValidationError, match=r"block 4 backs tokens this row writes, but row \('a', 0, None\)"
    ):
        reg.install(request("c", 0, (seq(0, 4, [4]),)))
    reg.remove(["a", "b"])
    assert reg.holders_of(0, 3) == {}
    reg.install(request("c", 0, (seq(0, 4, [4]),)))  # once nobody reads it, it may be written


def test_cached_prefix_must_be_whole_blocks() -> None:
    reg, _ = make_registry()
    with pytest.raises(
        ValidationError, match="cached_prefix_len 6 must be a multiple of group 0's 4 tokens per block"
    ):
        reg.install(
            RequestAllocation("a", 0, (SequenceAllocation(0, 8, 4, 12, ((1, 2, 3),), cached_prefix_len=6),))
        )


def test_a_row_never_writes_its_cached_prefix() -> None:
    r = runner()
    r.install(snap("a", 0, (8, 4, [1, 2, 3]), cached=8))
    assert r.translator is not None
    with pytest.raises(
        ValidationError, match=r"would write tokens \[4, 12\) inside its read-only cached prefix \[0, 8\)"
    ):
        r.translator.prepare((PagedRow("a", 8, 12, 4, sequence_id=0),))
    forward_all(r, (PagedRow("a", 4, 12, 8, sequence_id=0),), seed=1)  # the target over the cached prefix


# --- 2. monotonic generations --------------------------------------------------------------------


def test_generations_stay_monotonic_after_removal() -> None:
    reg, _ = make_registry()
    reg.install(request("a", 3))
    reg.remove("a")
    before = state_of(reg)
    for gen in (2, 3):  # late and duplicated delivery
        with pytest.raises(
            GenerationError,
            match=f"stale allocation generation {gen} for request 'a': the request was removed at generation 3",
        ):
            reg.install(request("a", gen))
        assert state_of(reg) == before
    assert reg.install(request("a", 4)) is True
    assert reg.removed_generation("a") is None  # installed again: no longer a removed id
    reg.remove([("a", 4)])
    assert reg.removed_generation("a") == 4


def test_generation_memory_is_bounded() -> None:
    reg, _ = make_registry(generation_memory=2)
    for rid in ("a", "b", "c"):
        reg.install(request(rid, 5, (seq(0, 4, [ord(rid) - 90]),)))
        reg.remove(rid)
    assert [reg.removed_generation(r) for r in ("a", "b", "c")] == [None, 5, 5]  # least recent forgotten
    with pytest.raises(GenerationError):
        reg.install(request("b", 5, (seq(0, 4, [1]),)))
    with pytest.raises(ValidationError, match="generation_memory must be an int >= 0"):
        make_registry(generation_memory=-1)


def test_retirement_refuses_every_snapshot_up_to_its_generation() -> None:
    reg, _ = make_registry()
    reg.install(request("a", 5))
    assert reg.install(request("a", 6)) is False  # a re-sent snapshot: recorded, rows kept
    assert reg.generation_high_water == 6
    assert reg.retire("a", 8) == 1  # the scheduler freed the blocks at its generation 8
    assert reg.removed_generation("a") == 8 and reg.generation_high_water == 8
    before = state_of(reg)
    for gen in (6, 7, 8):  # in flight when the request ended: never installed again
        with pytest.raises(
            GenerationError,
            match=f"stale allocation generation {gen} for request 'a': the request was removed at generation 8",
        ):
            reg.install(request("a", gen))
        assert state_of(reg) == before
    assert reg.install(request("a", 9)) is True  # a later reservation of the id
    with pytest.raises(
        GenerationError,
        match="request 'a' is installed at generation 9, newer than the retirement through generation 8",
    ):
        reg.retire("a", 8)
    assert reg.generation_of("a") == 9
    assert reg.retire("never-installed", 3) == 0  # a tombstone only
    with pytest.raises(GenerationError):
        reg.install(request("never-installed", 3, (seq(0, 4, [30]),)))
    for bad_id, bad_gen, fact in (
        ("", 1, "retire takes a non-empty request id string"),
        (["a"], 1, "retire takes a non-empty request id string"),
        ("a", -1, "through_generation must be an int >= 0; got -1"),
        ("a", 1.0, "through_generation must be an int >= 0; got 1.0"),
    ):
        before = state_of(reg)
        with pytest.raises(ValidationError, match=fact):
            reg.retire(bad_id, bad_gen)  # type: ignore[arg-type]
        assert state_of(reg) == before


def test_plain_removal_still_lets_a_newer_snapshot_install() -> None:
    """``remove`` is not for good (a preempted request may come back under a newer generation);
    ``retire`` is: the difference a late snapshot of a finished request makes."""
    reg, _ = make_registry()
    reg.install(request("a", 5))
    reg.remove("a")
    assert reg.install(request("a", 6)) is True


# --- 3. page provenance ---------------------------------------------------------------------------


def phases(rid: str, prefix: int, target: int, n: int = 1) -> PhaseRows:
    return PhaseRows(
        tuple(PagedRow(rid, prefix + target, prefix + target, 0, sequence_id=i) for i in range(n)),
        tuple(PagedRow(rid, target, prefix + target, prefix, sequence_id=i) for i in range(n)),
    )


def test_denoise_first_is_refused() -> None:
    r = runner()
    r.install(snap("a", 0, (8, 4, [1, 2, 3])))
    before = caches(r)
    with (
        r.activate(phases("a", 8, 4)) as runtime,
        pytest.raises(
            StateError,
            match=r"row \('a', 0, None\) would read tokens \[\(0, 8\)\] that were never written since its install",
        ),
    ):
        runtime.ensure_active(3)
    assert r.translator is not None and r.translator.active_batch is None
    assert all(torch.equal(a, b) for a, b in zip(before, caches(r), strict=True))


def test_a_new_request_never_reads_a_removed_requests_pages() -> None:
    """Request A fills blocks 1-3 and is removed; B gets the same blocks: B must write before it reads."""
    r = runner()
    r.install(snap("a", 0, (8, 4, [1, 2, 3])))
    forward_all(r, phases("a", 8, 4).prefill, seed=1)
    r.remove("a")
    r.install(snap("b", 0, (8, 4, [1, 2, 3])))
    assert r.translator is not None
    with pytest.raises(StateError, match=r"\('b', 0, None\) would read tokens \[\(0, 8\)\]"):
        r.translator.prepare(phases("b", 8, 4).denoise)
    forward_all(r, phases("b", 8, 4).prefill, seed=2)
    forward_all(r, phases("b", 8, 4).denoise, seed=3)


def test_a_write_counts_once_every_layer_ran() -> None:
    r = runner()
    r.install(snap("a", 0, (8, 4, [1, 2, 3])))
    assert r.translator is not None and r.registry is not None
    q, k, v = kv(12, 0)
    batch = r.translator.prepare(phases("a", 8, 4).prefill)
    with r.translator.activate(batch):
        r.forward("l0", q, k, v)  # l1 never ran: its pages of these tokens were not written
    assert r.registry.written_spans(("a", 0, None)) == ()
    with pytest.raises(StateError, match="never written"):
        r.translator.prepare(phases("a", 8, 4).denoise)
    forward_all(r, phases("a", 8, 4).prefill, seed=4)
    assert r.registry.written_spans(("a", 0, None)) == ((0, 12),)


def test_a_failed_backend_write_is_not_counted() -> None:
    class BrokenWriter(CpuReferenceBackend):
        def write_kv(self, layer: Any, *args: Any) -> None:
            if layer.layer_name == "l1":
                raise RuntimeError("device lost")
            super().write_kv(layer, *args)

    class Broken(CpuPlatform):
        backends = (BrokenWriter,)

    r = runner(Broken())
    r.install(snap("a", 0, (8, 4, [1, 2, 3])))
    with pytest.raises(
        NativeBackendError,
        match=r"platform 'cpu' backend 'reference' failed in layer 'l1' \(RuntimeError: device lost\)",
    ) as info:
        forward_all(r, phases("a", 8, 4).prefill, seed=1)
    assert isinstance(info.value.__cause__, RuntimeError)
    assert r.registry is not None and r.registry.written_spans(("a", 0, None)) == ()


def test_declared_cached_prefix_is_readable() -> None:
    r = runner()
    r.install(snap("a", 0, (8, 4, [1, 2, 3]), cached=8))
    assert r.registry is not None and r.registry.written_spans(("a", 0, None)) == ((0, 8),)
    forward_all(r, (PagedRow("a", 4, 12, 8, sequence_id=0),), seed=5)
    assert r.registry.written_spans(("a", 0, None)) == ((0, 12),)


# --- 4. scheduler side ------------------------------------------------------------------------------


def test_pool_free_is_atomic() -> None:
    pool = FreeListPool(8)
    taken = pool.allocate(3)
    assert taken == [0, 1, 2]
    for bad, message in (
        ([0, 0], "block 0 is listed twice"),
        ([1, 5], "block 5 is not allocated"),
        ([1, -1], "block id -1"),
        ([1, True], "block id True"),
        ("01", "sequence of block ids"),
    ):
        with pytest.raises(ValidationError, match=message):
            pool.free(bad)  # type: ignore[arg-type]
        assert pool.num_free == 5
    pool.free([0, 1])
    with pytest.raises(ValidationError, match="block 1 is not allocated"):
        pool.free([2, 1])
    assert pool.num_free == 7


def allocator() -> DiffusionKVAllocator:
    return DiffusionKVAllocator(
        block_size=4, max_model_len=32, max_rows_per_request=3, worker_rows=6, pool=FreeListPool(16)
    )


def test_reserve_under_a_reserved_id_with_another_shape_is_refused() -> None:
    a = allocator()
    first = a.reserve(KVRequest("r", (SequenceRequest(0, 4, 4),)))
    assert first is not None
    again = a.reserve(KVRequest("r", (SequenceRequest(0, 4, 4),)))
    assert again is not None and again.sequences == first.sequences
    with pytest.raises(AdmissionError, match="request 'r' is already reserved with a different shape"):
        a.reserve(KVRequest("r", (SequenceRequest(0, 4, 8),)))
    assert a.pool.num_free == 14 and a.blocks_of("r") == [0, 1]


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (KVRequest("r", (SequenceRequest(-1, 0, 4),)), "sequence_id must be an int >= 0; got -1"),
        (KVRequest("r", (SequenceRequest(True, 0, 4),)), "sequence_id must be an int >= 0; got True"),
        (KVRequest("r", (SequenceRequest("0", 0, 4),)), "sequence_id must be an int >= 0; got '0'"),  # type: ignore[arg-type]
        (KVRequest("r", (SequenceRequest(0, 1.5, 4),)), "prefix_len must be an int >= 0; got 1.5"),  # type: ignore[arg-type]
        (KVRequest("r", (SequenceRequest(0, 0, -4),)), "target_len must be an int >= 0; got -4"),
        (KVRequest("r", (SequenceRequest(0, True, 4),)), "prefix_len must be an int >= 0; got True"),
        (KVRequest("", (SequenceRequest(0, 0, 4),)), "request_id must be a non-empty string"),
        (KVRequest(7, (SequenceRequest(0, 0, 4),)), "request_id must be a non-empty string"),  # type: ignore[arg-type]
        (
            KVRequest("r", (SequenceRequest(0, 0, 4, ("",)),)),
            "context_ids must be a tuple of non-empty strings",
        ),
        (
            KVRequest("r", (SequenceRequest(0, 0, 4),), (ContextRequest("", "image", 4),)),
            "context_id must be a non-empty string",
        ),
        (
            KVRequest("r", (SequenceRequest(0, 0, 4),), (ContextRequest("c", "", 4),)),
            "cache_role must be a non-empty string",
        ),
        (
            KVRequest("r", (SequenceRequest(0, 0, 4),), (ContextRequest("c", "image", 2.0),)),  # type: ignore[arg-type]
            "num_tokens must be an int >= 0; got 2.0",
        ),
        (KVRequest("r", [SequenceRequest(0, 0, 4)]), "sequences must be a tuple of SequenceRequest"),  # type: ignore[arg-type]
    ],
)
def test_allocator_applies_the_workers_rules(bad: KVRequest, message: str) -> None:
    a = allocator()
    with pytest.raises(AdmissionError, match=message):
        a.reserve(bad)
    assert a.pool.num_free == 16 and a.reserved() == ()
    with pytest.raises(ValidationError, match="non-empty request id string"):
        a.free(None)  # type: ignore[arg-type]


# --- 5. removal entries -----------------------------------------------------------------------------


def test_remove_takes_one_id_or_many() -> None:
    reg, _ = make_registry()
    for rid, block in (("ac", 1), ("a", 2), ("c", 3)):
        reg.install(request(rid, 0, (seq(0, 4, [block]),)))
    assert reg.remove("ac") == 1  # the request 'ac', not 'a' and 'c'
    assert sorted(r for r, _, _ in reg.rows) == ["a", "c"]
    assert reg.remove(("a", 0)) == 1  # one generation-scoped entry
    before = state_of(reg)
    for bad in (None, 5, b"c", {"c": 0}, [None], [("c",)], [""]):
        with pytest.raises(ValidationError, match="remove takes|removal entry must be"):
            reg.remove(bad)  # type: ignore[arg-type]
        assert state_of(reg) == before
    with pytest.raises(ValidationError):
        PagedWorker(CpuPlatform(), RunnerConfig(32, 1, 1, 32)).remove(None)  # type: ignore[arg-type]


# --- 6. autograd ---------------------------------------------------------------------------------


@pytest.mark.parametrize("no_grad", [False, True])
def test_the_cache_never_joins_autograd(no_grad: bool) -> None:
    r = runner()
    r.install(snap("a", 0, (8, 4, [1, 2, 3])))
    assert r.translator is not None
    q, k, v = (t.requires_grad_() for t in kv(12, 0))
    batch = r.translator.prepare(phases("a", 8, 4).prefill)
    with r.translator.activate(batch), torch.set_grad_enabled(not no_grad):
        outs = [r.forward(name, q, k * 2, v * 2) for name in LAYERS]
    for cache in r.kv_caches.values():
        assert isinstance(cache, torch.Tensor)
        assert not cache.requires_grad and cache.grad_fn is None
    probe = weakref.ref(k)
    del q, k, v, outs, batch
    gc.collect()
    assert probe() is None  # nothing kept the key activations alive


# --- 7. attention semantics -------------------------------------------------------------------------


def dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    qh, kh, vh = (
        t.transpose(0, 1).double()
        for t in (q, k.repeat_interleave(H // HKV, 1), v.repeat_interleave(H // HKV, 1))
    )
    return torch.nn.functional.scaled_dot_product_attention(
        qh, kh, vh, is_causal=causal, scale=D**-0.5
    ).transpose(0, 1)


def masked_dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    qh, kh, vh = (
        t.transpose(0, 1).double()
        for t in (q, k.repeat_interleave(H // HKV, 1), v.repeat_interleave(H // HKV, 1))
    )
    return torch.nn.functional.scaled_dot_product_attention(
        qh, kh, vh, attn_mask=mask, scale=D**-0.5
    ).transpose(0, 1)


def test_spans_describe_the_mask_of_non_causal_layers_too() -> None:
    """vLLM-Omni's semantics (its paged adapter applies spans whatever the layer declares):
    HunyuanImage3's image attention is declared non-causal and passes ``full_attn_spans`` for its
    causal prompt and bidirectional image; without spans a full layer sees every key."""
    r = runner(mode=AttentionMode.FULL)
    r.install(snap("a", 0, (8, 4, [1, 2, 3])))
    rows = phases("a", 8, 4).prefill
    q, k, v = kv(12, 7)
    mask = torch.ones(12, 12, dtype=torch.bool).tril()
    mask[8:, 8:] = True  # causal prompt, bidirectional target span
    assert r.translator is not None
    with r.translator.activate(r.translator.prepare(rows)):
        spanned = r.forward("l0", q, k, v, AttentionMetadata(full_attn_spans=[[(8, 12)]]))
        full = r.forward("l1", q, k, v)
    torch.testing.assert_close(spanned.double(), masked_dense(q, k, v, mask), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(full.double(), dense(q, k, v, causal=False), atol=1e-5, rtol=1e-5)
    assert (spanned[:8] - full[:8]).abs().max() > 0.1  # the prompt rows differ: the mask matters


def test_mqa_batched_layout_with_one_token_per_row() -> None:
    r = runner()
    r.install(snap("a", 0, (0, 4, [1]), (0, 4, [2])))
    assert r.translator is not None
    forward_all(r, phases("a", 0, 4, n=2).prefill, seed=1)
    rows = tuple(PagedRow("a", 1, 4, 3, sequence_id=i) for i in range(2))
    q, k, v = kv(2, 9)
    batch = r.translator.prepare(rows)
    with r.translator.activate(batch):
        flat = r.forward("l0", q, k, v)
        batched = r.forward("l1", q.reshape(2, 1, H * D), k.reshape(2, 1, HKV * D), v.reshape(2, 1, HKV * D))
    assert batched.shape == (2, 1, H * D)
    torch.testing.assert_close(batched.reshape(2, H, D), flat, atol=0, rtol=0)


# --- 11. cache binding ------------------------------------------------------------------------------


class SeparatePages(CpuReferenceBackend):
    """The reference kernels over ``(key_cache, value_cache)`` pages."""

    name = "separate"
    page_layout = KVPageLayout.SEPARATE


class SeparateCpu(CpuPlatform):
    backends = (SeparatePages,)


def unbound(platform: CpuPlatform | None = None) -> PagedWorker:
    r = PagedWorker(platform or CpuPlatform(), RunnerConfig(32, 2, 3, 96))
    r.register_kv_cache_layers({n: PagedLayerSpec(H, HKV, D, torch.float32) for n in LAYERS})
    return r


def pages(*lead: int) -> torch.Tensor:
    return torch.zeros(*lead, 16, BS, HKV, D)


def bound_state(r: PagedWorker) -> tuple[Any, ...]:
    return (r.initialized, r.layout, r.registry, r.kv_caches, r.backends, dict(r.layers))


@pytest.mark.parametrize(
    ("caches", "fact"),
    [
        (
            lambda big: {"l0": big[0], "l1": big[0]},  # one host tensor bound as both layers' cache
            r"layer 'l0' \(bytes \[0x[0-9a-f]+, 0x[0-9a-f]+\)\) and layer 'l1' \(bytes .*\) share memory",
        ),
        (
            lambda big: {"l0": big[0], "l1": big[0, :, :]},  # the same memory through another view
            r"layer 'l0' .* and layer 'l1' .* share memory",
        ),
        (
            lambda big: {
                "l0": big.flatten(0, 2)[:32].view(2, 16, BS, HKV, D),
                "l1": big.flatten(0, 2)[16:48].view(2, 16, BS, HKV, D),
            },
            r"layer 'l0' .* and layer 'l1' .* share memory",  # overlapping slices of one buffer
        ),
        (
            lambda big: {"l0": big[0], "l1": big[1, :1].expand(2, 16, BS, HKV, D)},  # K and V alias
            r"layer 'l1' \(bytes .*\) addresses some bytes twice",
        ),
    ],
    ids=["same tensor", "same memory, new view", "overlapping slices", "broadcast view"],
)
def test_caches_that_share_memory_are_refused(caches: Any, fact: str) -> None:
    big = pages(2, 2)
    r = unbound()
    before = bound_state(r)
    with pytest.raises(ValidationError, match=r"^the given kv_caches: " + fact + r".*memory of its own"):
        r.initialize_kv_cache(num_blocks=16, block_size=BS, kv_caches=caches(big))
    assert bound_state(r) == before and not r.initialized
    assert torch.count_nonzero(big) == 0  # nothing was written through either binding


def test_a_layers_key_and_value_must_not_alias() -> None:
    k = pages()
    r = unbound(SeparateCpu())
    with pytest.raises(
        ValidationError, match=r"layer 'l0' \(key\) .* and layer 'l0' \(value\) .* share memory"
    ):
        r.initialize_kv_cache(
            num_blocks=16, block_size=BS, kv_caches={"l0": (k, k), "l1": (pages(), pages())}
        )
    assert not r.initialized


def test_a_plugin_allocating_one_cache_for_two_layers_is_a_native_error() -> None:
    shared = pages(2)

    class OneCache(CpuReferenceBackend):
        name = "one-cache"

        def allocate_kv_cache(self, layer: Any) -> Any:
            return shared

    class OneCacheCpu(CpuPlatform):
        backends = (OneCache,)

    r = unbound(OneCacheCpu())
    with pytest.raises(
        NativeBackendError,
        match=r"^the caches platform 'cpu' allocated: layer 'l0' .* and layer 'l1' .* share memory",
    ):
        r.initialize_kv_cache(num_blocks=16, block_size=BS)
    assert not r.initialized


def test_a_cache_that_requires_grad_cannot_be_bound() -> None:
    r = unbound()
    grad = pages(2).requires_grad_()
    with pytest.raises(
        ValidationError, match=r"kv_caches\['l1'\] requires grad; the KV cache never joins autograd"
    ):
        r.initialize_kv_cache(num_blocks=16, block_size=BS, kv_caches={"l0": pages(2), "l1": grad})
    assert not r.initialized and grad.grad_fn is None


@pytest.mark.parametrize(
    ("caches", "fact"),
    [
        (3, "kv_caches must map each paged layer name to its cache; got int"),
        ("l0", "kv_caches must map each paged layer name to its cache; got str"),
        ({"l0": None, "l1": None}, r"kv_caches\['l0'\] must be a tensor or a tuple of tensors; got NoneType"),
        ({"l0": (), "l1": ()}, r"kv_caches\['l0'\] must be a tensor or a tuple of tensors; got \[\]"),
    ],
)
def test_malformed_kv_caches_are_refused(caches: Any, fact: str) -> None:
    r = unbound()
    with pytest.raises(ValidationError, match=fact):
        r.initialize_kv_cache(num_blocks=16, block_size=BS, kv_caches=caches)
    assert not r.initialized


@pytest.mark.parametrize("layout", ["disjoint slices", "interleaved key/value"])
def test_disjoint_bindings_work_like_allocated_caches(layout: str) -> None:
    """Disjoint views of one host buffer (vLLM's layer slices; its key and value halves of one
    ``[..., 2 * D]`` tensor) are memory of their own: bound as is, and attention is exact."""
    if layout == "disjoint slices":
        big = pages(2, 2)
        given: dict[str, Any] = {"l0": big[0], "l1": big[1]}
        r = unbound()
    else:
        buf = torch.zeros(2, 16, BS, HKV, 2 * D)
        given = {n: (buf[i, ..., :D], buf[i, ..., D:]) for i, n in enumerate(LAYERS)}
        r = unbound(SeparateCpu())
    r.initialize_kv_cache(num_blocks=16, block_size=BS, kv_caches=given)
    assert all(r.kv_caches[n] is given[n] for n in LAYERS)  # zero-copy
    oracle = runner()
    for worker in (r, oracle):
        worker.install(snap("a", 0, (8, 4, [1, 2, 3])))
        worker.install(snap("b", 0, (8, 4, [4, 5, 6])))
    rows = (*phases("a", 8, 4).prefill, *phases("b", 8, 4).prefill)
    assert r.translator is not None and oracle.translator is not None
    q, k, v = kv(24, 3)
    outs = []
    for worker in (r, oracle):
        batch = worker.translator.prepare(rows)  # type: ignore[union-attr]
        with worker.translator.activate(batch):  # type: ignore[union-attr]
            outs.append([worker.forward(name, q, k * (i + 1), v * (i + 1)) for i, name in enumerate(LAYERS)])
    for got, want in zip(outs[0], outs[1], strict=True):
        torch.testing.assert_close(got, want, atol=0, rtol=0)
    assert not torch.equal(outs[0][0], outs[0][1])  # the layers kept their own K/V


# --- 10. errors ------------------------------------------------------------------------------------


def test_public_errors_are_in_the_hierarchy() -> None:
    r = runner()
    r.install(snap("a", 0, (0, 4, [1])))
    assert r.translator is not None
    q, k, v = kv(4, 0)
    batch = r.translator.prepare(phases("a", 0, 4).prefill)
    with r.translator.activate(batch):
        with pytest.raises(
            UnknownLayerError, match=r"unknown paged attention layer 'nope'; registered: \['l0', 'l1'\]"
        ):
            r.forward("nope", q, k, v)
        with pytest.raises(UnsupportedFeatureError, match="cannot read attention metadata of type dict"):
            r.forward("l0", q, k, v, {"full_attn_spans": [[(0, 2)]]})
        for bound in (1.5, True, torch.tensor(2.0)):
            with pytest.raises(ValidationError, match="full_attn_spans bounds must be integers"):
                r.forward("l0", q, k, v, AttentionMetadata(full_attn_spans=[[(0, bound)]]))  # type: ignore[list-item]
    for exc in (UnknownLayerError, UnsupportedFeatureError, GenerationError, NativeBackendError):
        assert issubclass(exc, DiffusionKVError)
    with pytest.raises(UnsupportedFeatureError, match="Ring"):
        PagedWorker(
            CpuPlatform(), RunnerConfig(32, 1, 1, 32, parallel=ParallelConfig(ring_degree=2))
        ).register_kv_cache_layers({"x": PagedLayerSpec(H, HKV, D, torch.float32)})
    for scale in (math.nan, math.inf, -1.0, 0.0, True):
        with pytest.raises(ValidationError, match="scale must be a finite positive number"):
            PagedWorker(CpuPlatform(), RunnerConfig(32, 1, 1, 32)).register_kv_cache_layers(
                {"x": PagedLayerSpec(H, HKV, D, torch.float32, scale=scale)}
            )
    with pytest.raises(ValidationError, match="prefix_len must be an int >= 0; got 2.0"):
        r.install(RequestAllocation("f", 0, (SequenceAllocation(0, 2.0, 2, 4, ((5,),)),)))  # type: ignore[arg-type]


def test_builder_failure_is_a_native_backend_error() -> None:
    class FailingBuild(CpuReferenceBackend):
        name = "failing-build"

        def build(self, batch: Any) -> Any:
            raise IndexError("table too narrow")

    class BadBuilder(CpuPlatform):
        backends = (FailingBuild,)

    r = runner(BadBuilder())
    r.install(snap("a", 0, (0, 4, [1])))
    assert r.translator is not None
    with pytest.raises(
        NativeBackendError,
        match=r"platform 'cpu' backend 'failing-build' failed to build metadata for KV-cache group 0 \(layers \['l0', 'l1'\]\) \(IndexError: table too narrow\)",
    ) as info:
        r.translator.prepare(phases("a", 0, 4).prefill)
    assert isinstance(info.value.__cause__, IndexError)
    assert r.translator.active_batch is None
