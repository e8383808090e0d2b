"""Platform plugins: the contract, discovery and selection, and the built-in plugins."""

from diffusion_kv.platforms.interface import (
    AttentionMode,
    Availability,
    Capabilities,
    GroupContext,
    KVPageLayout,
    LayerGeometry,
    MultipleOf,
    PagedBackend,
    PagedBatch,
    Platform,
    Requirements,
)
from diffusion_kv.platforms.selection import (
    PlatformStatus,
    available_platforms,
    get_platform,
    refresh,
    select_platform,
)

__all__ = [
    "AttentionMode",
    "Availability",
    "Capabilities",
    "GroupContext",
    "KVPageLayout",
    "LayerGeometry",
    "MultipleOf",
    "PagedBackend",
    "PagedBatch",
    "Platform",
    "PlatformStatus",
    "Requirements",
    "available_platforms",
    "get_platform",
    "refresh",
    "select_platform",
]
