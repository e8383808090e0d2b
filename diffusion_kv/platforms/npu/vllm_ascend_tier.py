"""The vllm-ascend tier: the npu plugin's parts taken from vllm-ascend itself.

This is the tier vLLM-Omni uses on Ascend: vllm-ascend's ``AscendBlockTables`` (int32 slots),
its ``build_attn_metadata`` forced into the cache-backed ``ChunkedPrefill`` state, and its
``AscendAttentionBackendImpl`` driven as "write once (``do_kv_cache_update``), then one
K/V-less ``forward`` per piecewise segment". Worker initialisation runs ``adapt_patch()`` and
``init_ascend_config`` after checking the installed version set (:mod:`.compat`).

vllm-ascend's builder and impl need objects only an embedding vLLM host has (its
``VllmConfig``, attention groups and ``KVCacheConfig``); the host hands them over with
:meth:`NpuPlatform.bind_vllm_runtime <diffusion_kv.platforms.npu.NpuPlatform.bind_vllm_runtime>`.

Status: **untested against real vllm-ascend.** vllm-ascend cannot be installed without CANN,
so this module is written against vllm-ascend's documented v0.26 interfaces and exercised only
with stand-in modules (``tests/npu/test_vllm_ascend_tier.py``). Every vendor import is lazy.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from diffusion_kv.core.batch import CommonBatchMetadata, KVCache, LayerGeometry
from diffusion_kv.core.errors import StateError, ValidationError
from diffusion_kv.platforms.npu.compat import AscendStack, check_supported_stack, installed_stack

BLOCK_TABLE_MODULE = "vllm_ascend.worker.v2.block_table"
ATTN_UTILS_MODULE = "vllm_ascend.worker.v2.attn_utils"
ATTENTION_MODULE = "vllm_ascend.attention.attention_v1"
UTILS_MODULE = "vllm_ascend.utils"
ASCEND_CONFIG_MODULE = "vllm_ascend.ascend_config"


@dataclass(frozen=True)
class VllmRuntime:
    """What the embedding vLLM host owns and vllm-ascend's parts need."""

    vllm_config: Any
    attn_groups: Any
    """vLLM's attention groups (``init_attn_backend``), one list per KV-cache group."""
    kv_cache_config: Any


def _import(name: str) -> Any:
    return importlib.import_module(name)


def layer_index_problem(layer_name: str) -> str | None:
    """vllm-ascend binds caches by the single integer component of a layer name."""
    numbers = [part for part in layer_name.split(".") if part.isdigit()]
    if len(numbers) == 1:
        return None
    return (
        f"layer name {layer_name!r} must contain exactly one integer component "
        f"(e.g. 'transformer.blocks.7.attn'); vllm-ascend's bind_kv_cache orders layers by it"
    )


# -- BlockTables ------------------------------------------------------------------------------


class _HostCountsView:
    """``num_blocks.cpu`` over vLLM's numpy host mirror (shared memory, so writes go through)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    @property
    def cpu(self) -> torch.Tensor:
        return torch.from_numpy(self._inner.np)

    def copy_to_uva(self) -> None:
        self._inner.copy_to_uva()


class AscendBlockTablesAdapter:
    """vllm-ascend's ``AscendBlockTables`` behind the core's BlockTables protocol."""

    slot_mapping_dtype = torch.int32

    def __init__(
        self,
        *,
        block_sizes: Sequence[int],
        max_num_reqs: int,
        max_num_batched_tokens: int,
        max_num_blocks_per_group: Sequence[int],
        device: torch.device | str,
        kernel_block_sizes: Sequence[int] | None = None,
        cp_size: int = 1,
        cp_rank: int = 0,
        cp_interleave: int = 1,
    ) -> None:
        kernel = list(kernel_block_sizes) if kernel_block_sizes is not None else list(block_sizes)
        cls = _import(BLOCK_TABLE_MODULE).AscendBlockTables
        self.inner = cls(
            block_sizes=list(block_sizes),
            max_num_reqs=max_num_reqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_blocks_per_group=list(max_num_blocks_per_group),
            device=torch.device(device),
            kernel_block_sizes=kernel,
            cp_size=cp_size,
            cp_rank=cp_rank,
            cp_interleave=cp_interleave,
        )
        self.block_sizes = list(block_sizes)
        self.kernel_block_sizes = kernel
        self.blocks_per_kv_block = [bs // kbs for bs, kbs in zip(self.block_sizes, kernel, strict=True)]
        self.max_num_reqs = max_num_reqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.cp_size = cp_size
        self.cp_rank = cp_rank
        self.cp_interleave = cp_interleave
        self.num_blocks = _HostCountsView(self.inner.num_blocks)

    @property
    def block_tables(self) -> Sequence[Any]:
        tables: Sequence[Any] = self.inner.block_tables
        return tables

    def append_block_ids(self, req_index: int, new_block_ids: tuple[list[int], ...], overwrite: bool) -> None:
        self.inner.append_block_ids(req_index, new_block_ids, overwrite)

    def apply_staged_writes(self) -> None:
        self.inner.apply_staged_writes()

    def gather_block_tables(
        self, idx_mapping: torch.Tensor, num_reqs_padded: int
    ) -> tuple[torch.Tensor, ...]:
        return tuple(self.inner.gather_block_tables(idx_mapping, num_reqs_padded))

    def compute_slot_mappings(
        self,
        idx_mapping: torch.Tensor,
        query_start_loc: torch.Tensor,
        positions: torch.Tensor,
        num_tokens_padded: int,
    ) -> torch.Tensor:
        slots: torch.Tensor = self.inner.compute_slot_mappings(
            idx_mapping, query_start_loc, positions, num_tokens_padded
        )
        return slots

    def init_block_table_layout_tensors(self) -> None:
        self.inner.init_block_table_layout_tensors()


# -- the tier ---------------------------------------------------------------------------------

_STRICT_ULYSSES: dict[type, type] = {}


class VllmAscendTier:
    """vllm-ascend-backed parts of the npu plugin (see the module docstring)."""

    name = "vllm-ascend"

    def __init__(
        self,
        runtime: VllmRuntime | None = None,
        stack: Callable[[], AscendStack] | None = None,
    ) -> None:
        self.runtime = runtime
        self._stack = stack
        self._stack_checked = False

    def require_runtime(self) -> VllmRuntime:
        if self.runtime is None:
            raise StateError(
                "npu (vllm-ascend tier): vllm-ascend's metadata builder and attention impl need the host's "
                "vLLM runtime (vllm_config, attn_groups, kv_cache_config). An embedding host calls "
                "NpuPlatform.bind_vllm_runtime(...) first; standalone use sets DIFFUSION_KV_NPU_TIER=direct"
            )
        return self.runtime

    def check_stack(self) -> None:
        """Refuse an unknown (CANN, torch, torch_npu, vllm, vllm-ascend) set (once per tier)."""
        if not self._stack_checked:
            check_supported_stack((self._stack or installed_stack)())
            self._stack_checked = True

    @contextlib.contextmanager
    def vllm_config_context(self) -> Iterator[None]:
        """vllm-ascend reads the current VllmConfig while building metadata and impls."""
        runtime = self.require_runtime()
        with _import("vllm.config").set_current_vllm_config(runtime.vllm_config):
            yield

    # -- worker setup -------------------------------------------------------------------------

    def init_worker(self) -> None:
        """Version check, then vllm-ascend's worker patches and its config singleton."""
        runtime = self.require_runtime()
        self.check_stack()
        _import(UTILS_MODULE).adapt_patch()
        _import(ASCEND_CONFIG_MODULE).init_ascend_config(runtime.vllm_config)

    def configure_block_size(self, vllm_config: Any) -> int:
        """Set ``cache_config.block_size`` to vllm-ascend's kernel block size (before KV specs)."""
        backend = _import(ATTENTION_MODULE).AscendAttentionBackend
        sizes = [s for s in backend.get_supported_kernel_block_sizes() if type(s) is int and s > 0]
        if not sizes:
            raise StateError("vllm-ascend's AscendAttentionBackend reports no integer kernel block size")
        vllm_config.cache_config.block_size = sizes[0]
        return sizes[0]

    def paged_backend_cls(self, backend_cls: type, *, ulysses_degree: int) -> type:
        """Under Ulysses (degree > 1), pin vllm-ascend's plain impl and builder.

        ``AscendAttentionBackend.get_impl_cls`` would otherwise dispatch to its context-parallel
        implementations; strict Ulysses paged FIA must stay on the plain one.
        """
        if ulysses_degree <= 1:
            return backend_cls
        attention = _import(ATTENTION_MODULE)
        if not issubclass(backend_cls, attention.AscendAttentionBackend):
            return backend_cls
        cached = _STRICT_ULYSSES.get(backend_cls)
        if cached is None:
            impl_cls = attention.AscendAttentionBackendImpl
            builder_cls = attention.AscendAttentionMetadataBuilder
            cached = type(
                f"StrictUlysses{backend_cls.__name__}",
                (backend_cls,),
                {
                    "__doc__": "Paged FIA under strict Ulysses: always the plain impl and builder.",
                    "get_impl_cls": staticmethod(lambda: impl_cls),
                    "get_builder_cls": staticmethod(lambda: builder_cls),
                },
            )
            _STRICT_ULYSSES[backend_cls] = cached
        return cached

    # -- the four parts -----------------------------------------------------------------------

    def block_tables_cls(self) -> type[AscendBlockTablesAdapter]:
        self.check_stack()
        return AscendBlockTablesAdapter

    def build_attn_metadata(self, **kwargs: Any) -> dict[str, Any]:
        """vllm-ascend's ``build_attn_metadata`` in the cache-backed ``ChunkedPrefill`` state.

        ``seq_lens_cpu`` becomes ``seq_lens_np``; keywords the installed version does not take
        are dropped (the signature drifts between releases).
        """
        attention = _import(ATTENTION_MODULE)
        build = _import(ATTN_UTILS_MODULE).build_attn_metadata
        args = dict(kwargs)
        seq_lens_cpu = args.pop("seq_lens_cpu", None)
        if seq_lens_cpu is not None:
            args["seq_lens_np"] = seq_lens_cpu.detach().cpu().numpy()
        args["attn_state"] = attention.AscendAttentionState.ChunkedPrefill
        params = inspect.signature(build).parameters
        if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
            args = {k: v for k, v in args.items() if k in params}
        with self.vllm_config_context():
            result = build(**args)
        out = dict(result)
        for name, md in out.items():
            missing = [
                a for a in ("actual_seq_lengths_q", "seq_lens_list", "block_tables") if not hasattr(md, a)
            ]
            if missing:
                raise StateError(
                    f"vllm-ascend returned metadata for layer {name!r} without {missing}; this vllm-ascend "
                    "version is not one the npu plugin supports (see docs/ascend.md)"
                )
        return out

    def metadata_builder(self) -> VllmAscendMetadataBuilder:
        self.check_stack()
        return VllmAscendMetadataBuilder(self, self.require_runtime())

    def paged_backend(self, layer: LayerGeometry, device: torch.device) -> VllmAscendPagedBackend:
        self.check_stack()
        self.require_runtime()
        problem = layer_index_problem(layer.layer_name)
        if problem is not None:
            raise ValidationError(f"npu (vllm-ascend tier): {problem}")
        attention = _import(ATTENTION_MODULE)
        with self.vllm_config_context():
            impl = attention.AscendAttentionBackendImpl(
                num_heads=layer.num_heads,
                head_size=layer.head_size,
                scale=layer.scale,
                num_kv_heads=layer.num_kv_heads,
                alibi_slopes=None,
                sliding_window=None,
                kv_cache_dtype="auto",
                logits_soft_cap=None,
                attn_type=_decoder_attention_type(),
                kv_sharing_target_layer_name=None,
            )
        if not hasattr(impl, "do_kv_cache_update"):
            raise StateError(
                "vllm-ascend's AscendAttentionBackendImpl has no do_kv_cache_update; the npu plugin's "
                "write-once policy needs it (vllm-ascend >= 0.26)"
            )
        return VllmAscendPagedBackend(layer, impl, AscendLayerAdapter(layer.layer_name, device))


def _decoder_attention_type() -> Any:
    for module in ("vllm.v1.attention.backend", "vllm.attention.backends.abstract"):
        try:
            return _import(module).AttentionType.DECODER
        except (ImportError, AttributeError):
            continue
    raise StateError("vLLM's AttentionType was not found (vllm.v1.attention.backend or older path)")


class VllmAscendMetadataBuilder:
    """``CommonBatchMetadata`` -> vllm-ascend's ``AscendMetadata`` per layer.

    vllm-ascend's builder counts rows with ``query_len <= 1`` as decodes that must come first;
    the core enforces that order at preparation through ``reorder_batch_threshold``.
    """

    reorder_batch_threshold: int | None = 1

    def __init__(self, tier: VllmAscendTier, runtime: VllmRuntime) -> None:
        self.tier = tier
        self.runtime = runtime

    def build(self, batch: CommonBatchMetadata) -> Mapping[str, Any]:
        causal: bool | dict[int, bool] = (
            batch.causal if isinstance(batch.causal, bool) else dict(batch.causal)
        )
        return self.tier.build_attn_metadata(
            attn_groups=self.runtime.attn_groups,
            num_reqs=batch.num_reqs,
            num_tokens=batch.num_tokens,
            query_start_loc_gpu=batch.query_start_loc,
            query_start_loc_cpu=batch.query_start_loc_cpu,
            max_query_len=batch.max_query_len,
            seq_lens=batch.seq_lens,
            max_seq_len=batch.max_seq_len,
            block_tables=batch.block_tables,
            slot_mappings=batch.slot_mappings,
            kv_cache_config=self.runtime.kv_cache_config,
            seq_lens_cpu=batch.seq_lens_cpu,
            seq_lens_cpu_upper_bound=batch.seq_lens_cpu,
            dcp_local_seq_lens=batch.dcp_local_seq_lens,
            positions=batch.positions,
            causal=causal,
        )


class AscendLayerAdapter:
    """The attributes ``AscendAttentionBackendImpl`` reads from its ``layer`` argument."""

    def __init__(self, layer_name: str, device: torch.device) -> None:
        self.layer_name = layer_name
        self._k_scale_float = 1.0
        self._v_scale_float = 1.0
        self._q_scale_float = 1.0
        self._q_scale = torch.ones((), dtype=torch.float32, device=device)
        self._k_scale = torch.ones((), dtype=torch.float32, device=device)
        self._v_scale = torch.ones((), dtype=torch.float32, device=device)


class VllmAscendPagedBackend:
    """One layer through vllm-ascend's impl: ``do_kv_cache_update`` once, K/V-less ``forward``s."""

    name = "npu-vllm-ascend"

    def __init__(self, layer: LayerGeometry, impl: Any, adapter: AscendLayerAdapter) -> None:
        self.layer = layer
        self.impl = impl
        self.adapter = adapter

    def write_kv(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: KVCache, slot_mapping: torch.Tensor
    ) -> None:
        tokens = key.shape[0]
        self.impl.do_kv_cache_update(
            self.adapter,
            key.contiguous(),
            value.contiguous(),
            kv_cache,
            slot_mapping[:tokens].contiguous(),
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: KVCache,
        metadata: Any,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if (key is None) != (value is None):
            raise ValidationError("key and value must both be given or both be None")
        tokens = query.shape[0]
        target = (
            out if out is not None else query.new_empty((tokens, self.layer.num_heads, self.layer.head_size))
        )
        self.impl.forward(self.adapter, query.contiguous(), key, value, kv_cache, metadata, target)
        return target[:tokens]
