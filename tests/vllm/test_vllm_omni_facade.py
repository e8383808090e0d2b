"""The vLLM-Omni facade replaying the upstream call sequence on the cpu plugin.

register -> initialise -> install -> activate -> step switch -> remove, with vLLM-Omni-shaped
records (plain attribute objects, as vLLM-Omni passes them).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from diffusion_kv.conformance.reference import dense_attention, row_mask
from diffusion_kv.core.block_tables import TorchBlockTables
from diffusion_kv.core.errors import StateError, UnsupportedRequirementsError, ValidationError
from diffusion_kv.core.layout import CacheLayout
from diffusion_kv.integrations.vllm_omni import DiffusionKVPlatformHooks, DiffusionKVRunnerBackend
from diffusion_kv.platforms.cpu import CpuPlatform
from diffusion_kv.platforms.cpu.backend import CpuPagedMetadata, CpuReferenceBackend
from diffusion_kv.platforms.interface import ENV_BACKEND

BLOCK = 16
HEADS, KV_HEADS, HEAD = 4, 2, 32


@dataclass(frozen=True)
class FullAttentionSpec:  # vLLM's field names
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    non_causal: bool = False


def vllm_config(max_num_seqs: int = 2) -> SimpleNamespace:
    return SimpleNamespace(
        model_config=SimpleNamespace(max_model_len=128),
        scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs, max_num_batched_tokens=512),
        parallel_config=SimpleNamespace(decode_context_parallel_size=1, cp_kv_cache_interleave_size=1),
    )


class NoUlyssesReference(CpuReferenceBackend):
    """The reference backend declaring no Ulysses support (as a backend without it would)."""

    capabilities = dataclasses.replace(CpuReferenceBackend.capabilities, supports_ulysses=False)


class NoUlyssesCpu(CpuPlatform):
    """The cpu platform whose built-in backend lacks Ulysses support."""

    backends = (NoUlyssesReference,)


def od_config(mode: str = "paged_scheduler", **parallel: Any) -> SimpleNamespace:
    return SimpleNamespace(
        diffusion_kv_mode=SimpleNamespace(value=mode),
        diffusion_kv_max_rows_per_request=3,
        parallel_config=SimpleNamespace(**{"ulysses_degree": 1, **parallel}),
    )


def layers() -> dict[str, tuple[Any, FullAttentionSpec]]:
    spec = FullAttentionSpec(BLOCK, KV_HEADS, HEAD, torch.float32)
    return {
        name: (SimpleNamespace(num_heads=HEADS, softmax_scale=HEAD**-0.5, attn_backend=None), spec)
        for name in ("blk.0.attn", "blk.1.attn")
    }


def kv_cache_config(specs: dict[str, FullAttentionSpec]) -> SimpleNamespace:
    spec = next(iter(specs.values()))
    return SimpleNamespace(
        num_blocks=32, kv_cache_groups=[SimpleNamespace(layer_names=list(specs), kv_cache_spec=spec)]
    )


def metadata(generation: int = 0) -> SimpleNamespace:
    """Two CFG sequences (prefix 20 + target 12) and one shared reference context."""
    seq = lambda sid, blocks: SimpleNamespace(  # noqa: E731
        sequence_id=sid,
        prefix_len=20,
        target_len=12,
        seq_len=32,
        block_ids=(blocks,),
        context_ids=("ref",),
        cached_prefix_len=0,
    )
    return SimpleNamespace(
        request_id="req-1",
        allocation_generation=generation,
        sequences=[seq(0, [7, 3]), seq(1, [12, 5])],
        contexts=[SimpleNamespace(context_id="ref", cache_role="reference", num_tokens=9, block_ids=([30],))],
    )


def row(sid: int, kv_start: int, query_len: int, seq_len: int) -> SimpleNamespace:
    return SimpleNamespace(
        request_id="req-1",
        sequence_id=sid,
        context_id=None,
        kv_start_pos=kv_start,
        query_len=query_len,
        seq_len=seq_len,
    )


def backend() -> DiffusionKVRunnerBackend:
    return DiffusionKVRunnerBackend(platform=CpuPlatform(), vllm_config=vllm_config(), od_config=od_config())


def test_upstream_call_sequence() -> None:
    be = backend()
    # register: canonical specs come back (rank-local KV heads; no Ulysses here)
    specs = be.register_kv_cache_layers(layers())
    assert specs == {
        n: FullAttentionSpec(BLOCK, KV_HEADS, HEAD, torch.float32) for n in ("blk.0.attn", "blk.1.attn")
    }
    # initialise
    be.initialize_kv_cache(kv_cache_config(specs))
    assert isinstance(be.layout, CacheLayout)
    assert be.layout.max_num_reqs == 6  # max_num_seqs 2 x 3 rows per request
    assert sorted(be.kv_caches_by_layer) == ["blk.0.attn", "blk.1.attn"]
    # install: sequences then contexts, lowest rows first; idempotent per generation
    assert be.install_diffusion_kv_metadata(metadata()) is True
    assert be.install_diffusion_kv_metadata(metadata()) is False
    assert [be.get_diffusion_kv_row("req-1", 0), be.get_diffusion_kv_row("req-1", 1)] == [0, 1]
    assert be.get_diffusion_kv_row("req-1", 1, "ref") == 2  # a context id wins: one shared row
    # activate: step 0 runs the prefill rows, step 1 switches to the denoise rows
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 32, h, HEAD, generator=g) for h in (HEADS, KV_HEADS, KV_HEADS))
    phase = SimpleNamespace(
        prefill_rows=(row(0, 0, 32, 32), row(1, 0, 32, 32)),
        denoise_rows=(row(0, 20, 12, 32), row(1, 20, 12, 32)),
    )
    runtime, activation = be.activate_paged_attention_metadata(phase)
    outs = {}
    with activation:
        for step in (0, 1, 2):
            runtime.ensure_active(step)
            span = slice(0, 32) if step == 0 else slice(20, 32)
            outs[step] = [
                be.forward(
                    name,
                    q[:, span].reshape(-1, HEADS, HEAD),
                    k[:, span].reshape(-1, KV_HEADS, HEAD),
                    v[:, span].reshape(-1, KV_HEADS, HEAD),
                )
                for name in ("blk.0.attn", "blk.1.attn")
            ]
    assert runtime.preparations == 2  # one per phase; step 2 reuses step 1's batch
    assert runtime.closed
    for r in range(2):
        mask = row_mask("causal", 20, 12, 32)
        ref = dense_attention(q[r, 20:], k[r], v[r], mask, HEAD**-0.5)
        got = outs[1][0].reshape(2, 12, HEADS, HEAD)[r]
        torch.testing.assert_close(got.double(), ref, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(outs[1][0], outs[2][0], atol=0, rtol=0)
    # remove: rows only (blocks stay the scheduler's), idempotent, generation-scoped
    assert be.remove_diffusion_kv_requests([("req-1", 5)]) == 0
    assert be.remove_diffusion_kv_requests(["req-1"]) == 3
    assert be.remove_diffusion_kv_requests(["req-1"]) == 0
    with pytest.raises(KeyError, match=r"no worker row is installed for \('req-1', 0, None\)"):
        be.get_diffusion_kv_row("req-1", 0)
    assert be.install_diffusion_kv_metadata(metadata(generation=1)) is True
    assert be.get_diffusion_kv_row("req-1", 0) == 0  # freed rows are reused lowest first


def test_registration_is_frozen_after_initialisation_and_stale_generations_fail() -> None:
    be = backend()
    specs = be.register_kv_cache_layers(layers())
    be.initialize_kv_cache(kv_cache_config(specs))
    with pytest.raises(StateError, match="cannot change after the KV cache is initialised"):
        be.register_kv_cache_layers(layers())
    be.install_diffusion_kv_metadata(metadata(generation=2))
    with pytest.raises(
        ValueError, match="stale allocation generation 1 for request 'req-1'; installed generation is 2"
    ):
        be.install_diffusion_kv_metadata(metadata(generation=1))
    be.refresh_block_table_layout()
    assert be.get_diffusion_kv_row("req-1", 1) == 1


def test_uninitialised_and_dense_mode_follow_upstream() -> None:
    be = backend()
    with pytest.raises(RuntimeError, match="native BlockTables are not initialized"):
        be.get_diffusion_kv_row("r", 0)
    assert be.remove_diffusion_kv_requests(["r"]) == 0
    with pytest.raises(RuntimeError, match="attention adapter is not initialized"):
        be.activate_paged_attention_metadata(SimpleNamespace(prefill_rows=(), denoise_rows=()))
    dense = DiffusionKVRunnerBackend(
        platform=CpuPlatform(), vllm_config=vllm_config(), od_config=od_config("dense_legacy")
    )
    specs = dense.register_kv_cache_layers(layers())
    dense.initialize_kv_cache(kv_cache_config(specs))
    with pytest.raises(ValueError, match="dense diffusion execution must not install"):
        dense.install_diffusion_kv_metadata(metadata())
    assert dense.remove_diffusion_kv_requests(["req-1"]) == 0


def test_registration_rejections() -> None:
    be = backend()
    no_paging = SimpleNamespace(supports_paged_kv=False, get_name=lambda: "TORCH_SDPA")
    bad = {
        "x": (
            SimpleNamespace(num_heads=4, attn_backend=no_paging),
            FullAttentionSpec(16, 2, 32, torch.float32),
        )
    }
    with pytest.raises(
        NotImplementedError, match="requires a backend with paged support; selected TORCH_SDPA"
    ):
        be.register_kv_cache_layers(bad)
    with pytest.raises(TypeError, match=r"unsupported spec str \(no 'num_kv_heads'\)"):
        be.register_kv_cache_layers({"x": (SimpleNamespace(num_heads=4), "spec")})
    ring = DiffusionKVRunnerBackend(
        platform=CpuPlatform(), vllm_config=vllm_config(), od_config=od_config(ring_degree=2)
    )
    with pytest.raises(NotImplementedError, match="Ring or hybrid Ulysses\\+Ring"):
        ring.register_kv_cache_layers(layers())
    uly = DiffusionKVRunnerBackend(
        platform=NoUlyssesCpu(), vllm_config=vllm_config(), od_config=od_config(ulysses_degree=2)
    )
    with pytest.raises(UnsupportedRequirementsError, match="Ulysses sequence parallelism \\(degree 2\\)"):
        uly.register_kv_cache_layers(layers())


def test_platform_hooks_delegate_to_the_selected_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    hooks = DiffusionKVPlatformHooks(CpuPlatform())
    assert hooks.get_diffusion_kv_block_tables_cls() is TorchBlockTables  # every cpu backend's
    assert hooks.requires_diffusion_paged_kv_prewrite() is True
    sentinel = type("Backend", (), {})
    assert hooks.get_diffusion_paged_kv_attn_backend(sentinel, ulysses_degree=1) is sentinel
    assert hooks.get_diffusion_paged_kv_attn_backend(sentinel, ulysses_degree=2) is sentinel
    monkeypatch.setenv(ENV_BACKEND, "cpu:reference")  # the same candidates with or without vLLM
    assert hooks.selected_backend() is CpuReferenceBackend
    with pytest.raises(NotImplementedError) as info:
        DiffusionKVPlatformHooks(NoUlyssesCpu()).get_diffusion_paged_kv_attn_backend(
            sentinel, ulysses_degree=2
        )
    assert str(info.value) == (
        "platform 'cpu' cannot page under Ulysses degree 2: reference: Ulysses sequence parallelism (degree 2)"
    )
    with pytest.raises(ValidationError, match="ulysses_degree must be a positive integer; got 0"):
        hooks.get_diffusion_paged_kv_attn_backend(sentinel, ulysses_degree=0)


def test_hooks_follow_the_backends_the_facade_chose() -> None:
    be = DiffusionKVRunnerBackend(platform=NoUlyssesCpu(), vllm_config=vllm_config(), od_config=od_config())
    sentinel = type("Backend", (), {})
    assert be.hooks.get_diffusion_paged_kv_attn_backend(sentinel, ulysses_degree=1) is sentinel
    be.initialize_kv_cache(kv_cache_config(be.register_kv_cache_layers(layers())))
    assert [type(b) for b in be.backend.backends] == [NoUlyssesReference]  # float32: the reference
    assert be.hooks.selected_backend() is NoUlyssesReference
    assert be.hooks.get_diffusion_kv_block_tables_cls() is TorchBlockTables
    with pytest.raises(NotImplementedError) as info:
        be.hooks.get_diffusion_paged_kv_attn_backend(sentinel, ulysses_degree=2)
    assert str(info.value) == (
        "platform 'cpu' cannot page under Ulysses degree 2: reference: Ulysses sequence parallelism (degree 2)"
    )


def test_metadata_hook_builds_through_the_group_backend() -> None:
    """Upstream keyword arguments in; the group's backend builds; every layer of the group maps
    to that one metadata (what the backend's forward takes)."""
    be = backend()
    specs = be.register_kv_cache_layers(layers())
    be.initialize_kv_cache(kv_cache_config(specs))
    (group_backend,) = be.backend.backends
    assert type(group_backend) is CpuReferenceBackend  # float32 layers: the reference in every lane
    qsl = torch.tensor([0, 5], dtype=torch.int32)
    seq = torch.tensor([9], dtype=torch.int32)
    table = torch.tensor([[4, 0]], dtype=torch.int32)
    kwargs: dict[str, Any] = dict(
        num_reqs=1,
        num_tokens=5,
        query_start_loc_gpu=qsl,
        query_start_loc_cpu=qsl,
        max_query_len=5,
        seq_lens=seq,
        max_seq_len=9,
        block_tables=[table],
        slot_mappings=torch.arange(68, 73)[None],
        kv_cache_config=None,
        seq_lens_cpu=seq,
        seq_lens_cpu_upper_bound=seq,
        positions=torch.arange(4, 9),
    )
    out = be.hooks.build_diffusion_kv_attn_metadata(attn_groups=group_backend, causal=True, **kwargs)
    assert sorted(out) == ["blk.0.attn", "blk.1.attn"]
    md = out["blk.0.attn"]
    assert isinstance(md, CpuPagedMetadata)
    assert (md.query_start_loc, md.seq_lens, md.causal, md.block_size) == ((0, 5), (9,), True, BLOCK)
    assert md.block_table is table
    assert out["blk.1.attn"] is md
    for causal in (False, {0: False}):
        out = be.hooks.build_diffusion_kv_attn_metadata(attn_groups=[group_backend], causal=causal, **kwargs)
        assert out["blk.0.attn"].causal is False
    out = be.hooks.build_diffusion_kv_attn_metadata(attn_groups=[group_backend], causal={1: False}, **kwargs)
    assert out["blk.0.attn"].causal is True
    with pytest.raises(
        TypeError, match=r"unsupported metadata arguments for diffusion-kv backends: \['ubatch_idx'\]"
    ):
        be.hooks.build_diffusion_kv_attn_metadata(attn_groups=group_backend, ubatch_idx=0, **kwargs)
    with pytest.raises(ValidationError, match="needs positions"):
        be.hooks.build_diffusion_kv_attn_metadata(attn_groups=group_backend, **{**kwargs, "positions": None})
