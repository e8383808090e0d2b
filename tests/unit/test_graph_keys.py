"""One CUDA graph per window-fill shape (``PagedBackend.graph_key``, ``Translator.graph_key``):
the cuda plugin's Triton way under Triton's interpreter on the CPU (the GPU replays are in
``tests/gpu/test_session_graphs.py``).

Once a session's window has filled, its chunks' batches are graph-equal: the same kernels over
the same memory (the Triton BlockTables' persistent buffers, the backend's shared schedule),
refilled by each preparation. A graph replays the launches it recorded with the captured
metadata, so running a later chunk's layers with an earlier chunk's metadata objects must give
exactly what that chunk's own metadata gives -- which is what this checks, with no GPU. The
gather + SDPA way makes its indices per batch: no key, a graph per batch."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.cuda_interpreted import InterpretedCudaPlatform  # sets TRITON_INTERPRET first

pytest.importorskip("triton", reason="Triton is not installed (ci/bootstrap.sh installs it)")

from diffusion_kv.core.sessions import SessionCache, SessionPolicy
from tests.session_setup import session_cache

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(torch.cuda.is_available(), reason="GPU present: tests/gpu covers the real kernels"),
]

H, HKV, D, BLOCK = 4, 2, 64, 16
LAYERS = ("l0", "l1")


def _session(backend: str, policy: SessionPolicy) -> SessionCache:
    return session_cache(
        InterpretedCudaPlatform(),
        backend,
        policy,
        LAYERS,
        (H, HKV, D),
        torch.float32,
        device=torch.device("cpu"),
        max_model_len=1024,
        max_tokens=256,
        num_blocks=16,
        block_size=BLOCK,
    )


def _stream(
    cache: SessionCache, chunks: int, captured_from: int | None = None
) -> tuple[list[Any], list[torch.Tensor]]:
    """``chunks`` chunks of two denoise steps (fresh K/V each step) through both layers. Each
    chunk's translator graph key is recorded at its preparation. With ``captured_from``, every
    chunk from that one on runs its layers with the metadata objects of chunk
    ``captured_from`` -- what a graph captured there replays -- instead of its own."""
    worker = cache.worker
    translator = worker.translator
    assert translator is not None
    session = cache.begin_session("s", 1)
    gen = torch.Generator().manual_seed(7)
    keys: list[Any] = []
    outs: list[torch.Tensor] = []
    captured: dict[str, Any] | None = None
    for index in range(chunks):
        chunk = cache.append_chunk(session)
        assert chunk is not None
        with worker.stepper() as runtime:
            for step in range(2):
                batch = runtime.ensure_rows(chunk.rows())
                if step == 0:
                    keys.append(translator.graph_key(batch))
                    if captured_from is not None and index == captured_from:
                        captured = dict(batch.attn_metadata)
                    if captured is not None:
                        batch.attn_metadata.update(captured)  # type: ignore[attr-defined]
                for name in LAYERS:
                    q = torch.randn(chunk.tokens, H, D, generator=gen)
                    k, v = (torch.randn(chunk.tokens, HKV, D, generator=gen) for _ in range(2))
                    outs.append(worker.forward(name, q, k, v).clone())
        cache.commit(chunk)
    return keys, outs


@pytest.mark.parametrize(
    "policy",
    [
        SessionPolicy(chunk_tokens=16, window_chunks=2, sink_chunks=1),  # chunks on block boundaries
        SessionPolicy(chunk_tokens=24, window_chunks=2, sink_chunks=1),  # chunks cutting blocks
    ],
    ids=["aligned", "cutting"],
)
def test_a_filled_windows_chunks_share_a_graph_and_replay_exactly(policy: SessionPolicy) -> None:
    chunks = 9
    keys, eager = _stream(_session("triton", policy), chunks)
    assert all(k is not None for k in keys)
    # chunk c reads the sink and its window (its own chunk included) once c >= filled, wherever
    # it starts in a block and however the session compacted its row: the kernel finds each
    # query's keys on the device, so the launch does not change
    filled = policy.sink_chunks + (policy.window_chunks or 0)
    assert len(set(keys[filled:])) == 1
    assert len(set(keys[:filled])) == filled  # the window filling: a new shape each chunk
    assert keys[filled] not in keys[:filled]
    # replaying the first steady chunk's launches for every later chunk (which start at other
    # places in their blocks when the chunks cut blocks)
    for start in (filled,):
        keys2, replayed = _stream(_session("triton", policy), chunks, captured_from=start)
        assert [keys2.index(k) for k in keys2] == [keys.index(k) for k in keys]  # another worker's memory
        per_chunk = 2 * len(LAYERS)
        for c in range(start, chunks):
            for i in range(c * per_chunk, (c + 1) * per_chunk):
                assert torch.equal(replayed[i], eager[i]), (c, i)


def test_the_gather_sdpa_way_keys_no_batch() -> None:
    keys, _ = _stream(_session("sdpa", SessionPolicy(chunk_tokens=16, window_chunks=2, sink_chunks=1)), 5)
    assert keys == [None] * 5
