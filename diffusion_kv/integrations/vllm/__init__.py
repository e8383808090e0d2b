"""The one place that touches vLLM internals.

* :mod:`.versions` — supported releases (:data:`~.versions.SUPPORTED_RANGE`) and the API shape
  of each, read from package metadata (no vLLM import);
* :mod:`.compat` — :class:`~.compat.VllmCompat`, the version-compat seam every call goes through;
* :mod:`.tier` — the vLLM-native parts (session, layer adapter, metadata builder, paged backend)
  shared by the platform tiers; importing it fails with the supported range on other releases;
* :mod:`.cuda_tier` — what the ``cuda`` plugin calls to prefer vLLM's FlashAttention tier.

Importing this package never imports vLLM.
"""

from diffusion_kv.integrations.vllm.versions import (
    SUPPORTED_RANGE,
    UnsupportedVllmVersionError,
    installed_vllm_version,
    shape_for_version,
)

__all__ = ["SUPPORTED_RANGE", "UnsupportedVllmVersionError", "installed_vllm_version", "shape_for_version"]
