"""One session's paged set-up for tests: a worker over ``layers`` alike (each with the policy's
mask), its KV cache, an allocator over a free-list pool of ``num_blocks`` and the
:class:`SessionCache` over them (one row per session, two worker rows)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from diffusion_kv import DiffusionKVAllocator, FreeListPool, PagedLayerSpec
from diffusion_kv.core.runner import PagedWorker, RunnerConfig
from diffusion_kv.core.sessions import SessionCache, SessionPolicy
from diffusion_kv.platforms.interface import Platform


def session_cache(
    platform: Platform,
    backend: str,
    policy: SessionPolicy,
    layers: Sequence[str],
    geometry: tuple[int, int, int],
    dtype: torch.dtype,
    *,
    device: torch.device,
    max_model_len: int,
    max_tokens: int,
    num_blocks: int,
    block_size: int,
) -> SessionCache:
    """``geometry``: (query heads, KV heads, head size) of every layer."""
    heads, kv_heads, head_size = geometry
    worker = PagedWorker(
        platform, RunnerConfig(max_model_len, 1, 2, max_tokens, device=device, backend=backend)
    )
    worker.register_kv_cache_layers(
        {name: PagedLayerSpec(heads, kv_heads, head_size, dtype, mode=policy.mask) for name in layers}
    )
    worker.initialize_kv_cache(num_blocks=num_blocks, block_size=block_size)
    alloc = DiffusionKVAllocator(
        block_size=block_size,
        max_model_len=max_model_len,
        max_rows_per_request=1,
        worker_rows=2,
        pool=FreeListPool(num_blocks),
    )
    return SessionCache(worker, alloc, policy)
