"""The ``OmniPlatform`` diffusion-kv registers with vLLM-Omni (zero-patch embedding).

vLLM-Omni resolves its platform from the entry-point group ``vllm_omni.platform_plugins``; an
out-of-tree plugin wins over its built-in ones. diffusion-kv's plugin
(:func:`diffusion_kv.integrations.vllm_omni.plugin.omni_platform_plugin`) names
:class:`DiffusionKVOmniPlatform`, built here as a subclass of the platform vLLM-Omni would
otherwise have chosen (its built-in detection, else ``UnspecifiedOmniPlatform``): every method
is that platform's, except the diffusion-KV hooks, which the selected diffusion-kv platform
and backend answer (:class:`~.hooks.DiffusionKVPlatformHooks` holds the logic):

==========================================  ===================================================
hook                                        answer
==========================================  ===================================================
``configure_diffusion_vllm_config``         the delegate's, then: choose the backend serving the
                                            configured block size (never changed; a forced one
                                            that cannot is refused), the KV-cache layout it
                                            reads; record the choice
``get_diffusion_kv_block_tables_cls``       the backend's BlockTables (upstream keywords,
                                            vLLM's width rounding, ``num_blocks.np``); for a
                                            vLLM-native backend on a device platform, the
                                            delegate's
``get_diffusion_paged_kv_attn_backend``     a diffusion-kv backend: its vLLM-shaped wrapper
                                            (:mod:`.native`); vLLM-native: the delegate's
                                            (its strict-Ulysses swap included)
``build_diffusion_kv_attn_metadata``        wrapped groups: the backend's ``build``; else the
                                            delegate's (vLLM's builder), with the CPU kernel's
                                            ISA put on the layers where Omni has no platform
``requires_diffusion_paged_kv_prewrite``    True for diffusion-kv backends; else the delegate's
``get_diffusion_attn_backend_cls``          the delegate's; where it has none (CPU):
                                            :class:`~.omni_attention.DiffusionKVTorchAttentionBackend`
``init_diffusion_worker_vllm_config``       the delegate's; for a paged config served by a
                                            diffusion-kv backend, then the diffusion-kv
                                            platform's ``init_worker()``
==========================================  ===================================================

Where vLLM-Omni has no device platform (the delegate is ``UnspecifiedOmniPlatform``, e.g. on
CPU) and the diffusion-kv platform runs its ranks on the CPU, the class also answers the device
questions of vLLM-Omni's worker and runner that the fallback cannot (:class:`CpuDeviceMethods`:
the rank's device, ``set_device``, the device count, ``dist_backend`` from the diffusion-kv
platform, memory and synchronisation) and names the worker class
(:class:`~.worker.CpuDiffusionWorker`: upstream's ``DiffusionWorker`` whose paged KV memory
budget reads host memory), so vLLM-Omni gains a CPU platform its worker starts and pages on.

Opting out follows vLLM-Omni's convention (``VLLM_PLUGINS`` without ``diffusion_kv``); the
platform and backend follow diffusion-kv's (``DIFFUSION_KV_PLATFORM``, ``DIFFUSION_KV_BACKEND``).

This module imports vLLM-Omni; vLLM-Omni imports it through the class path the plugin returns.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
from collections.abc import Callable
from typing import Any

import torch

from diffusion_kv.core.errors import StateError, UnsupportedRequirementsError, ValidationError
from diffusion_kv.integrations.vllm_omni.hooks import (
    CONFIG_KEY,
    Decision,
    DiffusionKVPlatformHooks,
    current_vllm_config,
)
from diffusion_kv.platforms.interface import Platform

logger = logging.getLogger(__name__)

UNSPECIFIED = "vllm_omni.platforms.interface.UnspecifiedOmniPlatform"
ENV_ISA = "DIFFUSION_KV_CPU_VLLM_ISA"


def delegate_qualname() -> str:
    """The platform vLLM-Omni would choose without diffusion-kv (its built-in detection)."""
    platforms = importlib.import_module("vllm_omni.platforms")
    activated = []
    for name, detect in platforms.builtin_omni_platform_plugins.items():
        try:
            qualname = detect()
        except Exception:  # vLLM-Omni ignores a failing detector too
            logger.debug("vLLM-Omni platform detector %s failed", name, exc_info=True)
            continue
        if qualname is not None:
            activated.append(qualname)
    if len(activated) > 1:
        raise RuntimeError(f"more than one vLLM-Omni platform is available: {activated}")
    return activated[0] if activated else UNSPECIFIED


def _resolve(qualname: str) -> Any:
    module, _, name = qualname.rpartition(".")
    return getattr(importlib.import_module(module), name)


class CpuDeviceMethods:
    """The device answers vLLM-Omni asks of its platform when it has none for this machine
    (the delegate is ``UnspecifiedOmniPlatform``) and diffusion-kv's platform runs its ranks on
    the CPU: the worker's ``init_device`` (``get_torch_device``, ``set_device``), its
    distributed init (``dist_backend``, ``get_device_count``) and the runner's memory and
    synchronisation calls.

    The facts come from the selected diffusion-kv platform where it has them (each rank's
    device: ``Platform.device_for_rank``; the ``torch.distributed`` backend:
    ``Platform.distributed_backend``, ``gloo`` for ``cpu``); the rest is what a host is: one
    device per host, nothing to select or wait for, no peak-memory statistics (0), free memory
    the host's. Nothing pretends to be an accelerator."""

    diffusion_kv_hooks: DiffusionKVPlatformHooks
    device_type = "cpu"
    device_name = "cpu"

    @classmethod
    def get_torch_device(cls, local_rank: int | None = None) -> torch.device:
        platform = cls.diffusion_kv_hooks.platform
        device = platform.device_for_rank(0 if local_rank is None else local_rank)
        if device.type != "cpu":
            raise StateError(
                f"diffusion-kv platform {platform.name!r} puts local rank {local_rank} on {device}, "
                "but vLLM-Omni's platform here is diffusion-kv's CPU platform"
            )
        return device

    @classmethod
    def get_device_count(cls) -> int:
        return 1  # the host: every rank's device is the CPU

    @classmethod
    def set_device(cls, device: torch.device) -> None:
        if torch.device(device).type != "cpu":
            raise ValidationError(
                f"diffusion-kv's CPU platform for vLLM-Omni cannot select device {device}: its ranks "
                f"run on cpu (diffusion-kv platform {cls.diffusion_kv_hooks.platform.name!r})"
            )
        return None  # one CPU device: nothing to select

    @classmethod
    def reset_peak_memory_stats(cls, device: Any = None) -> None:
        return None

    @classmethod
    def max_memory_reserved(cls, device: Any = None) -> int:
        return 0

    @classmethod
    def max_memory_allocated(cls, device: Any = None) -> int:
        return 0

    @classmethod
    def synchronize(cls) -> None:
        return None

    @classmethod
    def empty_cache(cls) -> None:
        return None

    @classmethod
    def supports_torch_inductor(cls) -> bool:
        return False

    @classmethod
    def get_diffusion_worker_cls(cls) -> str:
        """vLLM-Omni's ``DiffusionWorker`` with host memory for its paged KV budget
        (:class:`~.worker.CpuDiffusionWorker`; upstream's start-up otherwise unchanged)."""
        from diffusion_kv.integrations.vllm_omni.worker import WORKER_PATH

        return WORKER_PATH

    @classmethod
    def get_free_memory(cls, device: Any = None) -> int:
        pages, size = os.sysconf("SC_AVPHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        return int(pages * size)


def _ranks_on_cpu(platform: Platform) -> bool:
    """Whether ``platform`` runs its ranks on the CPU; else vLLM-Omni, which found no device
    platform here, keeps its fallback's device answers (a warning says so)."""
    device = platform.device_for_rank(0)
    if device.type != "cpu":
        logger.warning(
            "vLLM-Omni has no device platform here, and diffusion-kv platform %r runs on %s: "
            "vLLM-Omni keeps UnspecifiedOmniPlatform's device answers",
            platform.name,
            device,
        )
    return device.type == "cpu"


@functools.cache
def platform_class(delegate: str | None = None) -> type:
    """:class:`DiffusionKVOmniPlatform` over ``delegate`` (default: :func:`delegate_qualname`)."""
    delegate = delegate or delegate_qualname()
    base: Any = _resolve(delegate)
    unspecified = delegate == UNSPECIFIED
    hooks = DiffusionKVPlatformHooks()

    def decision(ulysses_degree: int | None = None) -> Decision:
        return hooks.decision_for(current_vllm_config(), ulysses_degree)

    cpu = unspecified and _ranks_on_cpu(hooks.platform)
    bases: tuple[type, ...] = (CpuDeviceMethods, base) if cpu else (base,)

    class DiffusionKVOmniPlatform(*bases):  # type: ignore[misc]
        diffusion_kv_hooks = hooks
        diffusion_kv_delegate = delegate
        if cpu:
            dist_backend = hooks.platform.distributed_backend

        @classmethod
        def get_diffusion_attn_backend_cls(
            cls, selected_backend: str | None, head_size: int, allow_trtllm_default: bool = False
        ) -> str:
            try:
                return str(
                    super().get_diffusion_attn_backend_cls(selected_backend, head_size, allow_trtllm_default)
                )
            except NotImplementedError:
                from diffusion_kv.integrations.vllm_omni.omni_attention import BACKEND_PATH

                return BACKEND_PATH

        @classmethod
        def configure_diffusion_vllm_config(cls, vllm_config: Any, od_config: Any) -> None:
            super().configure_diffusion_vllm_config(vllm_config, od_config)
            chosen = hooks.configure(vllm_config, od_config)
            logger.info(
                "diffusion-kv serves vLLM-Omni's paged KV with %s (block size %s, KV-cache layout %s)",
                chosen.key,
                vllm_config.cache_config.block_size,
                getattr(vllm_config.cache_config, "kv_cache_layout", None),
            )

        @classmethod
        def init_diffusion_worker_vllm_config(cls, vllm_config: Any) -> None:
            super().init_diffusion_worker_vllm_config(vllm_config)
            extra = getattr(vllm_config, "additional_config", None)
            paged = isinstance(extra, dict) and CONFIG_KEY in extra  # a config we configured
            if paged and not hooks.decision_for(vllm_config).vllm_native:  # those: the delegate's
                hooks.platform.init_worker()

        @classmethod
        def get_diffusion_kv_block_tables_cls(cls) -> Callable[..., Any]:
            # upstream only calls what this returns: a factory serves (OmniBlockTablesFactory)
            chosen = decision()
            if chosen.vllm_native and not unspecified:
                return super().get_diffusion_kv_block_tables_cls()  # type: ignore[no-any-return]
            return hooks.block_tables_factory(chosen.backend)

        @classmethod
        def get_diffusion_paged_kv_attn_backend(cls, attn_backend: type, *, ulysses_degree: int) -> type:
            chosen = decision(ulysses_degree)
            reasons = hooks.ulysses_reasons(chosen.backend, ulysses_degree)
            if reasons:
                raise UnsupportedRequirementsError(
                    f"diffusion-kv backend {chosen.key} cannot page under strict Ulysses degree "
                    f"{ulysses_degree}: " + "; ".join(reasons)
                )
            if chosen.vllm_native:
                return super().get_diffusion_paged_kv_attn_backend(  # type: ignore[no-any-return]
                    attn_backend, ulysses_degree=ulysses_degree
                )
            from diffusion_kv.integrations.vllm_omni.native import vllm_attention_backend_for

            return vllm_attention_backend_for(chosen.backend)

        @classmethod
        def requires_diffusion_paged_kv_prewrite(cls) -> bool:
            if decision().vllm_native:
                return bool(super().requires_diffusion_paged_kv_prewrite())
            return True  # the core (and the wrapped backends) write each layer's K/V once, then read pages

        @classmethod
        def build_diffusion_kv_attn_metadata(cls, **kwargs: Any) -> dict[str, Any]:
            from diffusion_kv.integrations.vllm_omni.native import build_metadata, is_wrapped

            groups = kwargs["attn_groups"]
            wrapped = [is_wrapped(g.backend) for per_group in groups for g in per_group]
            if any(wrapped):
                if not all(wrapped):
                    raise ValidationError(
                        "diffusion-kv cannot build metadata for a mix of its own and vLLM attention backends"
                    )
                chosen = decision()
                block_tables = hooks.block_tables_factory(chosen.backend).latest
                return build_metadata(worker_block_tables=block_tables, platform=hooks.platform, **kwargs)
            if not unspecified:
                return super().build_diffusion_kv_attn_metadata(**kwargs)  # type: ignore[no-any-return]
            _put_isa_on_layers(groups)
            metadata: dict[str, Any] = super().build_diffusion_kv_attn_metadata(**kwargs)
            for native in {id(m): m for m in metadata.values()}.values():
                pin_scheduler_metadata(native)
            return metadata

    DiffusionKVOmniPlatform.__module__ = __name__
    DiffusionKVOmniPlatform.__qualname__ = "DiffusionKVOmniPlatform"
    return DiffusionKVOmniPlatform


CPU_ATTN_MODULE = "vllm.v1.attention.backends.cpu_attn"


def pin_scheduler_metadata(native: Any) -> None:
    """Keep vLLM CPU_ATTN's ``scheduler_metadata`` buffer in place.

    The CPU kernel's scheduler metadata holds pointers into its own buffer. vLLM-Omni's adapter
    replaces the field with a clone for every piecewise segment (a fix for FA3's reused buffer);
    the original buffer is then freed and the clone's pointers dangle (a segfault in the kernel).
    CPU_ATTN builds a fresh buffer per build, so the clone is not needed: the metadata object
    becomes a :class:`~.cpu_attn_pin.PinnedCPUAttentionMetadata`, whose ``__setattr__`` ignores
    a second assignment to the field.
    """
    if type(native).__module__ != CPU_ATTN_MODULE or not isinstance(
        getattr(native, "scheduler_metadata", None), torch.Tensor
    ):
        return
    from diffusion_kv.integrations.vllm_omni.cpu_attn_pin import PinnedCPUAttentionMetadata

    if type(native) is PinnedCPUAttentionMetadata.__mro__[1]:
        native.__class__ = PinnedCPUAttentionMetadata


def _put_isa_on_layers(attn_groups: Any) -> None:
    """vLLM's CPU_ATTN builder records its kernel ISA on vLLM ``Attention`` layers only; its impl
    reads ``layer.isa``. Put it on vLLM-Omni's layer adapters too (bfloat16 uses ``vec``: the
    AMX path dies with SIGILL on CPUs advertising unusable AMX; ``DIFFUSION_KV_CPU_VLLM_ISA``
    overrides)."""
    forced = os.environ.get(ENV_ISA, "").strip()
    for per_group in attn_groups:
        for group in per_group:
            builder = group.get_metadata_builder(0)
            if not hasattr(builder, "isa"):
                continue
            if forced:
                builder.isa = forced
            elif getattr(builder, "dtype", None) == torch.bfloat16:
                builder.isa = "vec"
            context = builder.vllm_config.compilation_config.static_forward_context
            for name in group.layer_names:
                context[name].isa = builder.isa


def __getattr__(name: str) -> Any:
    if name == "DiffusionKVOmniPlatform":
        return platform_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["CpuDeviceMethods", "delegate_qualname", "pin_scheduler_metadata", "platform_class"]
