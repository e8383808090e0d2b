"""diffusion-kv: paged KV caches for diffusion transformers, with hardware plugins.

Public API (everything else is internal and may change):

* :func:`get_platform` / :func:`available_platforms` / :func:`refresh_platforms` — plugin
  selection and status;
* the plugin contract in :mod:`diffusion_kv.platforms.interface`.
"""

from diffusion_kv.core.errors import (
    AmbiguousPlatformError,
    DiffusionKVError,
    DuplicatePlatformError,
    GenerationError,
    NativeBackendError,
    PlatformError,
    PlatformNotFoundError,
    PlatformUnavailableError,
    PluginLoadError,
    StaleBatchError,
    StateError,
    UnknownIdentityError,
    UnknownLayerError,
    UnsupportedFeatureError,
    UnsupportedRequirementsError,
    ValidationError,
)
from diffusion_kv.core.layer_context import AttentionMetadata
from diffusion_kv.platforms.interface import (
    AttentionMode,
    Availability,
    Capabilities,
    KVWritePolicy,
    MultipleOf,
    Platform,
    Requirements,
)
from diffusion_kv.platforms.selection import PlatformStatus, available_platforms, get_platform
from diffusion_kv.platforms.selection import refresh as refresh_platforms

__version__ = "0.1.0"

__all__ = [
    "AmbiguousPlatformError",
    "AttentionMetadata",
    "AttentionMode",
    "Availability",
    "Capabilities",
    "DiffusionKVError",
    "DuplicatePlatformError",
    "GenerationError",
    "KVWritePolicy",
    "MultipleOf",
    "NativeBackendError",
    "Platform",
    "PlatformError",
    "PlatformNotFoundError",
    "PlatformStatus",
    "PlatformUnavailableError",
    "PluginLoadError",
    "Requirements",
    "StaleBatchError",
    "StateError",
    "UnknownIdentityError",
    "UnknownLayerError",
    "UnsupportedFeatureError",
    "UnsupportedRequirementsError",
    "ValidationError",
    "__version__",
    "available_platforms",
    "get_platform",
    "refresh_platforms",
]
