"""The session path's host fast paths give exactly what the general paths give (issue 38's CPU
host work): the block plan in Python ints against the tensor path and the dense mask, the
registry's released runs against a place-by-place walk."""

from __future__ import annotations

import json
import random

import pytest
import torch

from diffusion_kv.core.allocation import NULL_BLOCK, RequestAllocation, SequenceAllocation
from diffusion_kv.core.allocator import DiffusionKVAllocator, FreeListPool, KVRequest, SequenceRequest
from diffusion_kv.core.attention import AttentionMode, BlockKind, MaskSpec, build_block_plan
from diffusion_kv.core.attention.plan import _row_block_kinds_tensor, row_block_kinds
from diffusion_kv.core.errors import GenerationError, ValidationError
from diffusion_kv.core.registry import RowInstall, RowRegistry, RowTransition
from diffusion_kv.core.rows import PagedRow
from diffusion_kv.core.runner import PagedLayerSpec, PagedWorker, RunnerConfig
from diffusion_kv.core.sessions import Chunk
from diffusion_kv.platforms.cpu import CpuPlatform

CHUNK = AttentionMode.CHUNK_CAUSAL


def _dense_kinds(
    spec: MaskSpec, offset: int, query_len: int, seq_len: int, block: int, live_from: int
) -> list[int]:
    dense = spec.row_mask(offset, query_len, seq_len, live_from=live_from)
    out = []
    for b in range(-(-seq_len // block)):
        cols = dense[:, b * block : (b + 1) * block]
        out.append(
            int(BlockKind.SKIP if not cols.any() else BlockKind.FULL if cols.all() else BlockKind.PARTIAL)
        )
    return out


def test_block_plan_fast_path_matches_the_tensor_path_and_the_dense_mask() -> None:
    rng = random.Random(38)
    served = 0
    for _ in range(600):
        kind = rng.choice([CHUNK, CHUNK, AttentionMode.FULL])
        chunk = rng.randint(1, 9) if kind is CHUNK else None
        window = rng.choice([None, rng.randint(1, 5) * (chunk or rng.randint(1, 7))])
        sink = rng.randint(0, 12) if window is not None else 0
        spec = MaskSpec(kind, chunk=chunk, window=window, sink=sink)
        seq_len = rng.randint(1, 120)
        query_len = rng.randint(1, seq_len)
        offset = rng.randint(0, seq_len - query_len)
        block = rng.randint(1, 16)
        live_from = rng.choice([0, 0, rng.randint(0, seq_len)]) if window is not None else 0
        assert spec.query_runs(offset, query_len, seq_len, live_from) is not None
        fast = row_block_kinds(spec, offset, query_len, seq_len, block, live_from=live_from)
        slow = _row_block_kinds_tensor(spec, offset, query_len, seq_len, block, live_from=live_from)
        assert fast.dtype == slow.dtype == torch.int8
        assert fast.tolist() == slow.tolist(), (spec, offset, query_len, seq_len, block, live_from)
        assert fast.tolist() == _dense_kinds(spec, offset, query_len, seq_len, block, live_from)
        served += 1
    assert served == 600


def test_block_plan_fast_path_on_long_rows_and_many_chunks_matches_the_tensor_path() -> None:
    """Rows of thousands of keys in blocks of 16-128 (a block cut at seq_len, a sink ending inside
    a block, a window starting inside one) and queries spanning up to 12 chunks (one bound each)."""
    rng = random.Random(3838)
    for _ in range(200):
        chunk = rng.choice([16, 48, 64, 100, 128])
        window = rng.randint(1, 6) * chunk
        sink = rng.choice([0, chunk, rng.randint(1, 3 * chunk)])
        spec = MaskSpec(CHUNK, chunk=chunk, window=window, sink=sink)
        seq_len = rng.randint(chunk, 6000)
        query_len = rng.randint(1, min(seq_len, 12 * chunk))
        offset = seq_len - query_len if rng.random() < 0.7 else rng.randint(0, seq_len - query_len)
        block = rng.choice([16, 32, 64, 128, rng.randint(1, 130)])
        live_from = rng.choice([0, 0, rng.randint(0, seq_len)])
        fast = row_block_kinds(spec, offset, query_len, seq_len, block, live_from=live_from)
        slow = _row_block_kinds_tensor(spec, offset, query_len, seq_len, block, live_from=live_from)
        assert fast.tolist() == slow.tolist(), (spec, offset, query_len, seq_len, block, live_from)


def test_block_plan_of_a_long_session_row() -> None:
    """A chunk at position 640 of a sink 1 + window 3 session (64-token chunks, blocks of 16):
    the sink's 4 blocks and the window's 16 blocks (three chunks and the chunk itself) are FULL,
    the 20 released blocks between them SKIP."""
    spec = MaskSpec(CHUNK, chunk=64, window=4 * 64, sink=64)
    plan = build_block_plan(spec, [640], [64], [704], 16)
    expected = [2] * 4 + [0] * 24 + [2] * 16
    assert plan.kinds[0].tolist() == expected
    assert _row_block_kinds_tensor(spec, 640, 64, 704, 16).tolist() == expected


def test_causal_masks_take_the_tensor_path() -> None:
    spec = MaskSpec(AttentionMode.CAUSAL, window=6, sink=2)
    assert spec.query_runs(10, 6, 16) is None
    assert row_block_kinds(spec, 10, 6, 16, 4).tolist() == _dense_kinds(spec, 10, 6, 16, 4, 0)


def _released_naive(ids: tuple[int, ...], token_len: int, per_block: int) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for p, b in enumerate(ids):
        if b != NULL_BLOCK:
            continue
        start, end = p * per_block, min((p + 1) * per_block, token_len)
        if out and out[-1][1] == start:
            out[-1] = (out[-1][0], end)
        else:
            out.append((start, end))
    return out


def test_released_token_runs_match_a_place_by_place_walk() -> None:
    rng = random.Random(42)
    for _ in range(300):
        per_block = rng.randint(1, 16)
        places = rng.randint(0, 60)
        ids = tuple(NULL_BLOCK if rng.random() < 0.5 else rng.randint(0, 999) for _ in range(places))
        token_len = max(0, (places - 1) * per_block + rng.randint(1, per_block)) if places else 0
        install = RowInstall(("r", 0, None), token_len, (ids,))
        assert RowRegistry._released_tokens(install, 0, per_block) == _released_naive(
            ids, token_len, per_block
        )
    # a long session row: the sink, one run of released places, the live window
    ids = (1, 2, 3, 4) + (NULL_BLOCK,) * 2396 + tuple(range(5, 25))
    install = RowInstall(("s", 0, None), 2420 * 16, (ids,))
    assert RowRegistry._released_tokens(install, 0, 16) == [(64, 2400 * 16)]


def test_allocator_row_changes_build_the_records_the_constructor_builds() -> None:
    """extend, release and truncate build their sequence records without dataclasses.replace:
    each equals the constructor's record of the same fields, and installs as before."""
    allocator = DiffusionKVAllocator(
        block_size=4, max_model_len=64, max_rows_per_request=2, worker_rows=4, pool=FreeListPool(24)
    )
    first = allocator.reserve(KVRequest("s", (SequenceRequest(0, 0, 8), SequenceRequest(1, 0, 8))))
    assert first is not None
    extended = allocator.extend("s", None, 8)
    released = allocator.release("s", None, [0])
    truncated = allocator.truncate("s", None, 4)
    assert extended is not None
    for snap in (extended, released, truncated):
        for seq in snap.sequences:
            rebuilt = SequenceAllocation(
                seq.sequence_id,
                seq.prefix_len,
                seq.target_len,
                seq.seq_len,
                seq.block_ids,
                seq.context_ids,
                seq.cached_prefix_len,
            )
            assert rebuilt == seq and hash(rebuilt) == hash(seq)
            assert type(seq.block_ids) is tuple and all(type(g) is tuple for g in seq.block_ids)
    assert [s.seq_len for s in extended.sequences] == [16, 16]
    assert [s.target_len for s in truncated.sequences] == [12, 12]
    assert released.sequences[0].block_ids[0][0] == NULL_BLOCK
    assert truncated.sequences[1].block_ids[0] == released.sequences[1].block_ids[0][:3]
    assert allocator.generation == first.allocation_generation + 3


def test_a_chunk_builds_its_rows_once() -> None:
    chunk = Chunk("s", 3, 192, 64, 2)
    rows = chunk.rows()
    assert chunk.rows() is rows
    assert rows == (PagedRow("s", 64, 256, 192, sequence_id=0), PagedRow("s", 64, 256, 192, sequence_id=1))
    assert chunk == Chunk("s", 3, 192, 64, 2)  # the cached rows take no part in equality


def _session_worker(num_blocks: int) -> PagedWorker:
    worker = PagedWorker(CpuPlatform(), RunnerConfig(64, 1, 2, 64, device=torch.device("cpu")))
    spec = MaskSpec(CHUNK, chunk=4, window=8, sink=4)
    worker.register_kv_cache_layers({"l0": PagedLayerSpec(2, 2, 8, torch.float32, mode=spec)})
    worker.initialize_kv_cache(num_blocks=num_blocks, block_size=4)
    return worker


def _snapshot(gen: int, ids: tuple[int, ...]) -> RequestAllocation:
    n = 4 * len(ids)
    return RequestAllocation("s", gen, (SequenceAllocation(0, 0, n, n, (ids,)),))


def test_slid_row_snapshots_are_told_apart_as_before() -> None:
    """The registry's C-level comparisons of a slid row: an EXTEND and a SLIDE install; a place
    that changes its block (a replacement) or a released sink place is refused, the row as it was."""
    worker = _session_worker(16)
    registry = worker.registry
    assert registry is not None
    worker.install(_snapshot(1, (3, 4, 5)))
    worker.install(_snapshot(2, (3, 4, 5, 6, 7)))  # EXTEND
    assert registry.last_transitions == frozenset({RowTransition.EXTEND})
    worker.install(_snapshot(3, (3, NULL_BLOCK, NULL_BLOCK, 6, 7, 8)))  # SLIDE and EXTEND
    assert registry.last_transitions == frozenset({RowTransition.SLIDE, RowTransition.EXTEND})
    before = (registry.snapshot_of("s"), registry.holders_of(0, 4), registry.holders_of(0, 6))
    with pytest.raises(GenerationError, match="conflicting allocation snapshot for installed request 's'"):
        worker.install(_snapshot(4, (3, NULL_BLOCK, NULL_BLOCK, 9, 7, 8)))  # place 3: block 6 -> 9
    with pytest.raises(GenerationError, match="conflicting allocation snapshot"):
        worker.install(_snapshot(4, (3, NULL_BLOCK, 4, 6, 7, 8)))  # a released place holds a block again
    with pytest.raises(
        ValidationError, match=r"releases blocks \[0\], which hold sink or cached-prefix tokens"
    ):
        worker.install(_snapshot(4, (NULL_BLOCK, NULL_BLOCK, NULL_BLOCK, 6, 7, 8)))
    assert (registry.snapshot_of("s"), registry.holders_of(0, 4), registry.holders_of(0, 6)) == before
    assert registry.holders_of(0, 4) == {} and registry.holders_of(0, 6) == {("s", 0, None): True}


def test_the_medium_session_shape_runs_from_the_cli(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``bench --session-shape medium``: the second CPU shape's figures under its own name (its
    sizes cut down here, its layers and window kept)."""
    from diffusion_kv.bench import session
    from diffusion_kv.cli import main

    assert session.MEDIUM["hidden"] == 512 and session.MEDIUM["chunk_tokens"] == 128
    assert session.MEDIUM["layers"] == 4 and session.SHAPES["medium"] is session.MEDIUM
    tiny = dict(chunks=7, chunk_tokens=8, hidden=32, heads=2, kv_heads=2, text_tokens=4, steps=2, repeats=1)
    monkeypatch.setitem(session.SHAPES, "medium", {**session.MEDIUM, **tiny})
    argv = ["bench", "--sections", "session", "--session-shape", "medium", "--backend", "sdpa"]
    assert main([*argv, "--json", "--no-progress"]) == 0
    s = json.loads(capsys.readouterr().out)["session"]
    assert s["shape_name"] == "medium" and s["backend"] == "sdpa"
    assert (
        s["shapes"]["layers"] == 4 and s["shapes"]["window_chunks"] == 3 and s["shapes"]["chunk_tokens"] == 8
    )
    assert s["agrees"] and s["pool_full_after"] and s["ideal_vs_recompute"] == 5.0
    assert s["bytes_copied_per_chunk"] == s["chunk_kv_bytes"] == 8 * 4 * 2 * 2 * 16 * 4


def test_key_mask_by_query_runs_matches_the_per_query_tensor_path() -> None:
    rng = random.Random(6)
    for _ in range(400):
        kind = rng.choice([CHUNK, CHUNK, AttentionMode.FULL, AttentionMode.CAUSAL])
        chunk = rng.randint(1, 9) if kind is CHUNK else None
        window = rng.choice([None, rng.randint(1, 5) * (chunk or rng.randint(1, 7))])
        sink = rng.randint(0, 12) if window is not None else 0
        spec = MaskSpec(kind, chunk=chunk, window=window, sink=sink)
        seq_len = rng.randint(1, 120)
        query_len = rng.randint(1, seq_len)
        offset = rng.randint(0, seq_len - query_len)
        live_from = rng.choice([0, rng.randint(0, offset)]) if window is not None else 0
        keys = torch.tensor(sorted(rng.sample(range(seq_len), rng.randint(1, seq_len))), dtype=torch.int32)
        fast = spec.key_mask(offset, query_len, seq_len, keys, live_from=live_from)
        slow = spec._key_mask_tensor(offset, query_len, seq_len, keys, live_from=live_from)
        assert fast.dtype == torch.bool and fast.shape == (query_len, keys.numel()) and fast.is_contiguous()
        assert torch.equal(fast, slow), (spec, offset, query_len, seq_len, live_from)
        dense = spec.row_mask(offset, query_len, seq_len, live_from=live_from)
        assert torch.equal(fast, dense[:, keys.long()])
    assert MaskSpec(CHUNK, chunk=4, window=8, sink=4).query_runs(6, 7, 13) == [
        (2, 0, 8),
        (4, 4, 12),
        (1, 8, 13),
    ]
    assert MaskSpec(AttentionMode.CAUSAL, window=4).query_runs(0, 3, 3) is None
