"""Prefix sharing: sessions that start from the same first chunk(s) share those blocks.

Sessions of one model that begin from the same first frame or prompt compute the same K/V for
their first chunks. :class:`SharedStarts` begins such a session from a content key the host
provides (a digest of the first frame's latents, of the prompt's token ids, ...) through the
allocator's prefix cache (:mod:`diffusion_kv.core.prefix_cache`):

* ``begin(session_id, content_key, chunks, branches)`` reserves the first ``chunks`` chunks at
  once, each branch a row keyed block by block under a namespace of the model identity, the
  session mask (chunk, window, sink), the shared length, the worker's KV layout (attention mode,
  block size, the pages' dtype and a digest of the fp8 scales) and the branch
  (:func:`~diffusion_kv.core.scheduler.worker_namespace`): every full block another session
  published under the same keys is a hit, read-only for this one;
* the host writes what missed -- :meth:`SharedBegin.rows`, one row per branch over the prefix
  tokens after the hit (all of them for the first session, at most the last partial block for
  the next ones) -- in one forward (a clean pass: every layer), then
  :meth:`SharedStarts.commit` makes the prefix committed and publishes its full blocks, so later
  sessions hit them while this one is still live; :meth:`SharedStarts.abort` undoes the begin
  (the session is gone, nothing held);
* the session then runs chunk ``chunks`` onwards through the :class:`SessionCache` as usual.

The shared blocks are never written again: a hit is the row's cached prefix (the worker refuses
a write there) and, with a window, the shared chunks must lie in the sink (``chunks <=
sink_chunks``), which no slide releases. A session that ends drops its references; a block
stays for every other session holding it, and once nobody does it stays cached (idle, least
recently used first out) until an allocation needs the room. A re-cache of a shared session
(``SessionCache.begin_recache``) gives it blocks of its own at the shared places and drops its
references (and its prefix keys) at the commit.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from diffusion_kv.core.allocator import KVRequest, SequenceRequest
from diffusion_kv.core.errors import StateError, ValidationError
from diffusion_kv.core.prefix_cache import ContentSpan, block_keys
from diffusion_kv.core.registry import missing_spans
from diffusion_kv.core.rows import PagedRow
from diffusion_kv.core.scheduler import worker_namespace
from diffusion_kv.core.sessions.cache import Chunk, ChunkState, Session, SessionCache


@dataclass
class SharedBegin:
    """A session begun from a shared prefix: what hit, what the host still writes."""

    session: Session
    tokens: int
    """The prefix: the first ``chunks`` chunks."""
    chunks: int
    hit: tuple[int, ...]
    """Per branch, the leading tokens found in the prefix cache (whole blocks)."""
    keys: tuple[tuple[bytes, ...], ...] = field(repr=False)
    chunk: Chunk = field(repr=False)
    """The session's open chunk while the prefix is written (every other chunk call refuses:
    commit or abort it through :class:`SharedStarts`)."""
    open: bool = True

    def rows(self) -> tuple[PagedRow, ...]:
        """One row per branch over the prefix tokens that missed (none when everything hit)."""
        sid = self.session.session_id
        return tuple(
            PagedRow(sid, self.tokens - h, self.tokens, h, sequence_id=b)
            for b, h in enumerate(self.hit)
            if h < self.tokens
        )

    @property
    def full_hit(self) -> bool:
        return all(h == self.tokens for h in self.hit)


class SharedStarts:
    """Begin sessions of ``cache`` from shared first chunks (module docstring). ``model_id``
    names the weights (and anything else the K/V depend on besides the content and the mask)."""

    def __init__(self, cache: SessionCache, model_id: str) -> None:
        if not isinstance(cache, SessionCache):
            raise ValidationError(f"SharedStarts takes a SessionCache; got {type(cache).__name__}")
        if cache.allocator.prefix_cache is None:
            raise ValidationError(
                "prefix sharing needs an allocator with a prefix cache (DiffusionKVAllocator(prefix_cache=...))"
            )
        if type(model_id) is not str or not model_id:
            raise ValidationError(f"prefix sharing needs model_id, a non-empty string; got {model_id!r}")
        self.cache = cache
        self.model_id = model_id

    def keys(self, content_key: str | bytes, chunks: int, branches: int) -> tuple[tuple[bytes, ...], ...]:
        """Per branch, the chained keys of the prefix's full blocks."""
        cache = self.cache
        tokens = self._tokens(chunks)
        block = cache.allocator.block_size
        content = (ContentSpan(0, tokens, content_key),)
        model = f"{self.model_id}|{cache.mask.describe()}|prefix {tokens}"
        cut = tokens - tokens % block
        return tuple(
            block_keys(content, worker_namespace(cache.worker, model, b), cut, block) for b in range(branches)
        )

    def _tokens(self, chunks: object) -> int:
        p = self.cache.policy
        if type(chunks) is not int or chunks <= 0:
            raise ValidationError(f"shared chunks must be a positive int; got {chunks!r}")
        if p.window_chunks is not None and chunks > p.sink_chunks:
            raise ValidationError(
                f"{chunks} shared chunks exceed the sink ({p.sink_chunks} chunks): a window would release shared "
                "blocks; share at most the sink"
            )
        return chunks * p.chunk_tokens

    def begin(
        self, session_id: str, content_key: str | bytes, chunks: int, branches: int = 1
    ) -> SharedBegin | None:
        """Begin ``session_id`` with its first ``chunks`` chunks reserved and whatever is cached
        hit; None when the pool or the worker rows are short (no session, nothing taken)."""
        cache = self.cache
        tokens = self._tokens(chunks)
        keys = self.keys(content_key, chunks, branches)  # ValidationError on a bad key
        session = cache.begin_session(session_id, branches)
        request = KVRequest(
            session_id, tuple(SequenceRequest(b, tokens, 0, prefix_keys=keys[b]) for b in range(branches))
        )
        try:
            snapshot = cache.allocator.reserve(request)
        except BaseException:
            cache.end_session(session)
            raise
        if snapshot is None:
            cache.end_session(session)
            return None
        try:
            cache.worker.install(snapshot)
        except BaseException:
            cache.allocator.free(session_id)
            cache.end_session(session)
            raise
        session.reserved = True
        hit = tuple(s.cached_prefix_len for s in snapshot.sequences)
        chunk = Chunk(session_id, 0, 0, tokens, branches)
        session.open_chunk = chunk
        return SharedBegin(session, tokens, chunks, hit, keys, chunk)

    def commit(self, begun: SharedBegin) -> None:
        """The prefix is committed (every branch's missed tokens must have been written by every
        layer: a :class:`StateError` otherwise, nothing changes) and its full blocks published."""
        session = self._open(begun)
        cache = self.cache
        sid = session.session_id
        for b in range(session.branches):
            gap = missing_spans(cache.worker.resolve(sid, b).written, 0, begun.tokens)
            if gap:
                raise StateError(
                    f"session {sid!r} branch {b}: shared prefix tokens {list(gap)} were never written; run a "
                    "forward over begun.rows() before committing"
                )
        if not begun.full_hit:
            cache.allocator.publish(sid, cache.worker.seal)
        begun.open = False
        begun.chunk.state = ChunkState.COMMITTED
        session.open_chunk = None
        session.committed_tokens = begun.tokens
        session.chunks_committed = begun.chunks
        session.history.append(len(cache.allocator.blocks_of(sid)))
        session.last_used = cache._tick()

    def abort(self, begun: SharedBegin) -> None:
        """Undo :meth:`begin`: the session ends and every reference and block goes back."""
        session = self._open(begun)
        begun.open = False
        self.cache.end_session(session)

    def _open(self, begun: SharedBegin) -> Session:
        if not isinstance(begun, SharedBegin):
            raise ValidationError(f"expected a SharedBegin; got {type(begun).__name__}")
        sid = begun.session.session_id
        if not begun.open or sid not in self.cache.sessions or self.cache.session(sid) is not begun.session:
            raise StateError(f"the shared begin of session {sid!r} is over")
        return begun.session


__all__ = ["SharedBegin", "SharedStarts"]
