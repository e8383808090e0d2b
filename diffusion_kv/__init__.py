"""diffusion-kv: paged KV caches for diffusion transformers, with hardware plugins.

The public API is what this module exports; everything else may change between releases.

* Plugins and selection: :func:`get_platform`, :func:`available_platforms`,
  :func:`refresh_platforms`, :class:`Platform`, :class:`PagedBackend` and the records of the
  plugin contract (:class:`Capabilities`, :class:`Requirements`, :class:`PagedBatch`, ...).
* Embedding (a worker): :class:`PagedWorker` with :class:`RunnerConfig` and
  :class:`PagedLayerSpec`; the scheduler's snapshots :class:`RequestAllocation`,
  :class:`SequenceAllocation`, :class:`ContextAllocation`; rows and phases :class:`PagedRow`,
  :class:`PhaseRows`; per-forward :class:`AttentionMetadata`; a standalone scheduler-side
  :class:`DiffusionKVAllocator`, and :class:`DiffusionScheduler`, which steps many
  :class:`DiffusionRequest` together, each at its own phase (continuous batching).
* Errors: everything raised for bad input or wrong state derives from :class:`DiffusionKVError`.
"""

from diffusion_kv.core.allocation import ContextAllocation, RequestAllocation, SequenceAllocation
from diffusion_kv.core.allocator import (
    AdmissionError,
    ContextRequest,
    DiffusionKVAllocator,
    FreeListPool,
    KVRequest,
    SequenceRequest,
)
from diffusion_kv.core.backend import GroupContext, KVPageLayout, PagedBackend
from diffusion_kv.core.batch import KVCache, LayerGeometry, PagedBatch
from diffusion_kv.core.capabilities import (
    BASE_MODES,
    AttentionMode,
    Availability,
    Capabilities,
    MultipleOf,
    Requirements,
)
from diffusion_kv.core.errors import (
    AmbiguousPlatformError,
    ConfigurationError,
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
from diffusion_kv.core.layout import AttentionSpec, CacheLayout, KVCacheGroup
from diffusion_kv.core.registry import KVCacheMode
from diffusion_kv.core.rows import PagedRow, PhaseRows
from diffusion_kv.core.runner import PagedLayerSpec, PagedWorker, ParallelConfig, RunnerBackend, RunnerConfig
from diffusion_kv.core.scheduler import (
    BatchEntry,
    DiffusionRequest,
    DiffusionScheduler,
    Phase,
    RequestRecord,
    RequestStatus,
    StepBatch,
    StepReport,
    reap_unreserved,
)
from diffusion_kv.core.sessions import Chunk, Session, SessionCache, SessionPolicy
from diffusion_kv.platforms.interface import Platform
from diffusion_kv.platforms.selection import PlatformStatus, available_platforms, get_platform
from diffusion_kv.platforms.selection import refresh as refresh_platforms

__version__ = "0.2.0"

__all__ = [
    "BASE_MODES",
    "AdmissionError",
    "AmbiguousPlatformError",
    "AttentionMetadata",
    "AttentionMode",
    "AttentionSpec",
    "Availability",
    "BatchEntry",
    "CacheLayout",
    "Capabilities",
    "Chunk",
    "ConfigurationError",
    "ContextAllocation",
    "ContextRequest",
    "DiffusionKVAllocator",
    "DiffusionKVError",
    "DiffusionRequest",
    "DiffusionScheduler",
    "DuplicatePlatformError",
    "FreeListPool",
    "GenerationError",
    "GroupContext",
    "KVCache",
    "KVCacheGroup",
    "KVCacheMode",
    "KVPageLayout",
    "KVRequest",
    "LayerGeometry",
    "MultipleOf",
    "NativeBackendError",
    "PagedBackend",
    "PagedBatch",
    "PagedLayerSpec",
    "PagedRow",
    "PagedWorker",
    "ParallelConfig",
    "Phase",
    "PhaseRows",
    "Platform",
    "PlatformError",
    "PlatformNotFoundError",
    "PlatformStatus",
    "PlatformUnavailableError",
    "PluginLoadError",
    "RequestAllocation",
    "RequestRecord",
    "RequestStatus",
    "Requirements",
    "RunnerBackend",
    "RunnerConfig",
    "SequenceAllocation",
    "SequenceRequest",
    "Session",
    "SessionCache",
    "SessionPolicy",
    "StaleBatchError",
    "StateError",
    "StepBatch",
    "StepReport",
    "UnknownIdentityError",
    "UnknownLayerError",
    "UnsupportedFeatureError",
    "UnsupportedRequirementsError",
    "ValidationError",
    "__version__",
    "available_platforms",
    "get_platform",
    "reap_unreserved",
    "refresh_platforms",
]
