"""KV kept across chunks: autoregressive-diffusion sessions on the attention spec.

A session (:class:`SessionCache.begin_session`) owns committed KV across chunks; each chunk is
reserved, written by the host's denoise steps, then committed (retention releases what slid out
of the window) or aborted (the session exactly as before the chunk). See :mod:`.cache`.
"""

from diffusion_kv.core.sessions.cache import (
    Chunk,
    ChunkState,
    RecachePass,
    Session,
    SessionCache,
    SessionPolicy,
)
from diffusion_kv.core.sessions.contexts import Context, SessionContexts

__all__ = [
    "Chunk",
    "ChunkState",
    "Context",
    "RecachePass",
    "Session",
    "SessionCache",
    "SessionContexts",
    "SessionPolicy",
]
