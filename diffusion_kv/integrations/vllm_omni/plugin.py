"""vLLM-Omni's entry point into diffusion-kv (group ``vllm_omni.platform_plugins``).

``pip install diffusion-kv[vllm-omni]`` registers :func:`omni_platform_plugin` under the name
``diffusion_kv``. vLLM-Omni calls it while resolving ``current_omni_platform``; a class path
returned by an out-of-tree plugin wins over vLLM-Omni's built-in platforms. The path names
:class:`~diffusion_kv.integrations.vllm_omni.platform.DiffusionKVOmniPlatform`, which keeps
everything of the platform vLLM-Omni would have chosen and answers its diffusion-KV hooks
from the diffusion-kv platform that :func:`diffusion_kv.platforms.get_platform` selects
(``DIFFUSION_KV_PLATFORM`` names one; ``DIFFUSION_KV_BACKEND=<platform>:<backend>`` forces a
backend).

* Opt out as vLLM-Omni's plugins do: ``VLLM_PLUGINS`` listing the plugins to load, without
  ``diffusion_kv`` (vLLM-Omni then never calls this function).
* When no diffusion-kv platform can be selected here (none available, or the one
  ``DIFFUSION_KV_PLATFORM`` names is unavailable), the plugin logs why and returns None:
  vLLM-Omni runs exactly as without diffusion-kv.

Importing this module imports neither vLLM nor vLLM-Omni.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

PLATFORM_PATH = "diffusion_kv.integrations.vllm_omni.platform.DiffusionKVOmniPlatform"
PLUGIN_NAME = "diffusion_kv"


def omni_platform_plugin() -> str | None:
    """The class path of diffusion-kv's ``OmniPlatform``, or None when no diffusion-kv platform
    can serve here (the reason is logged as a warning)."""
    from diffusion_kv.core.errors import PlatformError
    from diffusion_kv.platforms.selection import get_platform

    try:
        platform = get_platform()
    except PlatformError as exc:
        logger.warning("diffusion-kv does not serve vLLM-Omni here: %s", exc)
        return None
    logger.info("diffusion-kv serves vLLM-Omni's paged diffusion KV with platform %r", platform.name)
    return PLATFORM_PATH


__all__ = ["PLATFORM_PATH", "PLUGIN_NAME", "omni_platform_plugin"]
