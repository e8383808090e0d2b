"""``core.memory``: which bytes a tensor addresses, and whether two tensors share one."""

from __future__ import annotations

import random

import pytest
import torch

from diffusion_kv.core.memory import footprint, internal_overlap, overlap, shared_memory

BASE = torch.zeros(4096, dtype=torch.float16)


def addresses(t: torch.Tensor) -> set[int]:
    """Every byte ``t`` addresses, by enumeration (the independent statement)."""
    item = t.element_size()
    out = {t.data_ptr()}
    for stride, size in zip(t.stride(), t.shape, strict=True):
        out = {a + i * stride * item for a in out for i in range(size)}
    return {a + b for a in out for b in range(item)}


def random_view(rng: random.Random) -> torch.Tensor:
    dims = rng.randint(1, 3)
    shape = [rng.randint(1, 5) for _ in range(dims)]
    stride = [rng.choice((0, 1, 2, 3, 4, 6, 8, 16, 24, 32, 64)) for _ in range(dims)]
    reach = sum((n - 1) * s for n, s in zip(shape, stride, strict=True))
    return BASE.as_strided(shape, stride, rng.randint(0, BASE.numel() - 1 - reach))


@pytest.mark.parametrize("seed", [0, 1])
def test_overlap_is_exact_on_random_views(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(1500):
        a = random_view(rng)
        if rng.random() < 0.5:  # the same layout shifted: interleaved views of one buffer
            reach = sum((n - 1) * s for n, s in zip(a.shape, a.stride(), strict=True))
            b = BASE.as_strided(a.shape, a.stride(), rng.randint(0, BASE.numel() - 1 - reach))
        else:
            b = random_view(rng)
        fa, fb = footprint(a), footprint(b)
        assert fa is not None and fb is not None
        twice = len(addresses(a)) < a.numel() * a.element_size()
        assert internal_overlap(fa) is twice, (a.shape, a.stride())
        assert overlap(fa, fb) is bool(addresses(a) & addresses(b)), (
            a.shape,
            a.stride(),
            b.shape,
            b.stride(),
        )


def test_vllm_key_and_value_halves_are_disjoint() -> None:
    view = torch.zeros(3, 2, 4, 16)  # [blocks, heads, block, 2 * head_size]
    key, value = view[..., :8], view[..., 8:]
    assert shared_memory([("k", key), ("v", value)]) is None
    assert shared_memory([("k", key), ("v", value), ("again", view[0, :, :, 4:12])]) == ("k", "again", True)
    assert shared_memory([("b", torch.zeros(1, 8).expand(4, 8))]) == ("b", None, True)
    assert shared_memory([("empty", torch.zeros(0)), ("meta", torch.zeros(4, device="meta"))]) is None
