"""The per-layer reads of the AR-diffusion adapter that the GPU path depends on, checked on the
CPU: a written context's block index is made once and dropped with the context (a re-written
context of the same name reads its own pages, not a stale index), and the fused dense partial
attention (one ``sdpa_with_lse`` call, GQA folded into the query rows) equals the float32 einsum
one (out and natural-log LSE)."""

from __future__ import annotations

import pytest
import torch

from diffusion_kv.core.errors import StateError
from diffusion_kv.integrations.vllm_omni.ar_sessions import _dense_partial, _fused_partial
from tests.unit.test_sessions import Stream
from tests.unit.test_sessions_contexts import make, write_context


def test_a_context_index_is_made_once_and_dropped_with_the_context() -> None:
    cache, _, cpool = make()
    contexts = cache.contexts
    assert contexts is not None
    stream = Stream(cache, "s", branches=2, seed=0)
    rows = cache.set_context(stream.session, "text", 5)
    assert rows is not None
    written = write_context(cache, rows, seed=1)
    for b in range(2):
        k, v = cache.context_kv(stream.session, "text", "x0", branch=b)
        assert torch.equal(k, written[b][0]) and torch.equal(v, written[b][1])
    assert len(contexts._indices) == 2  # one per branch
    first = dict(contexts._indices)
    cache.context_kv(stream.session, "text", "x0", branch=1)
    assert contexts._indices == first and all(contexts._indices[k] is first[k] for k in first)
    cache.release_context(stream.session, "text")
    assert contexts._indices == {} and contexts._complete == set()
    assert cpool.num_free == cpool.num_total
    # another context in other blocks under the same name: its own pages are read
    hold = cache.set_context(stream.session, "hold", 3)  # takes the freed blocks first
    rows = cache.set_context(stream.session, "text", 5)
    assert hold is not None and rows is not None
    with pytest.raises(StateError, match=r"context 'text' of session 's': \(branch, tokens\)"):
        cache.context_kv(stream.session, "text", "x0")  # unwritten again: the completeness went too
    written = write_context(cache, rows, seed=2)
    for b in range(2):
        k, v = cache.context_kv(stream.session, "text", "x0", branch=b)
        assert torch.equal(k, written[b][0]) and torch.equal(v, written[b][1])
    cache.end_session(stream.session)
    assert contexts._indices == {} and cpool.num_free == cpool.num_total


@pytest.mark.parametrize(("heads", "kv_heads", "keys"), [(12, 12, 880), (8, 2, 33), (4, 1, 16)])
def test_the_fused_dense_partial_equals_the_einsum_one(heads: int, kv_heads: int, keys: int) -> None:
    g = torch.Generator().manual_seed(heads * 100 + keys)
    q = torch.randn(70, heads, 64, generator=g)
    k = torch.randn(keys, kv_heads, 64, generator=g)
    v = torch.randn(keys, kv_heads, 64, generator=g)
    out, lse = _dense_partial(q, k, v, 0.125)  # the CPU: float32 einsums
    fused_out, fused_lse = _fused_partial(q, k, v, 0.125)
    assert fused_out.shape == (70, heads, 64) and fused_lse.shape == (70, heads)
    assert fused_lse.dtype == torch.float32
    assert (fused_out - out).abs().max().item() <= 1e-5
    assert (fused_lse - lse).abs().max().item() <= 1e-5
    # each query head h reads KV head h // (heads // kv_heads), as repeat_interleave does
    h = heads - 1
    kv = h // (heads // kv_heads)
    scores = (q[:, h] @ k[:, kv].T) * 0.125
    assert (torch.logsumexp(scores, dim=-1) - fused_lse[:, h]).abs().max().item() <= 1e-5
