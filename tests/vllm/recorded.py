"""Recorded signatures of the vLLM internals the seam calls, per API shape.

Each stand-in has the parameter list of the named release (from the 0.26, 0.28, 0.29, 0.30,
0.31, 0.32 and 0.33 sources) and records how it was called, so the seam is checked for every
supported shape without vLLM installed. Bodies do only what the seam observes.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

Calls = list[tuple[str, dict[str, Any]]]


def _bind(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    return dict(inspect.signature(fn).bind(*args, **kwargs).arguments)


# -- init_kv_cache ---------------------------------------------------------------------------------


def init_kv_cache_024_028(
    runner_kv_caches,
    forward_context,
    kv_cache_config,
    attn_groups,
    device,
    cache_dtype,
    kernel_block_sizes,
    vllm_config,
):  # type: ignore[no-untyped-def]
    raise AssertionError("recorded signature only")


def init_kv_cache_029(
    runner_kv_caches,
    forward_context,
    kv_cache_config,
    device,
    kernel_block_sizes,
    vllm_config,
    kv_cache_allocation_context=None,
):  # type: ignore[no-untyped-def]
    raise AssertionError("recorded signature only")


def init_kv_cache_030_031(
    forward_context,
    kv_cache_config,
    device,
    kernel_block_sizes,
    vllm_config,
    kv_cache_allocation_context=None,
    *,
    block_tables=None,
):  # type: ignore[no-untyped-def]
    raise AssertionError("recorded signature only")


def init_kv_cache_032_033(
    forward_context,
    kv_cache_config,
    device,
    kernel_block_sizes,
    vllm_config,
    kv_cache_allocation_context=None,
    *,
    block_tables=None,
    attn_groups=(),
):  # type: ignore[no-untyped-def]
    raise AssertionError("recorded signature only")


# -- BlockTables constructors ----------------------------------------------------------------------


def block_tables_026_028(
    self,
    block_sizes,
    max_num_reqs,
    max_num_batched_tokens,
    max_num_blocks_per_group,
    device,
    kernel_block_sizes,
    cp_size=1,
    cp_rank=0,
    cp_interleave=1,
):  # type: ignore[no-untyped-def]
    raise AssertionError("recorded signature only")


def block_tables_029_030(
    self,
    block_sizes,
    max_num_reqs,
    max_num_batched_tokens,
    max_num_blocks_per_group,
    device,
    kernel_block_sizes,
    cp_size=1,
    cp_rank=0,
    cp_interleave=1,
    slot_mapping_enabled=None,
):  # type: ignore[no-untyped-def]
    raise AssertionError("recorded signature only")


def block_tables_031(
    self,
    block_sizes,
    max_num_reqs,
    max_num_batched_tokens,
    max_num_blocks_per_group,
    device,
    kernel_block_sizes,
    cp_size=1,
    cp_rank=0,
    cp_interleave=1,
    slot_mapping_enabled=None,
    dcp_sharded=None,
):  # type: ignore[no-untyped-def]
    raise AssertionError("recorded signature only")


def block_tables_032(
    self,
    block_sizes,
    max_num_reqs,
    max_num_batched_tokens,
    max_num_blocks_per_group,
    device,
    cp_size=1,
    cp_rank=0,
    cp_interleave=1,
    slot_mapping_enabled=None,
    dcp_sharded=None,
):  # type: ignore[no-untyped-def]
    raise AssertionError("recorded signature only")


def block_tables_033(
    self,
    block_sizes,
    max_num_reqs,
    max_num_batched_tokens,
    max_num_blocks_per_group,
    device,
    cp_size=1,
    cp_rank=0,
    cp_interleave=1,
    slot_mapping_enabled=None,
    dcp_sharded=None,
    sliding_window_reach=None,
):  # type: ignore[no-untyped-def]
    raise AssertionError("recorded signature only")


# -- get_block_table_width -------------------------------------------------------------------------


def get_block_table_width_027_031(max_num_blocks, block_size, kernel_block_size=None, *, token_alignment=128):  # type: ignore[no-untyped-def]
    if kernel_block_size is None:
        kernel_block_size = block_size
    if token_alignment is not None:
        from math import gcd

        align = token_alignment // gcd(token_alignment, block_size)
        max_num_blocks = -(-max_num_blocks // align) * align
    return max_num_blocks * block_size // kernel_block_size


def get_block_table_width_032_033(max_num_blocks, block_size, *, token_alignment=128):  # type: ignore[no-untyped-def]
    return get_block_table_width_027_031(max_num_blocks, block_size, token_alignment=token_alignment)


# -- build_attn_metadata / init_attn_backend -------------------------------------------------------


def build_attn_metadata_026_031(
    attn_groups,
    num_reqs,
    num_tokens,
    query_start_loc_gpu,
    query_start_loc_cpu,
    max_query_len,
    seq_lens,
    max_seq_len,
    block_tables,
    slot_mappings,
    kv_cache_config,
    seq_lens_cpu_upper_bound=None,
    dcp_local_seq_lens=None,
    positions=None,
    is_prefilling=None,
    mm_req_doc_ranges=None,
    model_specific_attn_metadata=None,
    for_cudagraph_capture=False,
    causal=True,
    rswa_prefix_lens=None,
):  # type: ignore[no-untyped-def]
    raise AssertionError("recorded signature only")


def build_attn_metadata_032_033(
    attn_groups,
    num_reqs,
    num_tokens,
    query_start_loc_gpu,
    query_start_loc_cpu,
    max_query_len,
    seq_lens,
    max_seq_len,
    block_tables,
    slot_mappings,
    kv_cache_config,
    seq_lens_cpu_upper_bound=None,
    dcp_local_seq_lens=None,
    dcp_local_seq_lens_cpu_upper_bound=None,
    positions=None,
    is_prefilling=None,
    mm_req_doc_ranges=None,
    model_specific_attn_metadata=None,
    for_cudagraph_capture=False,
    causal=True,
    rswa_prefix_lens=None,
    ubatch_idx=0,
    fast_prefill=None,
    req_idx=None,
):  # type: ignore[no-untyped-def]
    raise AssertionError("recorded signature only")


def init_attn_backend_all(
    kv_cache_config, vllm_config, device, active_layer_names=None, draft_layer_names=None
):  # type: ignore[no-untyped-def]
    raise AssertionError("recorded signature only")


RECORDED: dict[str, dict[str, Any]] = {
    "0.26": {
        "init_kv_cache": init_kv_cache_024_028,
        "BlockTables.__init__": block_tables_026_028,
        "get_block_table_width": None,
        "build_attn_metadata": build_attn_metadata_026_031,
    },
    "0.27-0.28": {
        "init_kv_cache": init_kv_cache_024_028,
        "BlockTables.__init__": block_tables_026_028,
        "get_block_table_width": get_block_table_width_027_031,
        "build_attn_metadata": build_attn_metadata_026_031,
    },
    "0.29": {
        "init_kv_cache": init_kv_cache_029,
        "BlockTables.__init__": block_tables_029_030,
        "get_block_table_width": get_block_table_width_027_031,
        "build_attn_metadata": build_attn_metadata_026_031,
    },
    "0.30-0.31": {
        "init_kv_cache": init_kv_cache_030_031,
        "BlockTables.__init__": block_tables_031,
        "get_block_table_width": get_block_table_width_027_031,
        "build_attn_metadata": build_attn_metadata_026_031,
    },
    "0.32-0.33": {
        "init_kv_cache": init_kv_cache_032_033,
        "BlockTables.__init__": block_tables_033,
        "get_block_table_width": get_block_table_width_032_033,
        "build_attn_metadata": build_attn_metadata_032_033,
    },
}
"""Per shape name: the recorded callables (None: absent in that release)."""

EXTRA_BLOCK_TABLE_SIGNATURES = {"0.30": block_tables_029_030, "0.32": block_tables_032}
"""Constructor variants inside a shape (0.30 lacks ``dcp_sharded``; 0.32 lacks the window reach)."""


class Recorder:
    """A resolver for :class:`VllmCompat` returning stand-ins with recorded signatures."""

    def __init__(self, shape_name: str, block_tables_init: Callable[..., Any] | None = None) -> None:
        self.shape_name = shape_name
        self.recorded = RECORDED[shape_name]
        self.calls: Calls = []
        self.resolved: list[str] = []
        self.block_tables_init = block_tables_init or self.recorded["BlockTables.__init__"]

    def __call__(self, key: str) -> Any:
        self.resolved.append(key)
        factory = getattr(self, f"make_{key}", None)
        if factory is None:
            raise AttributeError(f"no stand-in for {key!r}")
        return factory()

    def _recording(
        self, name: str, signature_of: Callable[..., Any], result: Callable[..., Any]
    ) -> Callable[..., Any]:
        def fn(*args: Any, **kwargs: Any) -> Any:
            bound = _bind(signature_of, args, kwargs)
            self.calls.append((name, bound))
            return result(bound)

        fn.__signature__ = inspect.signature(signature_of)  # type: ignore[attr-defined]
        return fn

    def make_init_kv_cache(self) -> Callable[..., Any]:
        def allocate(bound: dict[str, Any]) -> Any:
            caches = {}
            for group in bound["kv_cache_config"].kv_cache_groups:
                for name in group.layer_names:
                    cache = torch.zeros(2, 4)
                    bound["forward_context"][name].kv_cache = cache
                    caches[name] = cache
            if "runner_kv_caches" in bound:
                bound["runner_kv_caches"].extend(caches.values())
                return None
            return caches

        return self._recording("init_kv_cache", self.recorded["init_kv_cache"], allocate)

    def make_get_block_table_width(self) -> Callable[..., Any]:
        recorded = self.recorded["get_block_table_width"]
        if recorded is None:
            raise ImportError(f"cannot import name 'get_block_table_width' (vLLM {self.shape_name})")
        return self._recording("get_block_table_width", recorded, lambda b: recorded(**b))

    def make_build_attn_metadata(self) -> Callable[..., Any]:
        return self._recording(
            "build_attn_metadata",
            self.recorded["build_attn_metadata"],
            lambda b: {
                name: ("md", b.get("causal", True))
                for g in b["kv_cache_config"].kv_cache_groups
                for name in g.layer_names
            },
        )

    def make_init_attn_backend(self) -> Callable[..., Any]:
        return self._recording(
            "init_attn_backend", init_attn_backend_all, lambda b: ([["group"]], "cg", [16])
        )

    def make_BlockTables(self) -> type:
        recorder = self
        signature_of = self.block_tables_init

        class BlockTables:
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                bound = _bind(signature_of, (self, *args), kwargs)
                bound.pop("self")
                recorder.calls.append(("BlockTables", bound))
                self.block_sizes = bound["block_sizes"]
                if "kernel_block_sizes" in bound:
                    self.kernel_block_sizes = bound["kernel_block_sizes"]
                    self.blocks_per_kv_block = [
                        bs // kbs
                        for bs, kbs in zip(bound["block_sizes"], bound["kernel_block_sizes"], strict=True)
                    ]

        return BlockTables
