"""The (CANN, torch, torch_npu, vllm, vllm-ascend) version-set check."""

from __future__ import annotations

import pytest
import torch

from diffusion_kv.core.errors import PlatformUnavailableError
from diffusion_kv.platforms.npu.compat import (
    ENV_ALLOW_UNTESTED_STACK,
    SUPPORTED_VLLM_ASCEND_STACKS,
    AscendStack,
    UnsupportedStackError,
    cann_matches,
    cann_release,
    check_supported_stack,
    installed_stack,
    normalize_version,
    stack_mismatches,
    stack_problem,
)
from diffusion_kv.testing import TorchNpuEmulator

from .helpers import without_torch_npu

SUPPORTED = SUPPORTED_VLLM_ASCEND_STACKS[0]


def test_the_supported_set() -> None:
    assert (
        AscendStack(
            cann="9.1.0", torch="2.10.0", torch_npu="2.10.0.post4", vllm="0.26.0", vllm_ascend="0.26.0rc1"
        ),
    ) == SUPPORTED_VLLM_ASCEND_STACKS


@pytest.mark.parametrize(
    ("raw", "normal"),
    [
        ("v0.26.0rc1", "0.26.0rc1"),
        ("2.10.0+cpu", "2.10.0"),
        ("9.1.RC1", "9.1.rc1"),
        (None, None),
        ("+x", None),
    ],
)
def test_normalize_version(raw: str | None, normal: str | None) -> None:
    assert normalize_version(raw) == normal


def test_local_labels_and_prefixes_still_match() -> None:
    installed = AscendStack("9.1.0", "2.10.0+cpu", "2.10.0.post4", "0.26.0+empty", "v0.26.0rc1")
    assert stack_mismatches(installed, SUPPORTED) == []
    assert stack_problem(installed) is None
    check_supported_stack(installed)  # no error


@pytest.mark.parametrize(
    ("raw", "release"),
    [
        ("9.1.0", (9, 1, 0)),
        ("9.1.0.alpha003", (9, 1, 0)),
        ("8.3.RC1", (8, 3)),
        ("25.0.RC1", (25, 0)),
        ("CANN 9.1.0", (9, 1, 0)),
        ("", None),
        (None, None),
    ],
)
def test_cann_release_numbers(raw: str | None, release: tuple[int, ...] | None) -> None:
    assert cann_release(raw) == release


@pytest.mark.parametrize(
    ("installed", "matches"),
    [
        ("9.1.0", True),
        ("9.1.0.alpha003", True),
        ("9.1.0.1", True),
        (" 9.1.0\n", True),
        ("9.1.RC1", False),
        ("9.1", False),
        ("9.10.0", False),
        ("8.5.0", False),
        (None, False),
    ],
)
def test_cann_is_matched_on_its_release_numbers(installed: str | None, matches: bool) -> None:
    """torch.version.cann comes from the CANN runtime's install information; its exact format
    is not documented in the wheel, so only the release numbers are compared."""
    assert cann_matches(installed, "9.1.0") is matches
    stack = AscendStack(installed, "2.10.0", "2.10.0.post4", "0.26.0", "0.26.0rc1")
    assert (stack_mismatches(stack, SUPPORTED) == []) is matches


def test_mismatch_message_is_actionable() -> None:
    installed = AscendStack("9.0.0", "2.10.0", "2.10.0.post2", "0.26.0", None)
    with pytest.raises(UnsupportedStackError) as info:
        check_supported_stack(installed)
    assert isinstance(info.value, PlatformUnavailableError)
    assert str(info.value) == "\n".join(
        [
            "npu (vllm-ascend backend): the installed Ascend software set is not a supported one.",
            "  installed: CANN 9.0.0, torch 2.10.0, torch_npu 2.10.0.post2, vllm 0.26.0, vllm-ascend missing",
            "  differs from the closest supported set in: CANN 9.0.0 (expected 9.1.0); "
            "torch_npu 2.10.0.post2 (expected 2.10.0.post4); vllm-ascend missing (expected 0.26.0rc1)",
            "  supported sets:",
            "    CANN 9.1.0, torch 2.10.0, torch_npu 2.10.0.post4, vllm 0.26.0, vllm-ascend 0.26.0rc1",
            "  to fix, either:",
            "    - use a CANN 9.1.0 image and `pip install vllm==0.26.0 vllm-ascend==0.26.0rc1` "
            "(vllm-ascend pins torch==2.10.0 and torch-npu==2.10.0.post4);",
            "    - or set DIFFUSION_KV_BACKEND=npu:direct to use the direct torch_npu backend (no vLLM needed);",
            "    - or set DIFFUSION_KV_NPU_ALLOW_UNTESTED_STACK=1 to continue with a warning at your own risk.",
        ]
    )


def test_the_closest_supported_set_is_named() -> None:
    other = AscendStack("8.5.1", "2.9.0", "2.9.0", "0.19.1", "0.19.1rc1")
    installed = AscendStack("8.5.1", "2.9.0", "2.9.0", "0.19.1", "0.19.0")
    problem = stack_problem(installed, (SUPPORTED, other))
    assert problem is not None
    assert "differs from the closest supported set in: vllm-ascend 0.19.0 (expected 0.19.1rc1)" in problem
    assert "use a CANN 8.5.1 image and `pip install vllm==0.19.1 vllm-ascend==0.19.1rc1`" in problem


def test_escape_hatch_turns_the_error_into_a_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_ALLOW_UNTESTED_STACK, "1")
    with pytest.warns(RuntimeWarning, match="not a supported one"):
        check_supported_stack(AscendStack(None, "2.13.0", None, None, None))


@without_torch_npu
def test_installed_stack_here() -> None:
    assert installed_stack() == AscendStack(None, torch.__version__, None, None, None)
    emu = TorchNpuEmulator()
    found = installed_stack(emu.module)
    assert found.torch_npu == "2.10.0.post4"  # the emulated module's __version__
    assert found.cann is None  # the emulator reports no CANN (get_cann_version returns "")
