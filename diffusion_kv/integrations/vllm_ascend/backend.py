"""The ``vllm-ascend`` paged backend of the npu platform: vllm-ascend's own parts.

This is the backend vLLM-Omni uses on Ascend: vllm-ascend's ``AscendBlockTables`` (int32
slots), its ``build_attn_metadata`` forced into the cache-backed ``ChunkedPrefill`` state, and
its ``AscendAttentionBackendImpl`` driven as "write once (``do_kv_cache_update``), then one
K/V-less ``forward`` per attention call". Worker initialisation runs ``adapt_patch()`` and
``init_ascend_config`` after checking the installed version set
(:mod:`diffusion_kv.platforms.npu.compat`).

vllm-ascend's builder and impl need objects only an embedding vLLM host has (its
``VllmConfig``, attention groups and ``KVCacheConfig``): the backend declares ``needs_host``, the
host hands them to the runner as one :class:`~diffusion_kv.core.host.HostRuntime`
(``PagedWorker(..., host=...)``) and each instance reads them from ``GroupContext.host``.
Without a host, or with one that lacks what it needs, selection rules the backend out with the
reason (``host_reasons``: in ``explain()`` and in selection errors).

One instance serves one KV-cache group ``g``: it builds with the host's attention groups of
``g`` and a view of the host's ``KVCacheConfig`` holding only group ``g``, so the host's groups
must be the layout's groups, in order (what ``CacheLayout.from_kv_cache_config`` gives).

Status: **never run against real vllm-ascend.** vllm-ascend cannot be imported without CANN.
Every vllm-ascend (and vLLM) name, field and signature this module uses is listed in
:data:`VENDOR_USES`; ``ci/npu_contract_lane.sh`` checks that list against the vllm-ascend
0.26.0rc1 wheel's source (vLLM's names against vLLM 0.26.0's), and the tests drive the glue
with stand-in modules (``tests/npu/test_vllm_ascend_backend.py``). Every vendor import is lazy.

Hosts it refuses: a pooling host (``model_config.runner_type == "pooling"``). vllm-ascend's
``forward`` sends non-causal attention of pooling runners to ``_forward_encoder_attention``,
which attends over the call's own K/V tensors; this backend's ``forward`` passes none (it reads
the pages), so full and piecewise-full calls would fail there.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import importlib.metadata
import importlib.util
import inspect
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from diffusion_kv.core.backend import GroupContext, KVPageLayout, PagedBackend
from diffusion_kv.core.batch import KVCache, LayerGeometry, PagedBatch
from diffusion_kv.core.block_tables import BlockTables, BlockTablesGeometry
from diffusion_kv.core.capabilities import Availability, Capabilities, Requirements
from diffusion_kv.core.errors import StateError, UnsupportedFeatureError, ValidationError
from diffusion_kv.core.host import HostRuntime
from diffusion_kv.platforms.npu.compat import check_supported_stack, installed_stack
from diffusion_kv.platforms.npu.constraints import CAPABILITIES, head_count_reasons, unverified_notes
from diffusion_kv.platforms.npu.direct import require_layers
from diffusion_kv.platforms.npu.kernels import loaded_emulator
from diffusion_kv.platforms.npu.slots import PaddingFilter

BLOCK_TABLE_MODULE = "vllm_ascend.worker.v2.block_table"
ATTN_UTILS_MODULE = "vllm_ascend.worker.v2.attn_utils"
ATTENTION_MODULE = "vllm_ascend.attention.attention_v1"
UTILS_MODULE = "vllm_ascend.utils"
ASCEND_CONFIG_MODULE = "vllm_ascend.ascend_config"

VLLM_CONFIG_MODULE = "vllm.config"
VLLM_ATTENTION_TYPE_MODULES = ("vllm.v1.attention.backend", "vllm.attention.backends.abstract")

EMULATED_REASON = "the torch_npu emulator (CPU) is installed; vllm-ascend needs CANN"
NOT_IMPORTABLE_REASON = "vllm_ascend is not importable"
POOLING_REASON = (
    "the vLLM host runs a pooling model (model_config.runner_type == 'pooling'): vllm-ascend sends "
    "non-causal attention of pooling runners to _forward_encoder_attention, which needs the call's K/V "
    "tensors, and this backend reads K/V from the pages (it passes none)"
)


@dataclass(frozen=True)
class VendorUse:
    """One vllm-ascend (or vLLM) name this backend uses, and how it calls it.

    ``ci/npu_contract_lane.sh`` checks each against the targeted wheels' source: the name
    exists with this ``kind``, takes the ``keywords`` it is given by keyword and
    ``positional`` arguments by position, and (``optional_keywords``) which keywords a
    version would not take (the backend drops those).
    """

    module: str
    name: str
    """``Name``, ``Class.member`` or ``Enum.Member``."""
    kind: str
    """``class``, ``function``, ``method``, ``staticmethod``, ``enum_member``, ``field`` or ``attribute``."""
    keywords: tuple[str, ...] = ()
    positional: int = 0
    optional_keywords: bool = False
    """True: the backend filters these keywords by the installed signature (they may drift)."""


BUILD_KEYWORDS = (
    "attn_groups",
    "num_reqs",
    "num_tokens",
    "query_start_loc_gpu",
    "query_start_loc_cpu",
    "max_query_len",
    "seq_lens",
    "max_seq_len",
    "block_tables",
    "slot_mappings",
    "kv_cache_config",
    "seq_lens_np",
    "seq_lens_cpu_upper_bound",
    "dcp_local_seq_lens",
    "positions",
    "causal",
    "attn_state",
)
"""What :func:`build_attn_metadata` passes to vllm-ascend's ``build_attn_metadata``."""

BLOCK_TABLE_KEYWORDS = (
    "block_sizes",
    "max_num_reqs",
    "max_num_batched_tokens",
    "max_num_blocks_per_group",
    "device",
    "kernel_block_sizes",
    "cp_size",
    "cp_rank",
    "cp_interleave",
)

IMPL_KEYWORDS = (
    "num_heads",
    "head_size",
    "scale",
    "num_kv_heads",
    "alibi_slopes",
    "sliding_window",
    "kv_cache_dtype",
    "logits_soft_cap",
    "attn_type",
    "kv_sharing_target_layer_name",
)

VENDOR_USES: tuple[VendorUse, ...] = (
    VendorUse(BLOCK_TABLE_MODULE, "AscendBlockTables", "class", keywords=BLOCK_TABLE_KEYWORDS),
    VendorUse(BLOCK_TABLE_MODULE, "AscendBlockTables.append_block_ids", "method", positional=3),
    VendorUse(BLOCK_TABLE_MODULE, "AscendBlockTables.apply_staged_writes", "method"),
    VendorUse(BLOCK_TABLE_MODULE, "AscendBlockTables.gather_block_tables", "method", positional=2),
    VendorUse(BLOCK_TABLE_MODULE, "AscendBlockTables.compute_slot_mappings", "method", positional=4),
    VendorUse(BLOCK_TABLE_MODULE, "AscendBlockTables.init_block_table_layout_tensors", "method"),
    VendorUse(BLOCK_TABLE_MODULE, "AscendBlockTables.num_blocks", "attribute"),
    VendorUse(BLOCK_TABLE_MODULE, "AscendBlockTables.block_tables", "attribute"),
    VendorUse(
        ATTN_UTILS_MODULE, "build_attn_metadata", "function", keywords=BUILD_KEYWORDS, optional_keywords=True
    ),
    VendorUse(ATTENTION_MODULE, "AscendAttentionState.ChunkedPrefill", "enum_member"),
    VendorUse(ATTENTION_MODULE, "AscendAttentionBackend.get_supported_kernel_block_sizes", "staticmethod"),
    VendorUse(ATTENTION_MODULE, "AscendAttentionBackend.get_impl_cls", "staticmethod"),
    VendorUse(ATTENTION_MODULE, "AscendAttentionBackend.get_builder_cls", "staticmethod"),
    VendorUse(ATTENTION_MODULE, "AscendAttentionMetadataBuilder", "class"),
    VendorUse(ATTENTION_MODULE, "AscendAttentionBackendImpl", "class", keywords=IMPL_KEYWORDS),
    VendorUse(ATTENTION_MODULE, "AscendAttentionBackendImpl.do_kv_cache_update", "method", positional=5),
    VendorUse(ATTENTION_MODULE, "AscendAttentionBackendImpl.forward", "method", positional=7),
    VendorUse(ATTENTION_MODULE, "AscendMetadata.actual_seq_lengths_q", "field"),
    VendorUse(ATTENTION_MODULE, "AscendMetadata.seq_lens_list", "field"),
    VendorUse(ATTENTION_MODULE, "AscendMetadata.block_tables", "field"),
    VendorUse(ATTENTION_MODULE, "AscendMetadata.model_runner_type", "field"),
    VendorUse(UTILS_MODULE, "adapt_patch", "function"),
    VendorUse(ASCEND_CONFIG_MODULE, "init_ascend_config", "function", positional=1),
    VendorUse(VLLM_CONFIG_MODULE, "set_current_vllm_config", "function", positional=1),
    VendorUse(VLLM_ATTENTION_TYPE_MODULES[0], "AttentionType.DECODER", "enum_member"),
)
"""Every vendor name the backend uses (the lane's checklist; keep it in step with the code)."""

LAYER_ATTRIBUTES = (
    "layer_name",
    "_k_scale_float",
    "_v_scale_float",
    "_q_scale_float",
    "_q_scale",
    "_k_scale",
    "_v_scale",
)
"""What :class:`AscendLayerAdapter` offers the impl's ``layer`` argument."""


def _import(name: str) -> Any:
    return importlib.import_module(name)


def _vllm_ascend_importable() -> bool:
    try:
        return importlib.util.find_spec("vllm_ascend") is not None
    except (ImportError, ValueError):
        return False


def _vllm_ascend_version() -> str | None:
    for dist in ("vllm-ascend", "vllm_ascend"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def check_stack() -> None:
    """Refuse an unknown (CANN, torch, torch_npu, vllm, vllm-ascend) set, with the fix."""
    check_supported_stack(installed_stack(sys.modules.get("torch_npu")))


def require_host(host: HostRuntime | None) -> HostRuntime:
    """``host``, when it has everything this backend needs; else the error naming what is
    missing (:class:`StateError`) or what it cannot serve (:class:`UnsupportedFeatureError`)."""
    problems = host_problems(host)
    if host is None or (problems and problems != [POOLING_REASON]):
        raise StateError(
            "npu (vllm-ascend backend): "
            + "; ".join(problems)
            + ". Standalone use sets DIFFUSION_KV_BACKEND=npu:direct (or RunnerConfig(backend='direct'))"
        )
    if problems:
        raise UnsupportedFeatureError("npu (vllm-ascend backend): " + "; ".join(problems))
    return host


@contextlib.contextmanager
def vllm_config_context(host: HostRuntime) -> Iterator[None]:
    """vllm-ascend reads the current VllmConfig while building metadata and impls."""
    with _import(VLLM_CONFIG_MODULE).set_current_vllm_config(host.config):
        yield


def layer_index_problem(layer_name: str) -> str | None:
    """vllm-ascend binds caches by the single integer component of a layer name."""
    numbers = [part for part in layer_name.split(".") if part.isdigit()]
    if len(numbers) == 1:
        return None
    return (
        f"layer name {layer_name!r} must contain exactly one integer component "
        f"(e.g. 'transformer.blocks.7.attn'); vllm-ascend's bind_kv_cache orders layers by it"
    )


def one_group_config(kv_cache_config: Any, index: int) -> Any:
    """The host's ``KVCacheConfig`` reduced to KV-cache group ``index`` (itself when it has one
    group): ``build_attn_metadata`` walks every group of the config it is given."""
    groups = list(kv_cache_config.kv_cache_groups)
    if not 0 <= index < len(groups):
        raise StateError(
            f"npu (vllm-ascend backend): the host's KVCacheConfig has {len(groups)} KV-cache group(s); "
            f"diffusion-kv's KV-cache group {index} has no counterpart (give the host's own config)"
        )
    if len(groups) == 1:
        return kv_cache_config
    view = copy.copy(kv_cache_config)
    view.kv_cache_groups = [groups[index]]
    return view


def build_attn_metadata(host: HostRuntime, **kwargs: Any) -> dict[str, Any]:
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
    with vllm_config_context(host):
        result = build(**args)
    out = dict(result)
    for name, md in out.items():
        missing = [a for a in ("actual_seq_lengths_q", "seq_lens_list", "block_tables") if not hasattr(md, a)]
        if missing:
            raise StateError(
                f"vllm-ascend returned metadata for layer {name!r} without {missing}; this vllm-ascend "
                "version is not one the npu plugin supports (see docs/ascend.md)"
            )
    return out


NO_HOST_REASON = (
    "it needs the embedding vLLM host's runtime: vllm-ascend's metadata builder and attention impl need "
    "the host's vllm_config, attn_groups and kv_cache_config (PagedWorker(..., host=HostRuntime(...)); "
    "embedding hosts only)"
)


def host_problems(host: HostRuntime | None) -> list[str]:
    """Why this backend cannot serve with ``host`` (empty: it can)."""
    if host is None:
        return [NO_HOST_REASON]
    missing = [
        field
        for field, value in (
            ("config", host.config),
            ("attn_groups", host.attn_groups),
            ("kv_cache_config", host.kv_cache_config),
        )
        if value is None
    ]
    if missing:
        return [
            f"the {host.name} runtime lacks {', '.join(missing)}: vllm-ascend's metadata builder and attention "
            "impl need the host's vllm_config, attn_groups and kv_cache_config"
        ]
    model_config = getattr(host.config, "model_config", None)
    if getattr(model_config, "runner_type", None) == "pooling":
        return [POOLING_REASON]
    return []


def _decoder_attention_type() -> Any:
    for module in VLLM_ATTENTION_TYPE_MODULES:
        try:
            return _import(module).AttentionType.DECODER
        except (ImportError, AttributeError):
            continue
    raise StateError("vLLM's AttentionType was not found (vllm.v1.attention.backend or older path)")


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
    """vllm-ascend's ``AscendBlockTables`` behind the core's BlockTables protocol.

    Its slot mappings are int32: ``slot_mapping_dtype`` exists for the protocol and accepts
    nothing else. Construction checks the installed version set first.
    """

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
        slot_mapping_dtype: torch.dtype = torch.int32,
    ) -> None:
        if slot_mapping_dtype != torch.int32:
            raise ValidationError(
                f"npu (vllm-ascend backend): AscendBlockTables produce int32 slot mappings only; "
                f"got slot_mapping_dtype={slot_mapping_dtype}"
            )
        geometry = self.geometry = BlockTablesGeometry.of(
            block_sizes=block_sizes,
            max_num_reqs=max_num_reqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_blocks_per_group=max_num_blocks_per_group,
            device=device,
            kernel_block_sizes=kernel_block_sizes,
            cp_size=cp_size,
            cp_rank=cp_rank,
            cp_interleave=cp_interleave,
            slot_mapping_dtype=torch.int32,
        )
        check_stack()
        vendor_kwargs = geometry.kwargs()
        del vendor_kwargs["slot_mapping_dtype"]  # AscendBlockTables has int32 slots and no such keyword
        self.inner = _import(BLOCK_TABLE_MODULE).AscendBlockTables(**vendor_kwargs)
        self.slot_mapping_dtype = torch.int32
        self.block_sizes = list(geometry.block_sizes)
        self.kernel_block_sizes = list(geometry.kernel_block_sizes)
        self.blocks_per_kv_block = list(geometry.blocks_per_kv_block)
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


# -- the backend ------------------------------------------------------------------------------


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


class VllmAscendBackend(PagedBackend):
    """A KV-cache group through vllm-ascend's BlockTables, builder and impl (module docstring).

    vllm-ascend's builder counts rows with ``query_len <= 1`` as decodes that must come first;
    ``reorder_batch_threshold = 1`` makes the core enforce that order when a batch is prepared.
    """

    name: ClassVar[str] = "vllm-ascend"
    platform: ClassVar[str] = "npu"
    priority: ClassVar[int] = 200
    description: ClassVar[str] = (
        "vllm-ascend BlockTables, build_attn_metadata (ChunkedPrefill), AscendAttentionBackendImpl"
    )
    capabilities: ClassVar[Capabilities] = CAPABILITIES
    page_layout: ClassVar[KVPageLayout] = KVPageLayout.SEPARATE
    needs_host: ClassVar[bool] = True
    uses_host_kernels: ClassVar[bool] = True

    reorder_batch_threshold: int | None = 1

    # --- selection (class level) --------------------------------------------------------------

    @classmethod
    def is_available(cls) -> Availability:
        if loaded_emulator() is not None:
            return Availability(False, EMULATED_REASON)
        if not _vllm_ascend_importable():
            return Availability(False, NOT_IMPORTABLE_REASON)
        return Availability(True, f"vllm-ascend {_vllm_ascend_version() or '(version unknown)'}")

    @classmethod
    def not_supported_reasons(cls, requirements: Requirements) -> list[str]:
        reasons = super().not_supported_reasons(requirements) + head_count_reasons(requirements)
        return reasons + unverified_notes(requirements) if reasons else reasons

    @classmethod
    def host_reasons(cls, host: HostRuntime | None) -> list[str]:
        """Why the embedding host's runtime rules this backend out (none, incomplete, pooling)."""
        return host_problems(host)

    @classmethod
    def block_tables_cls(cls) -> type[BlockTables]:
        return AscendBlockTablesAdapter

    # --- worker and host hooks ----------------------------------------------------------------

    @classmethod
    def prepare_worker(cls, host: HostRuntime | None) -> None:
        """Version check, then vllm-ascend's worker patches and its config singleton (called by
        ``NpuPlatform.init_worker`` when this backend is the one selected)."""
        host = require_host(host)
        check_stack()
        _import(UTILS_MODULE).adapt_patch()
        _import(ASCEND_CONFIG_MODULE).init_ascend_config(host.config)

    # --- one instance per KV-cache group ------------------------------------------------------

    def __init__(self, group: GroupContext) -> None:
        super().__init__(group)
        if group.cp_size > 1:
            raise UnsupportedFeatureError(
                "the npu plugin's vllm-ascend backend does not implement decode context parallelism (cp_size > 1)"
            )
        check_stack()
        host = self.host = require_host(group.host)
        require_layers(type(self), group.layers)
        problems = [p for p in map(layer_index_problem, group.layer_names) if p is not None]
        if problems:
            raise ValidationError("npu (vllm-ascend backend): " + "; ".join(problems))
        attn_groups = list(host.attn_groups or ())
        if not group.index < len(attn_groups):
            raise StateError(
                f"npu (vllm-ascend backend): the host's runtime has attention groups for {len(attn_groups)} "
                f"KV-cache group(s); diffusion-kv's KV-cache group {group.index} has none"
            )
        self.attn_groups = [attn_groups[group.index]]
        self.kv_cache_config = one_group_config(host.kv_cache_config, group.index)
        attention = _import(ATTENTION_MODULE)
        self.impls: dict[str, Any] = {}
        self.adapters: dict[str, AscendLayerAdapter] = {}
        with vllm_config_context(host):
            for layer in group.layers:
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
                        "vllm-ascend's AscendAttentionBackendImpl has no do_kv_cache_update; the npu "
                        "plugin's write-once contract needs it (vllm-ascend 0.23.0.post1, 0.25.1rc1, "
                        "0.26.0rc1 and 0.30.0rc2 all have it; this backend targets 0.26.0rc1)"
                    )
                self.impls[layer.layer_name] = impl
                self.adapters[layer.layer_name] = AscendLayerAdapter(layer.layer_name, group.device)
        self.padding = PaddingFilter()

    def build(self, batch: PagedBatch) -> dict[str, Any]:
        """vllm-ascend's metadata for every layer of the group (one dict, shared)."""
        self.padding.reset()  # AscendBlockTables rewrites one persistent slot buffer per batch
        out = build_attn_metadata(
            self.host,
            attn_groups=self.attn_groups,
            num_reqs=batch.num_reqs,
            num_tokens=batch.num_tokens,
            query_start_loc_gpu=batch.query_start_loc,
            query_start_loc_cpu=batch.query_start_loc_cpu,
            max_query_len=batch.max_query_len,
            seq_lens=batch.seq_lens,
            max_seq_len=batch.max_seq_len,
            block_tables=(batch.block_table,),
            slot_mappings=batch.slot_mapping[None],
            kv_cache_config=self.kv_cache_config,
            seq_lens_cpu=batch.seq_lens_cpu,
            seq_lens_cpu_upper_bound=batch.seq_lens_cpu,
            dcp_local_seq_lens=batch.dcp_local_seq_lens,
            positions=batch.positions,
            causal=batch.causal,
        )
        missing = [name for name in self.group.layer_names if name not in out]
        if missing:
            raise StateError(
                f"vllm-ascend returned no metadata for layer(s) {missing} of KV-cache group {self.group.index}; "
                "the host's attention groups do not hold these layers"
            )
        return out

    def write_kv(
        self,
        layer: LayerGeometry,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: KVCache,
        slot_mapping: torch.Tensor,
    ) -> None:
        if slot_mapping.dtype != torch.int32:
            raise ValidationError(f"npu: slot mappings must be int32; got {slot_mapping.dtype}")
        tokens = key.shape[0]
        # vllm-ascend's writer is npu_scatter_pa_kv_cache, documented for slots >= 0 only
        kept = self.padding.keep(key, value, slot_mapping[:tokens])
        if kept.empty:
            return
        self.impls[layer.layer_name].do_kv_cache_update(
            self.adapters[layer.layer_name],
            kept.key.contiguous(),
            kept.value.contiguous(),
            kv_cache,
            kept.slots.contiguous(),
        )

    def forward(
        self,
        layer: LayerGeometry,
        query: torch.Tensor,
        kv_cache: KVCache,
        metadata: Any,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        name = layer.layer_name
        target = (
            out if out is not None else query.new_empty((query.shape[0], layer.num_heads, layer.head_size))
        )
        self.impls[name].forward(
            self.adapters[name], query.contiguous(), None, None, kv_cache, metadata[name], target
        )
        return target
