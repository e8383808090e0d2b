"""One CUDA graph per window-fill shape on a GPU (``PagedWorker.step_graphs``): a session stream
whose steps run through kept graphs gives exactly the eager stream's outputs and pages, capturing
once per shape on the Triton way (its chunks graph-equal once the window has filled) and once per
chunk on the gather + SDPA way (no graph key). Skipped without CUDA (see conftest)."""

from __future__ import annotations

import pytest
import torch

from diffusion_kv import get_platform
from diffusion_kv.core.batch import key_value_caches
from diffusion_kv.core.sessions import SessionCache, SessionPolicy
from tests.session_setup import session_cache

H, HKV, D, BLOCK = 8, 2, 128, 16
LAYERS = ("l0", "l1", "l2")


def _session(backend: str, policy: SessionPolicy) -> SessionCache:
    return session_cache(
        get_platform("cuda"),
        backend,
        policy,
        LAYERS,
        (H, HKV, D),
        torch.bfloat16,
        device=torch.device("cuda"),
        max_model_len=4096,
        max_tokens=1024,
        num_blocks=64,
        block_size=BLOCK,
    )


def _stream(
    cache: SessionCache, chunks: int, steps: int, graphs: bool, capture_unkeyed: bool = False
) -> tuple[list[torch.Tensor], int, int, int]:
    """``chunks`` chunks of ``steps`` steps, each step fresh Q/K/V for every layer (the same
    seeds either way); returns every step's output and, with ``graphs``, the captures, replays
    and eager steps of the worker's kept graphs."""
    worker = cache.worker
    session = cache.begin_session("s", 1)
    kept = worker.step_graphs(capture_unkeyed=capture_unkeyed) if graphs else None
    gen = torch.Generator(device="cuda").manual_seed(11)
    outs: list[torch.Tensor] = []

    def step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.stack([worker.forward(name, q[i], k[i], v[i]) for i, name in enumerate(LAYERS)])

    with torch.no_grad():
        for _ in range(chunks):
            chunk = cache.append_chunk(session)
            assert chunk is not None
            with worker.stepper() as runtime:
                for _ in range(steps):
                    runtime.ensure_rows(chunk.rows())
                    q = torch.randn(
                        len(LAYERS), chunk.tokens, H, D, device="cuda", generator=gen, dtype=torch.bfloat16
                    )
                    k, v = (
                        torch.randn(
                            len(LAYERS),
                            chunk.tokens,
                            HKV,
                            D,
                            device="cuda",
                            generator=gen,
                            dtype=torch.bfloat16,
                        )
                        for _ in range(2)
                    )
                    out = kept.run(step, q, k, v) if kept is not None else step(q, k, v)
                    outs.append(out.clone())
            cache.commit(chunk)
    torch.cuda.synchronize()
    return outs, (kept.captures if kept else 0), (kept.replays if kept else 0), (kept.eager if kept else 0)


@pytest.mark.parametrize("chunk_tokens", [64, 40])  # on block boundaries / cutting blocks
def test_triton_session_replays_one_graph_per_window_fill_shape(chunk_tokens: int) -> None:
    policy = SessionPolicy(chunk_tokens=chunk_tokens, window_chunks=3, sink_chunks=1)
    chunks, steps = 10, 3
    eager_cache = _session("triton", policy)
    eager, _, _, _ = _stream(eager_cache, chunks, steps, graphs=False)
    graph_cache = _session("triton", policy)
    replayed, captures, replays, unkeyed = _stream(graph_cache, chunks, steps, graphs=True)
    assert unkeyed == 0
    filled = policy.sink_chunks + (policy.window_chunks or 0)
    assert captures == filled + 1  # one per filling chunk, then one for every filled chunk
    assert replays == chunks * steps - captures
    for i, (a, b) in enumerate(zip(eager, replayed, strict=True)):
        assert torch.equal(a, b), i
    for name in LAYERS:
        for x, y in zip(
            key_value_caches(eager_cache.worker.kv_caches[name]),
            key_value_caches(graph_cache.worker.kv_caches[name]),
            strict=True,
        ):
            assert torch.equal(x, y)


def test_sdpa_session_steps_run_eagerly_or_capture_each_chunk_again() -> None:
    """The gather + SDPA way keys no batch: its steps run eagerly by default, and with
    ``capture_unkeyed`` each chunk is captured and replayed for its later steps -- the same
    outputs either way."""
    policy = SessionPolicy(chunk_tokens=64, window_chunks=2, sink_chunks=1)
    chunks, steps = 6, 3
    eager, _, _, _ = _stream(_session("sdpa", policy), chunks, steps, graphs=False)
    same, captures, replays, unkeyed = _stream(_session("sdpa", policy), chunks, steps, graphs=True)
    assert (captures, replays, unkeyed) == (0, 0, chunks * steps)
    replayed, captures, replays, unkeyed = _stream(
        _session("sdpa", policy), chunks, steps, graphs=True, capture_unkeyed=True
    )
    assert (captures, replays, unkeyed) == (chunks, chunks * (steps - 1), 0)
    for i, (a, b, c) in enumerate(zip(eager, same, replayed, strict=True)):
        assert torch.equal(a, b) and torch.equal(a, c), i


def test_the_session_bench_runs_the_paged_stream_under_graphs_too() -> None:
    """``bench --sections session`` on a CUDA device: the graphed paged stream agrees with the
    eager one exactly and captures once per window-fill shape on the Triton way."""
    from diffusion_kv.bench.session import session_bench

    s = session_bench(
        get_platform("cuda"),
        torch.device("cuda"),
        torch.bfloat16,
        "small",
        backend="triton",
        shape="small",
        overrides=dict(chunks=8, repeats=1),
    )
    r = s["by_backend"]["triton"]
    graphs = r["extra"]["graphs"]
    filled = r["shapes"]["window_filled_at"]
    assert graphs["captures"] == filled + 1
    assert graphs["replays"] == 8 * r["shapes"]["steps"] - graphs["captures"] and graphs["eager"] == 0
    assert graphs["max_abs_diff_vs_paged"] == 0.0
    assert r["graphs_vs_paged"] > 0 and r["pool_full_after"]
