"""The embedding host's runtime: what a host owns that some backends need, as one value.

A backend that drives the host's own attention machinery (vllm-ascend's builder and impl, vLLM's
with the host's config) needs objects only the host has: its configuration, its attention groups
and its KV-cache configuration. The host builds one :class:`HostRuntime` and hands it to the
runner (``PagedWorker(platform, config, host=...)``); the runner passes it to selection
(``Platform.select_backend(..., host=...)``) and to each backend instance
(``GroupContext.host``). A backend declares that it needs one (``PagedBackend.needs_host``) and
says what it cannot serve in one (``PagedBackend.host_reasons``); without a host such a backend
is not chosen, and the reason says so.

Nothing here is process-global and nothing imports a host: the fields are the host's own
objects, typed ``Any`` because the core never reads them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from diffusion_kv.core.errors import ValidationError


@dataclass(frozen=True)
class HostRuntime:
    """An embedding host's objects, for the backends that declare ``needs_host``."""

    config: Any = None
    """The host's configuration (vLLM's ``VllmConfig``); None when the host has none."""
    attn_groups: Sequence[Any] | None = None
    """The host's attention groups, one entry per KV-cache group (vLLM's ``init_attn_backend``);
    None when the host built none (a backend needing them says so in its reasons)."""
    kv_cache_config: Any = None
    """The host's KV-cache configuration (vLLM's ``KVCacheConfig``); None when not known yet."""
    block_table_alignment: int = 1
    """Tokens every block-table width is rounded up to (vLLM rounds to 128; 1: no rounding)."""
    name: str = "host"
    """What the host is, for messages (``vLLM-Omni``)."""

    def __post_init__(self) -> None:
        if type(self.block_table_alignment) is not int or self.block_table_alignment <= 0:
            raise ValidationError(
                f"HostRuntime.block_table_alignment must be a positive integer; got {self.block_table_alignment!r}"
            )
        if isinstance(self.attn_groups, (str, bytes)) or not (
            self.attn_groups is None or isinstance(self.attn_groups, Sequence)
        ):
            raise ValidationError(
                "HostRuntime.attn_groups must be a sequence (one entry per KV-cache group) or None; "
                f"got {type(self.attn_groups).__name__}"
            )
        if type(self.name) is not str or not self.name:
            raise ValidationError(f"HostRuntime.name must be a non-empty string; got {self.name!r}")


def check_host(host: object) -> HostRuntime | None:
    """``host`` when it is a :class:`HostRuntime` or None; anything else is refused."""
    if host is not None and not isinstance(host, HostRuntime):
        raise ValidationError(f"host must be a HostRuntime or None; got {type(host).__name__}")
    return host


NO_HOST_REASON = "it needs an embedding host's runtime (HostRuntime: the host's config, attention groups, KV-cache config), and none was given"


__all__ = ["NO_HOST_REASON", "HostRuntime", "check_host"]
