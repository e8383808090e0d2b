"""The engine's steps around one vLLM-Omni diffusion worker, for any pipeline (the lane's harness).

vLLM-Omni's engine builds a worker, sizes the KV cache from the worker's specs, reserves blocks
per request in its scheduler and hands the worker each request with its allocation. This module
makes those calls in the engine's place, with vLLM-Omni's (0.30.0) own functions, for a pipeline
the caller builds (:mod:`tiny_dit`, :mod:`hunyuan_image3`):

* :func:`start_worker`: ``create_diffusion_vllm_config`` (which calls the platform's
  ``configure_diffusion_vllm_config``), the worker's ``init_diffusion_worker_vllm_config``, the
  pipeline built under the diffusion and vLLM configs (as the loader builds it), the platform's
  ``init_diffusion_model_runner_runtime``, vLLM-Omni's ``DiffusionModelRunner`` with that
  pipeline (its ``load_model`` is skipped: it would load weights from disk); then in paged mode
  ``runner.get_kv_cache_spec()``, the control plane's ``build_native_kv_cache_configs`` and
  ``resolve_kv_cache_block_sizes``, ``runner.set_kv_cache_config`` and the scheduler's
  ``DiffusionKVCacheManager``;
* :meth:`Worker.execute`: ``DiffusionKVCacheManager.reserve_request``, ``runner.execute_model(req,
  diffusion_kv_metadata=...)`` (install -> activation with ``paged_kv_runtime`` in the forward
  context -> the pipeline's forward -> removal) and ``free_request``;
* :func:`single_rank_parallel_state`: the worker's distributed setup for one rank (vLLM-Omni's
  ``init_distributed_environment`` and ``initialize_model_parallel``), for models built from
  vLLM's parallel layers; torn down on exit so later tests start without it.

Runs in a process whose ``vllm_omni`` is the one under test (installed, or the patched copy).
"""

from __future__ import annotations

import atexit
import dataclasses
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes
from vllm_omni.diffusion.config import set_current_diffusion_config
from vllm_omni.diffusion.data import DiffusionOutput, OmniDiffusionConfig, TransformerConfig
from vllm_omni.diffusion.diffusion_kv.config import DiffusionKVCacheMode
from vllm_omni.diffusion.diffusion_kv.initialization import build_native_kv_cache_configs
from vllm_omni.diffusion.diffusion_kv.manager import DiffusionKVCacheManager
from vllm_omni.diffusion.diffusion_kv.metadata import DiffusionKVMetadata
from vllm_omni.diffusion.diffusion_kv.request import DiffusionKVRequest
from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.diffusion.vllm_config import create_diffusion_vllm_config
from vllm_omni.diffusion.worker.diffusion_model_runner import DiffusionModelRunner
from vllm_omni.inputs.data import OmniDiffusionSamplingParams
from vllm_omni.platforms import current_omni_platform

MODEL_DIR = tempfile.mkdtemp(prefix="omni-lane-model-")
"""An empty local model folder: vLLM-Omni resolves a model id through the Hub when
``HF_HUB_OFFLINE`` is set, a local path as it is (nothing is loaded from it)."""
atexit.register(shutil.rmtree, MODEL_DIR, True)

KV_CACHE_BYTES = 64 << 20
"""The KV memory the engine sizes the cache from (its profile run's answer, in the engine)."""


def od_config(
    *,
    dtype: torch.dtype,
    paged: bool,
    max_model_len: int,
    rows_per_request: int,
    model_type: str,
    max_num_batched_tokens: int | None = None,
) -> OmniDiffusionConfig:
    """The diffusion config of one worker: one request at a time, eager, dense or
    ``paged_scheduler`` with ``rows_per_request`` CFG rows per request; ``max_num_batched_tokens``
    (vLLM's default otherwise) must hold a request-level forward's rows at their longest step."""
    kwargs: dict[str, Any] = {}
    if paged:
        kwargs = {
            "diffusion_kv_mode": "paged_scheduler",
            "diffusion_kv_max_rows_per_request": rows_per_request,
        }
    return OmniDiffusionConfig(
        model=MODEL_DIR,
        dtype=dtype,
        max_num_seqs=1,
        max_model_len=max_model_len,
        max_num_batched_tokens=max_num_batched_tokens,
        enforce_eager=True,
        # vLLM's init_kv_cache reads hf_config.model_type (a real model's transformer config has one)
        tf_model_config=TransformerConfig.from_dict({"model_type": model_type}),
        **kwargs,
    )


def request(request_id: str) -> OmniDiffusionRequest:
    return OmniDiffusionRequest(
        prompt="lane", sampling_params=OmniDiffusionSamplingParams(), request_id=request_id
    )


@dataclass
class Worker:
    """One worker as the engine drives it: the runner, and in paged mode the scheduler's manager."""

    od: OmniDiffusionConfig
    vllm_config: VllmConfig
    runner: DiffusionModelRunner
    manager: DiffusionKVCacheManager | None
    hooks: dict[str, Any] = field(default_factory=dict)
    """Facts the tests check: block size, KV-cache layout, specs, blocks, reservations."""

    @property
    def pipeline(self) -> nn.Module:
        pipeline = self.runner.pipeline
        assert isinstance(pipeline, nn.Module)
        return pipeline

    def execute(self, request_id: str, kv_requests: Sequence[DiffusionKVRequest] = ()) -> DiffusionOutput:
        """One request through the runner; in paged mode its rows are reserved first and the
        blocks released afterwards, on every path (the scheduler's invariant)."""
        req = request(request_id)
        metadata: DiffusionKVMetadata | None = None
        if self.manager is not None:
            metadata = self.manager.reserve_request(request_id, list(kv_requests))
            assert metadata is not None, "the scheduler could not admit the request"
            self.hooks.setdefault("block_ids", []).append([s.block_ids for s in metadata.sequences])
        try:
            result = self.runner.execute_model(req, diffusion_kv_metadata=metadata)
        finally:
            if self.manager is not None:
                self.manager.free_request(request_id)
        return result


def start_worker(
    od: OmniDiffusionConfig,
    build_pipeline: Callable[[VllmConfig], nn.Module],
    *,
    device: torch.device,
    block_size: int | None = None,
    parallel_state: bool = False,
    kv_cache_bytes: int = KV_CACHE_BYTES,
) -> Worker:
    """A worker for ``od`` with the pipeline ``build_pipeline(vllm_config)`` returns (see the
    module docstring). ``block_size``: the deployment's ``CacheConfig.block_size`` (vLLM's
    platform default otherwise), set before the platform's configuration hook sees it (vLLM-Omni
    0.30.0 has no option for it); ``parallel_state``: set up one rank's parallel groups before
    building the model (torn down when the enclosing :func:`single_rank_parallel_state` exits)."""
    with configured_block_size(block_size):
        vllm_config = create_diffusion_vllm_config(device, od)
    current_omni_platform.init_diffusion_worker_vllm_config(vllm_config)
    if parallel_state:
        _ensure_parallel_state(vllm_config, od)
    with set_current_diffusion_config(od), set_current_vllm_config(vllm_config):
        pipeline = build_pipeline(vllm_config)
    current_omni_platform.init_diffusion_model_runner_runtime(
        vllm_config=vllm_config, od_config=od, device=device
    )
    runner = DiffusionModelRunner(vllm_config, od, device)
    runner.pipeline = pipeline
    hooks: dict[str, Any] = {
        "block_size": vllm_config.cache_config.block_size,
        "kv_cache_layout": getattr(vllm_config.cache_config, "kv_cache_layout", None),
    }
    manager = None
    if od.diffusion_kv_mode is DiffusionKVCacheMode.PAGED_SCHEDULER:
        with set_current_vllm_config(vllm_config):
            specs = runner.get_kv_cache_spec()
        hooks["specs"] = {name: dataclasses.asdict(spec) for name, spec in specs.items()}
        worker_configs, scheduler_config = build_native_kv_cache_configs(
            vllm_config, [specs], [kv_cache_bytes]
        )
        block_size, hash_block_size = resolve_kv_cache_block_sizes(scheduler_config, vllm_config)
        runner.set_kv_cache_config(worker_configs[0])
        hooks["num_blocks"] = worker_configs[0].num_blocks
        hooks["kv_cache_layout"] = getattr(vllm_config.cache_config, "kv_cache_layout", None)
        manager = DiffusionKVCacheManager(
            scheduler_config,
            max_model_len=vllm_config.model_config.max_model_len,
            scheduler_block_size=block_size,
            hash_block_size=hash_block_size,
        )
        hooks["free_blocks"] = manager.native_manager.block_pool.get_num_free_blocks()
    return Worker(od, vllm_config, runner, manager, hooks)


@contextmanager
def configured_block_size(block_size: int | None) -> Iterator[None]:
    """Inside this block, the platform's ``configure_diffusion_vllm_config`` first sets
    ``cache_config.block_size`` to ``block_size`` (None: changes nothing)."""
    if block_size is None:
        yield
        return
    cls = type(current_omni_platform)
    saved = cls.__dict__.get("configure_diffusion_vllm_config")
    bound = cls.configure_diffusion_vllm_config

    def configure(_cls: Any, vllm_config: VllmConfig, od: OmniDiffusionConfig) -> None:
        vllm_config.cache_config.block_size = block_size
        bound(vllm_config, od)

    cls.configure_diffusion_vllm_config = classmethod(configure)  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        if saved is None:
            delattr(cls, "configure_diffusion_vllm_config")
        else:
            cls.configure_diffusion_vllm_config = saved  # type: ignore[method-assign]


_PARALLEL_STATE: dict[str, Any] = {"depth": 0, "initialized": False, "process_group": False}


@contextmanager
def single_rank_parallel_state() -> Iterator[None]:
    """Allows :func:`start_worker` to set up one rank's parallel groups inside this block; on
    exit, tears down what it set up (nested blocks tear down at the outermost one)."""
    _PARALLEL_STATE["depth"] += 1
    try:
        yield
    finally:
        _PARALLEL_STATE["depth"] -= 1
        if _PARALLEL_STATE["depth"] == 0 and _PARALLEL_STATE["initialized"]:
            from vllm_omni.diffusion.distributed import parallel_state as ps

            ps.destroy_model_parallel()
            ps.destroy_distributed_environment()
            if _PARALLEL_STATE["process_group"] and torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()
            _PARALLEL_STATE.update(initialized=False, process_group=False)


def _ensure_parallel_state(vllm_config: VllmConfig, od: OmniDiffusionConfig) -> None:
    if _PARALLEL_STATE["depth"] == 0:
        raise RuntimeError("parallel_state=True needs an enclosing single_rank_parallel_state() block")
    if _PARALLEL_STATE["initialized"]:
        return
    from vllm_omni.diffusion.distributed import parallel_state as ps
    from vllm_omni.diffusion.forward_context import set_forward_context

    if not torch.distributed.is_initialized():
        # vLLM-Omni's own init divides by the platform's device count, which is 0 on a CPU host:
        # the one-rank gloo group is created here, then its init adopts it
        store = Path(tempfile.mkdtemp(prefix="omni-lane-dist-")) / "store"
        atexit.register(shutil.rmtree, store.parent, True)
        torch.distributed.init_process_group(
            backend="gloo", init_method=f"file://{store}", world_size=1, rank=0
        )
        _PARALLEL_STATE["process_group"] = True
    with (
        set_forward_context(vllm_config=vllm_config, omni_diffusion_config=od),
        set_current_vllm_config(vllm_config),
    ):
        ps.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo")
        ps.initialize_model_parallel()
    _PARALLEL_STATE["initialized"] = True
