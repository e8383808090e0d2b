"""The AR-diffusion runner end to end: vLLM-Omni's ``ARDiffusionModelRunner`` picked through
``od_config.diffusion_model_runner_cls`` (resolved by import path, as ``DiffusionWorker`` does),
its KV on diffusion-kv sessions (``DiffusionKVARModelRunner``), serving a tiny DreamZero
pipeline request by request through ``execute_model`` -- the runner creates, binds, resets and
closes the sessions; nothing in the test drives the model -- against vLLM-Omni's own runner on
the same weights and requests."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("vllm_omni")

import torch

from tests.vllm_omni import ar_models as M

TOLERANCE = 1e-5
SHAPE = M.DreamZeroShape(max_chunk_size=2)  # window 5 frames: the pipeline resets before it slides
RUNNER = "diffusion_kv.integrations.vllm_omni.ar_runner.DiffusionKVARModelRunner"
HOST_RUNNER = "vllm_omni.experimental.ar_diffusion.runner.ARDiffusionModelRunner"


@pytest.fixture(scope="module")
def env() -> Iterator[Any]:
    with M.environment() as od:
        yield od


def _runner(env: Any, runner_cls: str) -> Any:
    import dataclasses

    from vllm.utils.import_utils import resolve_obj_by_qualname
    from vllm_omni.diffusion.vllm_config import create_diffusion_vllm_config

    od = dataclasses.replace(env, diffusion_model_runner_cls=runner_cls)
    device = torch.device("cpu")
    vllm_config = create_diffusion_vllm_config(device, od)
    runner = resolve_obj_by_qualname(od.diffusion_model_runner_cls)(
        vllm_config=vllm_config, od_config=od, device=device
    )
    runner.pipeline = M.TinyDreamZeroPipeline(SHAPE, seed=11, input_seed=12)
    if runner_cls == HOST_RUNNER:
        runner._preallocate_kv_cache(available_bytes=64 << 20)  # what load_model does after loading
    else:
        runner._preallocate_kv_cache()
    return runner


def test_requests_through_the_runner_match_vllm_omnis_own_runner(env: Any) -> None:
    from diffusion_kv.integrations.vllm_omni import ar_sessions

    ours, theirs = _runner(env, RUNNER), _runner(env, HOST_RUNNER)
    cache = ours.kv_cache
    assert isinstance(cache, ar_sessions.DiffusionKVARCache)
    assert cache.policy.chunk_tokens == SHAPE.frames_per_block * SHAPE.tokens_per_frame
    plan: list[tuple[str, int, dict[str, bool]]] = [
        ("a", 0, {}),
        ("a", 1, {}),
        ("b", 0, {}),  # a second session beside the first
        ("a", 2, {}),  # the pipeline's window reset (text kept)
        ("a", 3, {}),
        ("b", 1, {"close_session": True}),
        ("a", 4, {"reset": True}),  # the runner's reset: a fresh session
        ("a", 5, {}),
    ]
    starts = []
    for sid, index, flags in plan:
        mine = ours.execute_model(M.ar_request(sid, index, **flags)).output
        host = theirs.execute_model(M.ar_request(sid, index, **flags)).output
        torch.testing.assert_close(mine["video"], host["video"], atol=TOLERANCE, rtol=TOLERANCE)
        torch.testing.assert_close(mine["actions"], host["actions"], atol=TOLERANCE, rtol=TOLERANCE)
        starts.append(mine["start"])
    assert starts == [3, 5, 3, 3, 5, 5, 3, 5]
    assert sorted(ours._sessions) == ["a"] and cache.sessions.sessions == ("a/positive", "a/negative")
    ours.close_session("a")
    contexts = cache.sessions.contexts
    assert cache.pool.num_free == cache.pool.num_total
    assert contexts is not None and contexts.allocator.pool.num_free == contexts.allocator.pool.num_total


def test_a_failed_forward_releases_the_session(env: Any) -> None:
    runner = _runner(env, RUNNER)
    cache = runner.kv_cache
    runner.execute_model(M.ar_request("c", 0))
    held = cache.pool.num_total - cache.pool.num_free
    assert held == 4
    with pytest.raises(KeyError):  # a request without its block index fails inside the forward
        runner.execute_model(_without_index("c"))
    assert "c" not in runner._sessions and cache.sessions.sessions == ()
    assert cache.pool.num_free == cache.pool.num_total


def _without_index(session_id: str) -> Any:
    request = M.ar_request(session_id, 1)
    del request.sampling_params.extra_args["index"]
    return request
