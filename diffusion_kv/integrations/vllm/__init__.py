"""The one place that touches vLLM internals.

* :mod:`.versions` — supported releases (:data:`~.versions.SUPPORTED_RANGE`) and the API shape
  of each, read from package metadata (no vLLM import);
* :mod:`.compat` — :class:`~.compat.VllmCompat`, the version-compat seam every call goes through;
* :mod:`.tier` — the vLLM-native parts (session, layer adapter, config synthesis) the paged
  backends run on; importing it fails with the supported range on other releases;
* :mod:`.backend` — the paged backends over vLLM (``cuda:vllm-flash-attn``,
  ``cpu:vllm-cpu-attn``), added to those platforms through the ``diffusion_kv.backends``
  entry points.

Importing this package never imports vLLM.
"""

from diffusion_kv.integrations.vllm.versions import (
    SUPPORTED_RANGE,
    UnsupportedVllmVersionError,
    installed_vllm_version,
    shape_for_version,
)

__all__ = ["SUPPORTED_RANGE", "UnsupportedVllmVersionError", "installed_vllm_version", "shape_for_version"]
