"""Bucketed piecewise CUDA graphs (``diffusion_kv.models.buckets``) on a GPU: a replay equals the
eager step over the same padded token axis bit for bit (also after another bucket was captured
into the shared graph pool), agrees with the unpadded eager step within
the dtype's rounding, writes no page outside the batch's own slots, and a batch with more tokens
than the largest bucket runs eagerly. Skipped without CUDA (see conftest)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from diffusion_kv import (
    AttentionMetadata,
    DiffusionKVAllocator,
    FreeListPool,
    KVRequest,
    PagedLayerSpec,
    PagedRow,
    PagedWorker,
    RunnerConfig,
    SequenceRequest,
    get_platform,
)
from diffusion_kv.models.buckets import BucketGraphs
from diffusion_kv.models.tiny_dit import TinyDiT, TinyDiTConfig


def test_bucket_replay_equals_the_padded_eager_step_and_writes_only_its_slots() -> None:
    device = torch.device("cuda")
    cfg = TinyDiTConfig(hidden=256, heads=4, kv_heads=2, layers=2, dtype=torch.bfloat16, seed=3)
    model = TinyDiT(cfg).to(device).eval()
    prefix, target, rows = 200, 56, 2
    seq = prefix + target
    runner = PagedWorker(
        get_platform("cuda"),
        RunnerConfig(
            max_model_len=seq, max_rows_per_request=rows, max_num_seqs=1, max_num_batched_tokens=rows * seq
        ),
    )
    runner.register_kv_cache_layers(
        {n: PagedLayerSpec(cfg.heads, cfg.kv_heads, cfg.head_size, cfg.dtype) for n in model.layer_names}
    )
    layout = runner.initialize_kv_cache(num_blocks=64, block_size=16)
    allocator = DiffusionKVAllocator(
        block_size=16,
        max_model_len=seq,
        max_rows_per_request=rows,
        worker_rows=layout.max_num_reqs,
        pool=FreeListPool(64),
    )
    runner.install(
        allocator.reserve(KVRequest("r", tuple(SequenceRequest(i, prefix, target) for i in range(rows))))
    )
    gen = torch.Generator(device="cpu").manual_seed(0)
    spans = AttentionMetadata(full_attn_spans=[[(prefix, seq)]] * rows)

    def attention(name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return runner.forward(name, q[0], k[0], v[0], spans)[None]

    with torch.no_grad(), runner.stepper() as stepper:
        # step 0 (prefill) eagerly: every K/V written
        stepper.ensure_rows(tuple(PagedRow("r", seq, seq, 0, sequence_id=i) for i in range(rows)))
        x0 = torch.randn(1, rows * seq, cfg.hidden, generator=gen).to(device, cfg.dtype)
        pos0 = torch.arange(seq, device=device).repeat(rows)
        model.run_packed(x0, pos0, attention, torch.arange(rows * seq, device=device))
        stepper.deactivate()
        # the denoise batch: target tokens only
        stepper.ensure_rows(tuple(PagedRow("r", target, seq, prefix, sequence_id=i) for i in range(rows)))
        n = rows * target
        x = torch.randn(1, n, cfg.hidden, generator=gen).to(device, cfg.dtype)
        pos = torch.arange(prefix, seq, device=device).repeat(rows)
        out_index = torch.arange(n, device=device)
        buckets = BucketGraphs(model, (64, 128, 256), device)
        assert buckets.bucket_for(n) == 128 and buckets.bucket_for(257) is None
        slots = {int(s) for s in runner.translator.active_batch.common.slot_mappings[0].tolist()}  # type: ignore[union-attr]
        caches = {name: runner.executor.kv_caches[name].clone() for name in model.layer_names}  # type: ignore[union-attr]
        replayed = buckets.run(x, pos, attention, out_index).clone()
        replayed_again = buckets.run(x, pos, attention, out_index).clone()
        assert buckets.captured_buckets == (128,) and buckets.replays == 2 and buckets.capture_ms > 0
        # another bucket captured into the same graph pool: the first bucket's replays are unchanged
        buckets._capture(256)
        assert sorted(buckets.captured_buckets) == [128, 256]
        for graph in buckets._captured[256].graphs:  # its replays write their scratch in the pool
            graph.replay()
        assert torch.equal(buckets.run(x, pos, attention, out_index), replayed)
        # the same step eagerly over the bucket's padded token axis: the same kernels, the same bits
        pad = 128 - n

        def padded_attention(name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return F.pad(attention(name, q[:, :n], k[:, :n], v[:, :n]), (0, 0, 0, 0, 0, pad))

        eager_padded = model.run_packed(
            F.pad(x, (0, 0, 0, pad)), F.pad(pos, (0, pad)), padded_attention, out_index
        )
        eager = model.run_packed(x, pos, attention, out_index)
        assert torch.equal(replayed, eager_padded) and torch.equal(replayed, replayed_again)
        scale = float(eager.abs().max())
        assert float((replayed - eager).abs().max()) <= 4 * torch.finfo(cfg.dtype).eps * scale
        # pages: only the batch's own slots may differ from before the bucketed steps
        for name in model.layer_names:
            before, after = caches[name], runner.executor.kv_caches[name]  # type: ignore[union-attr]
            k_b, v_b = before.unbind(0)
            k_a, v_a = after.unbind(0)
            flat = k_a.shape[0] * k_a.shape[1]
            changed = ((k_b != k_a) | (v_b != v_a)).reshape(flat, -1).any(dim=1).nonzero().flatten().tolist()
            assert set(changed) <= slots, name
        # a batch above the largest bucket runs eagerly
        big = BucketGraphs(model, (64,), device)
        assert torch.equal(big.run(x, pos, attention, out_index), eager) and big.eager == 1
    runner.remove("r")
