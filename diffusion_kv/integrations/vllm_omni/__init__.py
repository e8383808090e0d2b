"""diffusion-kv inside vLLM-Omni, two ways (``docs/vllm-omni.md``).

* **Zero-patch embedding** (:mod:`.plugin`, :mod:`.platform`, :mod:`.hooks`, :mod:`.native`,
  :mod:`.omni_attention`): ``pip install diffusion-kv[vllm-omni]`` registers an entry point in
  ``vllm_omni.platform_plugins``; the ``OmniPlatform`` it names answers vLLM-Omni's diffusion-KV
  hooks from the selected diffusion-kv platform and backend and delegates everything else to
  the platform vLLM-Omni would otherwise have chosen. vLLM-Omni's own paged module runs
  unchanged.
* **Module replacement** (:mod:`.runner`, :mod:`.records`): upstream's
  ``DiffusionKVModelRunnerBackend`` and paged-attention classes, with upstream's names and
  semantics, on diffusion-kv's core; ``patches/vllm-omni-0.30.0.patch`` swaps vLLM-Omni's module
  for it.

Importing this package (or any name listed in ``__all__``) imports neither vLLM nor vLLM-Omni;
it checks that the installed vLLM-Omni and vLLM are a working pair
(:func:`.pairing.check_pairing`, from package metadata) and refuses another with
:class:`.pairing.UnsupportedPairingError`.
"""

from __future__ import annotations

import importlib
from typing import Any

from diffusion_kv.integrations.vllm_omni.pairing import check_pairing

check_pairing()

_EXPORTS = {
    "DiffusionKVPlatformHooks": "hooks",
    "Decision": "hooks",
    "DiffusionKVModelRunnerBackend": "runner",
    "DiffusionPagedAttentionAdapter": "runner",
    "DiffusionPagedAttentionContext": "runner",
    "DiffusionPagedAttentionLayerAdapter": "runner",
    "DiffusionPagedAttentionRuntime": "runner",
    "DiffusionPagedAttentionMetadata": "records",
    "DiffusionPagedAttentionRow": "records",
    "DiffusionPagedAttentionRowBinding": "records",
    "allocation_from_metadata": "records",
    "content_from_host": "prefix",
    "host_prefix_keys": "prefix",
    "phase_rows_from_metadata": "records",
    "omni_platform_plugin": "plugin",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
