"""The AR-diffusion runner on diffusion-kv sessions inside vLLM-Omni's own ``DiffusionWorker``
on diffusion-kv's CPU platform: the worker resolves ``od_config.diffusion_model_runner_cls``
(``DiffusionKVARModelRunner``), initialises its device and one-rank groups; the tiny DreamZero
pipeline stands in for the weights (``skip_load_model=True``; the runner's ``load_model`` then
builds the session KV from the pipeline's spec: ``_preallocate_kv_cache``), and requests go
through ``DiffusionWorker.execute_model``; ``shutdown()`` leaves no process group."""

from __future__ import annotations

import dataclasses
import sys

import pytest

pytest.importorskip("vllm_omni")

import torch
import torch.distributed as dist
from vllm.config import set_current_vllm_config
from vllm_omni.diffusion.config import set_current_diffusion_config

from diffusion_kv.integrations.vllm_omni import ar_runner, ar_sessions
from tests.vllm_omni import ar_models as M
from tests.vllm_omni import engine
from tests.vllm_omni.test_worker_startup import diffusion_worker_cls, worker_process  # noqa: F401

SHAPE = M.DreamZeroShape(max_chunk_size=2)


def _worker_cls() -> type:
    """``DiffusionWorker``, imported without the AR harness's torchvision stand-ins in place
    (its own import shim looks for torchvision; the stand-ins would hide that it is missing)."""
    standins = {
        name: sys.modules.pop(name)
        for name in M.TORCHVISION_STANDINS
        if name in sys.modules and getattr(sys.modules[name], "__file__", None) is None
    }
    try:
        return diffusion_worker_cls()
    finally:
        sys.modules.update(standins)


@torch.no_grad()
def test_the_worker_builds_the_session_runner_and_serves_requests(worker_process: None) -> None:  # noqa: F811
    worker_cls = _worker_cls()
    M._standins()
    od = dataclasses.replace(
        engine.od_config(
            dtype=torch.float32, paged=False, max_model_len=4096, rows_per_request=1, model_type="ar"
        ),
        diffusion_model_runner_cls=f"{ar_runner.__name__}.DiffusionKVARModelRunner",
    )
    worker = worker_cls(local_rank=0, rank=0, od_config=od, skip_load_model=True)
    try:
        runner = worker.model_runner
        assert type(runner) is ar_runner.DiffusionKVARModelRunner
        with set_current_diffusion_config(worker.od_config), set_current_vllm_config(worker.vllm_config):
            runner.pipeline = M.TinyDreamZeroPipeline(SHAPE, seed=11, input_seed=12)
        runner._preallocate_kv_cache()
        cache = runner.kv_cache
        assert isinstance(cache, ar_sessions.DiffusionKVARCache)
        starts = []
        for index in range(3):
            result = worker.execute_model(M.ar_request("w", index), worker.od_config)
            assert result.error is None
            starts.append(result.output["start"])
        assert starts == [3, 5, 3]  # the pipeline's window reset at frame 5
        assert cache.sessions.sessions == ("w/positive", "w/negative")
        runner.close_session("w")
        assert cache.pool.num_free == cache.pool.num_total
    finally:
        worker.shutdown()
    assert not dist.is_initialized()
