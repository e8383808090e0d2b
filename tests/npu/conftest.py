"""Fixtures of the npu tests: the torch_npu emulator and the npu plugin running under it.

The conformance kit's ``dkv_platform`` fixture is overridden here, so the kit's cases imported
by ``test_conformance_emulated.py`` run on the npu plugin with the emulator installed as
``torch_npu`` for exactly the duration of each test (nothing leaks into other test modules).
The kit's own ``dkv_backend`` fixture then picks the highest-priority *available* backend,
which under the emulator is ``direct`` (vllm-ascend needs CANN).

With ``DIFFUSION_KV_NPU_CONTRACT=<folder>`` (what ``ci/npu_contract_lane.sh`` sets), the
emulator is bound for the whole session to that released torch-npu wheel's schemas and meta
functions (:mod:`diffusion_kv.testing.npu_contract`): every emulated operator call in
``tests/npu``, the conformance kit's included, then goes through the wheel's contract.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from diffusion_kv.platforms.interface import ENV_BACKEND
from diffusion_kv.platforms.npu import NpuPlatform
from diffusion_kv.platforms.npu.compat import ENV_ALLOW_UNTESTED_STACK
from diffusion_kv.testing import TorchNpuEmulator, emulated_torch_npu
from diffusion_kv.testing.npu_contract import CONTRACT_ENV, WheelBinding, bind, load_contract, unbind

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


WHEEL_BINDING = pytest.StashKey[WheelBinding]()


def pytest_configure(config: pytest.Config) -> None:
    # SKU and card-count markers of the Ascend lane (``npu`` itself is in pyproject.toml).
    for line in HARDWARE_MARKERS:
        config.addinivalue_line("markers", line)
    folder = os.environ.get(CONTRACT_ENV)
    if folder:
        config.stash[WHEEL_BINDING] = bind(load_contract(folder))


def pytest_unconfigure(config: pytest.Config) -> None:
    binding = config.stash.get(WHEEL_BINDING, None)
    if binding is not None:
        unbind(binding)


def pytest_report_header(config: pytest.Config) -> list[str]:
    binding = config.stash.get(WHEEL_BINDING, None)
    if binding is None:
        return ["npu: torch_npu emulator with its own schemas (no wheel contract bound)"]
    return ["npu: torch_npu emulator bound to " + binding.describe()[0], *binding.describe()[1:]]


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    binding = config.stash.get(WHEEL_BINDING, None)
    if binding is None:
        return
    terminalreporter.section(f"npu: calls through torch-npu {binding.contract.version}'s contract")
    for op in sorted(binding.specs):
        terminalreporter.write_line(
            f"{op}: {binding.calls[op]} call(s), {binding.meta_checks[op]} checked against the wheel's meta function"
        )


@pytest.fixture(autouse=True)
def _clean_npu_state(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No forced backend and no stack escape hatch (a host's runtime is a value: nothing to reset)."""
    monkeypatch.delenv(ENV_BACKEND, raising=False)
    monkeypatch.delenv(ENV_ALLOW_UNTESTED_STACK, raising=False)
    yield


@pytest.fixture
def npu_emulator() -> Iterator[TorchNpuEmulator]:
    """A fresh emulator installed as ``torch_npu`` for one test."""
    with emulated_torch_npu() as emulator:
        yield emulator


@pytest.fixture
def dkv_platform(npu_emulator: TorchNpuEmulator) -> NpuPlatform:
    """Overrides the conformance kit's fixture: the npu plugin under the emulator."""
    return NpuPlatform()
