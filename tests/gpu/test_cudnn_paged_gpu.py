"""``cuda:cudnn`` on a GPU: cuDNN's paged SDPA over the plugin's pages equals dense attention,
writes nothing outside the batch's output, reuses its graph for a batch of the same shape, and
leaves causal batches to ``paged``'s ways; the conformance kit passes on it. Skipped without
CUDA (see conftest) and without the cuDNN frontend's Python package (``nvidia-cudnn-frontend``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from diffusion_kv.core.allocation import RequestAllocation, SequenceAllocation
from diffusion_kv.core.attention import AttentionMode
from diffusion_kv.core.rows import PagedRow
from diffusion_kv.core.runner import PagedLayerSpec, PagedWorker, RunnerConfig
from diffusion_kv.platforms.cuda.cudnn_paged import cudnn_paged_available
from diffusion_kv.platforms.selection import get_platform
from tests.kit_junit import run_kit

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or not cudnn_paged_available(),
    reason=f"needs CUDA and cuDNN's paged SDPA ({cudnn_paged_available().reason if torch.cuda.is_available() else 'no CUDA'})",
)


def _setup(
    rows: list[tuple[int, int]],
    heads: int,
    kv_heads: int,
    mode: AttentionMode,
    dtype: torch.dtype,
    page: int = 128,
) -> tuple[PagedWorker, list[torch.Tensor], list[torch.Tensor]]:
    dev = torch.device("cuda")
    runner = PagedWorker(
        get_platform("cuda"),
        RunnerConfig(
            max_model_len=max(s for _, s in rows),
            max_rows_per_request=len(rows),
            max_num_seqs=1,
            max_num_batched_tokens=sum(s for _, s in rows),
            device=dev,
            backend="cudnn",
        ),
    )
    runner.register_kv_cache_layers({"l": PagedLayerSpec(heads, kv_heads, 128, dtype, mode=mode)})
    blocks = sum(-(-s // page) for _, s in rows)
    runner.initialize_kv_cache(num_blocks=blocks + 1, block_size=page)
    order = torch.randperm(blocks + 1, generator=torch.Generator().manual_seed(0)).tolist()
    seqs, at = [], 0
    for i, (q, s) in enumerate(rows):
        n = -(-s // page)
        seqs.append(SequenceAllocation(i, s - q, q, s, (tuple(order[at : at + n]),)))
        at += n
    runner.install(RequestAllocation("r", 0, tuple(seqs)))
    gen = torch.Generator(device=dev).manual_seed(1)
    ks = [torch.randn(s, kv_heads, 128, generator=gen, device=dev, dtype=dtype) for _, s in rows]
    vs = [torch.randn(s, kv_heads, 128, generator=gen, device=dev, dtype=dtype) for _, s in rows]
    translator = runner.translator
    assert translator is not None
    prefill = translator.prepare(
        tuple(PagedRow("r", s, s, 0, sequence_id=i) for i, (_, s) in enumerate(rows))
    )
    with translator.activate(prefill):
        full = torch.zeros(sum(s for _, s in rows), heads, 128, device=dev, dtype=dtype)
        runner.forward("l", full, torch.cat(ks), torch.cat(vs))
    return runner, ks, vs


def _dense(
    rows: list[tuple[int, int]],
    query: torch.Tensor,
    ks: list[torch.Tensor],
    vs: list[torch.Tensor],
    causal: bool,
) -> torch.Tensor:
    from torch.nn.attention.bias import causal_lower_right

    outs = []
    heads, kv_heads = query.shape[1], ks[0].shape[1]
    for (q, s), k, v, qq in zip(rows, ks, vs, torch.split(query, [q for q, _ in rows]), strict=True):
        mask = causal_lower_right(q, s) if causal else None
        kt, vt = k.transpose(0, 1), v.transpose(0, 1)
        if heads != kv_heads:
            kt, vt = kt.repeat_interleave(heads // kv_heads, 0), vt.repeat_interleave(heads // kv_heads, 0)
        o = torch.nn.functional.scaled_dot_product_attention(
            qq.transpose(0, 1)[None], kt[None], vt[None], attn_mask=mask
        )
        outs.append(o[0].transpose(0, 1))
    return torch.cat(outs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("rows", "kv_heads"),
    [
        ([(1024, 1536), (1024, 1536)], 8),  # uniform rows (the image regime, small)
        ([(512, 1280), (640, 640), (1024, 2048), (512, 1280)], 8),  # mixed rows, ragged queries
        ([(512, 1280), (640, 640), (1024, 2048)], 2),  # GQA
    ],
)
def test_cudnn_paged_equals_dense_and_writes_only_its_output(
    rows: list[tuple[int, int]], kv_heads: int, dtype: torch.dtype
) -> None:
    heads = 8
    runner, ks, vs = _setup(rows, heads, kv_heads, AttentionMode.FULL, dtype)
    translator = runner.translator
    assert translator is not None
    batch = translator.prepare(
        tuple(PagedRow("r", q, s, s - q, sequence_id=i) for i, (q, s) in enumerate(rows))
    )
    md = batch.attn_metadata["l"]
    assert "cudnn" in md.extra, md.reason
    backend, layer, cache = runner.backends[0], runner.layers["l"], runner.kv_caches["l"]
    graphs = backend.cudnn_graphs  # type: ignore[attr-defined]
    built = graphs.builds  # the prefill in _setup took cuDNN too, with its own maxima
    tokens = sum(q for q, _ in rows)
    query = torch.randn(tokens, heads, 128, device="cuda", dtype=dtype)
    sentinel = torch.full((tokens + 4096, heads, 128), 7.0, device="cuda", dtype=dtype)
    out = sentinel[:tokens]
    got = backend.forward(layer, query, cache, md, out)
    torch.cuda.synchronize()
    assert got.data_ptr() == out.data_ptr()
    assert bool((sentinel[tokens:] == 7.0).all()), "cuDNN wrote past the batch's output"
    ref = _dense(rows, query, ks, vs, causal=False)
    assert float((got.float() - ref.float()).abs().max()) <= 2e-2
    assert graphs.builds == built + 1
    again = translator.prepare(
        tuple(PagedRow("r", q, s, s - q, sequence_id=i) for i, (q, s) in enumerate(rows))
    )
    second = backend.forward(layer, query, cache, again.attn_metadata["l"])
    assert graphs.builds == built + 1 and torch.equal(second, got)
    runner.remove(["r"])


def test_causal_batches_keep_paged_ways() -> None:
    rows = [(1024, 1536), (1024, 1536)]
    runner, ks, vs = _setup(rows, 8, 8, AttentionMode.CAUSAL, torch.bfloat16)
    translator = runner.translator
    assert translator is not None
    batch = translator.prepare(
        tuple(PagedRow("r", q, s, s - q, sequence_id=i) for i, (q, s) in enumerate(rows))
    )
    md = batch.attn_metadata["l"]
    assert "cudnn" not in md.extra
    query = torch.randn(2048, 8, 128, device="cuda", dtype=torch.bfloat16)
    got = runner.backends[0].forward(runner.layers["l"], query, runner.kv_caches["l"], md)
    assert float((got.float() - _dense(rows, query, ks, vs, causal=True).float()).abs().max()) <= 2e-2
    assert runner.backends[0].cudnn_graphs.builds == 0  # type: ignore[attr-defined]
    runner.remove(["r"])


def test_conformance_kit_passes_on_cudnn(tmp_path: Path) -> None:
    run = run_kit("cuda", "cudnn", tmp_path / "kit-cudnn.xml")
    assert run.returncode == 0, run.tail
    assert (run.counts.failures, run.counts.errors) == (0, 0), run.tail
    assert run.counts.passed > 0, run.counts
