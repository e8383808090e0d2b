"""KV kept across chunks: autoregressive-diffusion sessions on the attention spec.

A session (:class:`SessionCache.begin_session`) owns committed KV across chunks; each chunk is
reserved, written by the host's denoise steps, then committed (retention releases what slid out
of the window) or aborted (the session exactly as before the chunk). See :mod:`.cache`; at scale:
:mod:`.batching` (many sessions per step beside one-shot requests), :mod:`.admission`,
:mod:`.offload`, :mod:`.sharing`. The host's guide: ``docs/sessions.md``.
"""

from diffusion_kv.core.sessions.admission import Admission, admission
from diffusion_kv.core.sessions.batching import (
    ChunkEntry,
    MixedReport,
    MixedStep,
    SessionBatch,
    SessionScheduler,
)
from diffusion_kv.core.sessions.cache import (
    Chunk,
    ChunkState,
    RecachePass,
    Session,
    SessionCache,
    SessionPolicy,
)
from diffusion_kv.core.sessions.contexts import Context, ContextReader, SessionContexts
from diffusion_kv.core.sessions.offload import OffloadedKV, lru_offloader, offload, offload_lru, reload
from diffusion_kv.core.sessions.sharing import SharedBegin, SharedStarts

__all__ = [
    "Admission",
    "Chunk",
    "ChunkEntry",
    "ChunkState",
    "Context",
    "ContextReader",
    "MixedReport",
    "MixedStep",
    "OffloadedKV",
    "RecachePass",
    "Session",
    "SessionBatch",
    "SessionCache",
    "SessionContexts",
    "SessionPolicy",
    "SessionScheduler",
    "SharedBegin",
    "SharedStarts",
    "admission",
    "lru_offloader",
    "offload",
    "offload_lru",
    "reload",
]
