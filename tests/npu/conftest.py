"""Fixtures of the npu tests: the torch_npu emulator and the npu plugin running under it.

The conformance kit's ``dkv_platform`` fixture is overridden here, so the kit's cases imported
by ``test_conformance_emulated.py`` run on the npu plugin with the emulator installed as
``torch_npu`` for exactly the duration of each test (nothing leaks into other test modules).
The kit's own ``dkv_backend`` fixture then picks the highest-priority *available* backend,
which under the emulator is ``direct`` (vllm-ascend needs CANN).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from diffusion_kv.platforms.interface import ENV_BACKEND
from diffusion_kv.platforms.npu import NpuPlatform
from diffusion_kv.platforms.npu.compat import ENV_ALLOW_UNTESTED_STACK
from diffusion_kv.platforms.npu.runtime import unbind_vllm_runtime
from diffusion_kv.testing import TorchNpuEmulator, emulated_torch_npu

HARDWARE_MARKERS = (
    "A2: Ascend A2 (910B) runners",
    "A3: Ascend A3 runners",
    "A5: Ascend A5 (950) runners",
    "310P: Ascend 310P runners",
    "cards_1: needs 1 NPU card",
    "cards_2: needs 2 NPU cards",
    "cards_4: needs 4 NPU cards",
    "cards_8: needs 8 NPU cards",
)


def pytest_configure(config: pytest.Config) -> None:
    # SKU and card-count markers of the Ascend lane (``npu`` itself is in pyproject.toml).
    for line in HARDWARE_MARKERS:
        config.addinivalue_line("markers", line)


@pytest.fixture(autouse=True)
def _clean_npu_state(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No forced backend, no stack escape hatch and no bound vLLM runtime, before and after."""
    monkeypatch.delenv(ENV_BACKEND, raising=False)
    monkeypatch.delenv(ENV_ALLOW_UNTESTED_STACK, raising=False)
    unbind_vllm_runtime()
    yield
    unbind_vllm_runtime()


@pytest.fixture
def npu_emulator() -> Iterator[TorchNpuEmulator]:
    """A fresh emulator installed as ``torch_npu`` for one test."""
    with emulated_torch_npu() as emulator:
        yield emulator


@pytest.fixture
def dkv_platform(npu_emulator: TorchNpuEmulator) -> NpuPlatform:
    """Overrides the conformance kit's fixture: the npu plugin under the emulator."""
    return NpuPlatform()
