"""The (CANN, torch, torch_npu, vllm, vllm-ascend) version sets the npu plugin targets.

vllm-ascend treats these five as one compatibility set; its attention internals (the writer
op, ``build_attn_metadata`` keywords, the BlockTables class) change between releases, so the
``vllm-ascend`` backend (:mod:`diffusion_kv.integrations.vllm_ascend`) refuses to start on a set
it does not know, with a message that says what to install instead. The ``direct`` torch_npu
backend needs no vLLM; it checks operator availability in
:mod:`diffusion_kv.platforms.npu.kernels` instead of versions.

Status (see docs/ascend.md): these sets are *targeted*. The vllm-ascend set is what the
vllm-ascend 0.26.0rc1 wheel states (``Requires-Dist: torch==2.10.0``, ``torch-npu==2.10.0.post4``;
its description: CANN 9.1.0 and the vLLM of the same version). No Ascend hardware was
available: the CI lane ``ci/npu_contract_lane.sh`` checks the names and signatures the backend
uses against that wheel, and everything else ran against the CPU emulator and stand-in modules.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch

from diffusion_kv.core.errors import PlatformUnavailableError

ENV_ALLOW_UNTESTED_STACK = "DIFFUSION_KV_NPU_ALLOW_UNTESTED_STACK"
"""Set to ``1`` to continue (with a warning) on a version set that is not listed."""

_LABELS = {
    "cann": "CANN",
    "torch": "torch",
    "torch_npu": "torch_npu",
    "vllm": "vllm",
    "vllm_ascend": "vllm-ascend",
}


@dataclass(frozen=True)
class AscendStack:
    """One version of each component; ``None`` means not installed / unknown."""

    cann: str | None
    torch: str | None
    torch_npu: str | None
    vllm: str | None
    vllm_ascend: str | None

    def describe(self) -> str:
        return ", ".join(f"{_LABELS[f.name]} {getattr(self, f.name) or 'missing'}" for f in fields(self))


SUPPORTED_VLLM_ASCEND_STACKS: tuple[AscendStack, ...] = (
    AscendStack(
        cann="9.1.0", torch="2.10.0", torch_npu="2.10.0.post4", vllm="0.26.0", vllm_ascend="0.26.0rc1"
    ),
)
"""vllm-ascend v0.26.0rc1's published set (the first vllm-ascend aligned with a vLLM release
inside this project's vLLM range, 0.26-0.33, and one that writes with
``npu_scatter_pa_kv_cache(cache_mode="Norm")``)."""

DIRECT_BACKEND_TARGET = AscendStack(
    cann="9.1.0", torch="2.10.0", torch_npu="2.10.0.post4", vllm=None, vllm_ascend=None
)
"""What the direct backend is written against (operator schemas are identical in torch_npu 2.14.0)."""


class UnsupportedStackError(PlatformUnavailableError):
    """The installed Ascend software set is not one the vllm-ascend backend supports."""


def normalize_version(version: str | None) -> str | None:
    """``v0.26.0rc1`` / ``2.10.0+cpu`` / ``9.1.RC1`` -> a comparable form (no local label)."""
    if version is None:
        return None
    text = version.strip().lower()
    text = text.removeprefix("v")
    return text.split("+", 1)[0] or None


def cann_release(version: str | None) -> tuple[int, ...] | None:
    """The leading numeric components of a CANN version string (``"9.1.0"`` -> ``(9, 1, 0)``;
    ``"9.1.0.alpha003"`` -> ``(9, 1, 0)``; ``"8.3.RC1"`` -> ``(8, 3)``), or None without digits.

    torch_npu reports the CANN version (``torch.version.cann``,
    ``torch_npu.npu.utils.get_cann_version``) as the CANN runtime gives it, read from the
    toolkit's install information; its exact format is not documented in the wheel (strings of
    the forms above appear in torch_npu's own version checks), so it is matched on the release
    numbers only.
    """
    if version is None:
        return None
    found = re.search(r"\d+(?:\.\d+)*", version)
    if found is None:
        return None
    return tuple(int(part) for part in found.group(0).split("."))


def cann_matches(installed: str | None, expected: str) -> bool:
    """Whether ``installed`` is the CANN release ``expected``: its release numbers start with
    all of the expected ones (a build or pre-release suffix is tolerated; ``9.1.RC1`` is not
    ``9.1.0``)."""
    have, want = cann_release(installed), cann_release(expected)
    return have is not None and want is not None and have[: len(want)] == want


def _dist_version(*names: str) -> str | None:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _cann_version(torch_npu_module: Any | None) -> str | None:
    getter = getattr(getattr(getattr(torch_npu_module, "npu", None), "utils", None), "get_cann_version", None)
    if callable(getter):
        try:
            found = getter(module="CANN")
        except Exception:  # an old torch_npu without this helper's CANN query: fall back below
            found = None
        if isinstance(found, str) and found:
            return found
    found = getattr(torch.version, "cann", None)
    return found if isinstance(found, str) and found else None


def installed_stack(torch_npu_module: Any | None = None) -> AscendStack:
    """Versions installed here (distribution metadata; CANN through torch_npu)."""
    npu_version = _dist_version("torch-npu", "torch_npu")
    if npu_version is None and torch_npu_module is not None:
        npu_version = getattr(torch_npu_module, "__version__", None)
    return AscendStack(
        cann=_cann_version(torch_npu_module),
        torch=torch.__version__,
        torch_npu=npu_version,
        vllm=_dist_version("vllm"),
        vllm_ascend=_dist_version("vllm-ascend", "vllm_ascend"),
    )


def stack_mismatches(installed: AscendStack, supported: AscendStack) -> list[str]:
    """Components of ``installed`` that differ from ``supported`` (empty: a match)."""
    out = []
    for f in fields(AscendStack):
        want = normalize_version(getattr(supported, f.name))
        if want is None:
            continue
        raw = getattr(installed, f.name)
        same = cann_matches(raw, want) if f.name == "cann" else normalize_version(raw) == want
        if not same:
            out.append(f"{_LABELS[f.name]} {raw or 'missing'} (expected {want})")
    return out


def stack_problem(
    installed: AscendStack, supported: Sequence[AscendStack] = SUPPORTED_VLLM_ASCEND_STACKS
) -> str | None:
    """None when ``installed`` matches a supported set; else the actionable message."""
    by_set = [(s, stack_mismatches(installed, s)) for s in supported]
    if any(not mismatches for _, mismatches in by_set):
        return None
    closest, mismatches = min(by_set, key=lambda item: len(item[1]))
    lines = [
        "npu (vllm-ascend backend): the installed Ascend software set is not a supported one.",
        f"  installed: {installed.describe()}",
        f"  differs from the closest supported set in: {'; '.join(mismatches)}",
        "  supported sets:",
        *(f"    {s.describe()}" for s in supported),
        "  to fix, either:",
        f"    - use a CANN {closest.cann} image and `pip install vllm=={closest.vllm} "
        f"vllm-ascend=={closest.vllm_ascend}` (vllm-ascend pins torch=={closest.torch} and "
        f"torch-npu=={closest.torch_npu});",
        "    - or set DIFFUSION_KV_BACKEND=npu:direct to use the direct torch_npu backend (no vLLM needed);",
        f"    - or set {ENV_ALLOW_UNTESTED_STACK}=1 to continue with a warning at your own risk.",
    ]
    return "\n".join(lines)


def check_supported_stack(
    installed: AscendStack, supported: Sequence[AscendStack] = SUPPORTED_VLLM_ASCEND_STACKS
) -> None:
    """Raise :class:`UnsupportedStackError` (or warn, when allowed) on an unknown set."""
    problem = stack_problem(installed, supported)
    if problem is None:
        return
    if os.environ.get(ENV_ALLOW_UNTESTED_STACK) == "1":
        warnings.warn(problem, RuntimeWarning, stacklevel=2)
        return
    raise UnsupportedStackError(problem)
