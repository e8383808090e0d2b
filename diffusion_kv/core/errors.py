"""Error hierarchy of diffusion-kv.

Every error derives from :class:`DiffusionKVError`. Where a built-in exception type is the
natural one for callers (``ValueError`` for bad input, ``KeyError`` for an unknown identity,
``RuntimeError`` for a call made in the wrong state), the project error also derives from it,
so ``except ValueError`` keeps working for code written against the upstream adapter.
"""

from __future__ import annotations


class DiffusionKVError(Exception):
    """Base class of every error raised by diffusion-kv."""


# --- plugin discovery and selection -------------------------------------------------------------


class PlatformError(DiffusionKVError):
    """Base class of plugin discovery and selection errors."""


class PlatformNotFoundError(PlatformError, LookupError):
    """A platform was requested by a name that no installed plugin provides."""


class PluginLoadError(PlatformError, ImportError):
    """A plugin's entry point failed to import or failed load-time validation."""


class DuplicatePlatformError(PlatformError):
    """Two entry points claim the same platform name."""


class PlatformUnavailableError(PlatformError, RuntimeError):
    """The requested platform is installed but its detector says it cannot run here."""


class AmbiguousPlatformError(PlatformError, RuntimeError):
    """More than one accelerator platform is available and none was chosen explicitly."""


class UnsupportedRequirementsError(PlatformError, NotImplementedError):
    """No candidate platform or backend supports the requested requirements (reasons aggregated)."""


class ConfigurationError(PlatformError, ValueError):
    """An environment setting has a value the project cannot use (``DIFFUSION_KV_BACKEND``...)."""


# --- data plane ---------------------------------------------------------------------------------


class ValidationError(DiffusionKVError, ValueError):
    """Input rejected before any state was changed."""


class StateError(DiffusionKVError, RuntimeError):
    """A call made in a state that does not allow it (uninitialised, closed, active batch...)."""


class UnknownIdentityError(DiffusionKVError, KeyError):
    """No worker row is installed for the given identity."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else ""


class UnknownLayerError(DiffusionKVError, KeyError):
    """A paged call named a layer that was never registered."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class UnsupportedFeatureError(DiffusionKVError, NotImplementedError):
    """A mode or metadata field that paged attention cannot honour (ring attention, an arbitrary
    mask, unknown metadata); refused rather than silently approximated."""


class StaleBatchError(ValidationError):
    """A prepared batch was activated after a newer preparation or a BlockTables mutation."""


class GenerationError(ValidationError):
    """An allocation snapshot is older than, or conflicts with, the installed one."""


class NativeBackendError(DiffusionKVError, RuntimeError):
    """A platform part (BlockTables, metadata builder, backend) failed; staged state was rolled
    back. The message names the platform, the part and the layer; the original exception is
    ``__cause__``."""
