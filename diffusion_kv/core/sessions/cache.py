"""Sessions: committed KV across chunks, a chunk at a time.

The host's autoregressive diffusion loop (CausVid, Self-Forcing, DreamZero, LingBot-World)
generates a stream chunk by chunk; every chunk is denoised in a few steps, each step writing the
chunk's K/V and attending block-causally over the sink, a window of earlier chunks and the chunk
itself. A :class:`SessionCache` runs that loop's KV on one worker (:class:`PagedWorker`) and its
scheduler-side allocator, with the policy as data (:class:`SessionPolicy`):

* ``begin_session(session_id, branches)`` -- nothing is reserved yet (``branches``: one row per
  CFG branch, each with the same positions);
* ``append_chunk(session)`` -- the chunk's blocks are reserved (all-or-nothing over the
  branches: an EXTEND snapshot, or the first reservation); the host runs its denoise steps over
  ``chunk.rows()`` (each step writes the chunk's K/V at the same positions and attends under the
  layers' chunk-causal mask);
* ``commit(chunk)`` -- the K/V the chunk's last write left (the last denoise step, or a clean
  pass the host ran at t = 0) become committed; retention then releases the blocks that slid out
  of the window (a SLIDE snapshot; the sink is never released) and returns them to the pool;
* ``abort(chunk)`` -- after a failure or a cancel: the chunk's tokens and the blocks only they
  used are dropped (a TRUNCATE snapshot), so the session is exactly as before ``append_chunk``;
* ``end_session(session)`` -- the worker's rows retired for good and every block freed.

Positions stay on the host's absolute timeline: chunk ``i`` covers ``[i * chunk, (i + 1) *
chunk)`` whatever was released. Committed KV changes only at ``commit``; the pool is whole again
after every session ends, fails or aborts. Also: cross-attention contexts per session
(:mod:`.contexts`, ``set_context`` / ``context_kv``), re-cache under new conditioning
(``begin_recache`` / ``commit_recache`` / ``abort_recache``: a shadow row swapped in by a REPLACE),
``SessionPolicy.reset_at_boundary`` and ``reset(session)``; ``docs/sessions.md`` is the host's guide.
At scale (``docs/sessions.md``, "Many sessions"): many sessions in one step beside one-shot
requests (:mod:`.batching`), admission (:mod:`.admission`; a session that could never fit is
refused at ``begin_session``), offload to host memory (:mod:`.offload`; ``on_pool_short`` hook),
prefix sharing of first chunks (:mod:`.sharing`).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from diffusion_kv.core.allocation import NULL_BLOCK, RequestAllocation
from diffusion_kv.core.allocator import AdmissionError, DiffusionKVAllocator, KVRequest, SequenceRequest
from diffusion_kv.core.attention import AttentionMode, MaskSpec
from diffusion_kv.core.errors import StateError, UnsupportedFeatureError, ValidationError
from diffusion_kv.core.layout import cdiv
from diffusion_kv.core.registry import missing_spans
from diffusion_kv.core.rows import PagedRow
from diffusion_kv.core.runner import PagedWorker
from diffusion_kv.core.sessions.contexts import ContextReader, SessionContexts


@dataclass(frozen=True)
class SessionPolicy:
    """A session's window policy as data (vLLM-Omni's AR-diffusion ``chunk_size``,
    ``window_chunks``, ``sink_chunks``)."""

    chunk_tokens: int
    window_chunks: int | None = None
    """Earlier chunks a chunk sees besides the sink (None: every earlier chunk, nothing slides)."""
    sink_chunks: int = 0
    """Leading chunks every chunk sees and no slide releases (moot without a window)."""
    reset_at_boundary: bool = False
    """vLLM-Omni's ``reset_at_boundary``: at every commit the committed KV past the sink is
    dropped (its blocks back to the pool at once); the next chunk sees the sink and itself, at
    its absolute position. ``window_chunks`` must then be None or 0."""

    def __post_init__(self) -> None:
        if type(self.chunk_tokens) is not int or self.chunk_tokens <= 0:
            raise ValidationError(
                f"SessionPolicy.chunk_tokens must be a positive int; got {self.chunk_tokens!r}"
            )
        if self.window_chunks is not None and (type(self.window_chunks) is not int or self.window_chunks < 0):
            raise ValidationError(
                f"SessionPolicy.window_chunks must be an int >= 0 or None; got {self.window_chunks!r}"
            )
        if type(self.sink_chunks) is not int or self.sink_chunks < 0:
            raise ValidationError(f"SessionPolicy.sink_chunks must be an int >= 0; got {self.sink_chunks!r}")
        if type(self.reset_at_boundary) is not bool:
            raise ValidationError(
                f"SessionPolicy.reset_at_boundary must be a bool; got {self.reset_at_boundary!r}"
            )
        if self.reset_at_boundary and self.window_chunks:
            raise ValidationError(
                f"SessionPolicy.reset_at_boundary keeps only the sink past each commit; window_chunks must be None or 0, "
                f"got {self.window_chunks}"
            )

    @property
    def mask(self) -> MaskSpec:
        """The layers' mask: chunk-causal by chunks, the window counting the chunk itself."""
        if self.window_chunks is None and not self.reset_at_boundary:
            return MaskSpec(AttentionMode.CHUNK_CAUSAL, chunk=self.chunk_tokens)
        return MaskSpec(
            AttentionMode.CHUNK_CAUSAL,
            chunk=self.chunk_tokens,
            window=((self.window_chunks or 0) + 1) * self.chunk_tokens,
            sink=self.sink_chunks * self.chunk_tokens,
        )


class ChunkState(enum.Enum):
    OPEN = "open"
    """Reserved: the host's denoise steps write it."""
    COMMITTED = "committed"
    ABORTED = "aborted"


@dataclass
class Chunk:
    """One chunk of a session: ``tokens`` positions from ``start`` (absolute)."""

    session_id: str
    index: int
    start: int
    tokens: int
    branches: int
    state: ChunkState = ChunkState.OPEN
    row_offset: int = 0
    """Timeline tokens cut out of the session's rows before this chunk (compaction: released
    places dropped between the sink and the window): its rows sit at ``start - row_offset``.
    The host keeps ``start`` for its positions (RoPE); only the core reads row positions."""
    _rows: tuple[PagedRow, ...] | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def end(self) -> int:
        return self.start + self.tokens

    def rows(self) -> tuple[PagedRow, ...]:
        """One row per branch: the chunk's queries over every key up to its end (the mask keeps
        the sink, the window and the chunk itself). Built once per chunk: every denoise step
        hands the same rows, so the runtime's ``ensure_rows`` finds them active and prepares
        nothing."""
        if self._rows is None:
            start = self.start - self.row_offset
            self._rows = tuple(
                PagedRow(self.session_id, self.tokens, start + self.tokens, start, sequence_id=b)
                for b in range(self.branches)
            )
        return self._rows


@dataclass
class Session:
    session_id: str
    branches: int
    committed_tokens: int = 0
    chunks_committed: int = 0
    open_chunk: Chunk | None = None
    reserved: bool = False
    """Blocks are reserved (the first chunk was appended and not aborted away)."""
    ended: bool = False
    history: list[int] = field(default_factory=list)
    """Blocks held after each commit (KV memory over the session, for reports)."""
    recache: RecachePass | None = None
    """The re-cache pass in progress (:meth:`SessionCache.begin_recache`)."""

    last_used: int = 0
    """The cache's clock at this session's last append or commit (least recently used first
    when the pool runs short: :mod:`.offload`)."""
    offloaded: object | None = None
    """The host copy of its committed K/V while offloaded (an
    :class:`~diffusion_kv.core.sessions.offload.OffloadedKV`; its blocks are back in the pool)."""
    row_offset: int = 0
    """Timeline tokens cut out of its rows so far (:meth:`SessionCache.commit` compacts): a
    committed token at timeline position ``t`` past the sink's blocks sits at row position
    ``t - row_offset``; the sink's stay where they are."""


@dataclass
class RecachePass:
    """A re-cache of a session's committed KV under new conditioning (LongLive's prompt
    switch): a shadow request ``shadow_id`` with the session's lengths and released places and
    fresh blocks, which the host's forwards over :meth:`forwards` write (the same absolute
    positions, the layers' chunk-causal mask inside the pass, over the live keys only), and the
    ``contexts`` staged to replace the session's at commit (write them over
    ``SessionCache.recache_context_rows``).

    ``live`` are the committed tokens later chunks can still see: ``[(0, tokens)]`` while the
    window has not slid past the sink, else the sink ``[0, sink)`` and the window ``[first_live,
    tokens)`` (either may be empty). Only those are recomputed, and each attends over the live
    keys its mask reaches: released places (and tokens no later chunk sees) are skipped."""

    session_id: str
    shadow_id: str
    tokens: int
    branches: int
    contexts: tuple[str, ...] = ()
    done: bool = False
    live: tuple[tuple[int, int], ...] | None = None
    """The live committed spans on the host's timeline (None: every committed token, ``[(0, tokens)]``)."""
    row_live: tuple[tuple[int, int], ...] | None = None
    """:attr:`live` at the session's row positions (:meth:`SessionCache.live_row_spans`; None:
    the same spans, the rows never compacted)."""

    def __post_init__(self) -> None:
        if self.live is None:
            self.live = ((0, self.tokens),)

    @property
    def spans(self) -> tuple[tuple[int, int], ...]:
        """The live spans the pass recomputes, ascending, on the host's timeline (the positions
        its inputs take)."""
        return self.live if self.live is not None else ((0, self.tokens),)

    @property
    def row_spans(self) -> tuple[tuple[int, int], ...]:
        """:attr:`spans` at row positions: the sink's where they are, the window's
        :attr:`Session.row_offset` lower (a compacted session's; the same spans otherwise)."""
        return self.row_live if self.row_live is not None else self.spans

    def forwards(self) -> tuple[tuple[PagedRow, ...], ...]:
        """The forwards the host runs, in order: one per live span, one row per branch. The
        window's rows declare ``live_from`` (keys between the sink and the window are skipped)
        and read the sink the first forward wrote, so the order matters."""
        return tuple(
            tuple(
                PagedRow(self.shadow_id, b - a, b, a, sequence_id=br, live_from=a)
                for br in range(self.branches)
            )
            for a, b in self.row_spans
        )

    def rows(self) -> tuple[PagedRow, ...]:
        """One row per branch writing every committed token ``[0, tokens)`` of the shadow -- the
        pass's one forward while the live tokens are one span starting at 0; a pass over two
        spans (:meth:`forwards`) is a :class:`StateError`."""
        runs = self.forwards()
        if len(runs) != 1:
            raise StateError(
                f"re-cache {self.shadow_id!r} recomputes the live spans {list(self.spans)} in {len(runs)} forwards: "
                "run pass.forwards() in order"
            )
        return runs[0]


class SessionCache:
    """Sessions on one worker and its allocator (module docstring)."""

    def __init__(
        self,
        worker: PagedWorker,
        allocator: DiffusionKVAllocator,
        policy: SessionPolicy,
        *,
        contexts: SessionContexts | None = None,
    ) -> None:
        if not isinstance(worker, PagedWorker) or worker.layout is None:
            raise ValidationError("SessionCache takes a PagedWorker whose KV cache is initialised")
        if not isinstance(allocator, DiffusionKVAllocator):
            raise ValidationError(
                f"SessionCache takes a DiffusionKVAllocator; got {type(allocator).__name__}"
            )
        if not isinstance(policy, SessionPolicy):
            raise ValidationError(f"SessionCache takes a SessionPolicy; got {type(policy).__name__}")
        mask = policy.mask
        others = [g.spec.mask.describe() for g in worker.layout.groups if g.spec.mask != mask]
        if others:
            raise ValidationError(
                f"the session policy's mask is {mask.describe()}, but the worker's layers attend with {others}: "
                "register the layers with PagedLayerSpec(mode=policy.mask)"
            )
        if allocator.block_size != worker.layout.groups[0].block_size:
            raise ValidationError(
                f"allocator block size {allocator.block_size} differs from the worker's "
                f"{worker.layout.groups[0].block_size}"
            )
        self.worker = worker
        self.allocator = allocator
        self.policy = policy
        if contexts is not None and not isinstance(contexts, SessionContexts):
            raise ValidationError(
                f"SessionCache contexts must be a SessionContexts or None; got {type(contexts).__name__}"
            )
        self.mask = mask
        self.contexts = contexts
        block = allocator.block_size
        self.compact_from = cdiv(mask.sink, block) * block
        """Row position where compaction cuts: the first place past the sink's blocks."""
        self.compact_unit = math.lcm(policy.chunk_tokens, block)
        """What a compaction cuts a multiple of: whole chunks and whole blocks."""
        self._compact_tokens: int | None = None
        if mask.releases:
            live = mask.sink + (mask.window or 0)
            self._compact_tokens = cdiv(live, self.compact_unit) * self.compact_unit
        self._sessions: dict[str, Session] = {}
        self._clock = 0
        self.on_pool_short: Callable[[Session], bool] | None = None
        """Called by :meth:`append_chunk` when the pool cannot take the chunk (with the session
        asking); returning True makes it try once more (e.g. after offloading an idle session:
        :func:`~diffusion_kv.core.sessions.offload.offload_lru`)."""

    @property
    def compact_tokens(self) -> int | None:
        """Released tokens past :attr:`compact_from` that make :meth:`commit` compact the rows (a
        multiple of :attr:`compact_unit`; by default the first at least the session's live keys,
        so a row stays under about twice its live length whatever the stream's length). None:
        rows are never compacted (the default without a window, where nothing is released; set
        it to keep a windowed session's rows at absolute positions, ``max_model_len`` then
        bounding the stream)."""
        return self._compact_tokens

    @compact_tokens.setter
    def compact_tokens(self, tokens: int | None) -> None:
        if tokens is not None and (type(tokens) is not int or tokens <= 0 or tokens % self.compact_unit):
            raise ValidationError(
                f"SessionCache.compact_tokens must be None or a positive multiple of {self.compact_unit} "
                f"(whole chunks of {self.policy.chunk_tokens} and blocks of {self.allocator.block_size}); got {tokens!r}"
            )
        if tokens is not None and not self.mask.releases:
            raise ValidationError(
                f"SessionCache.compact_tokens: the mask {self.mask.describe()} releases nothing to compact"
            )
        self._compact_tokens = tokens

    # -- sessions ------------------------------------------------------------------------------

    def begin_session(self, session_id: str, branches: int = 1) -> Session:
        if type(session_id) is not str or not session_id:
            raise ValidationError(f"a session id is a non-empty string; got {session_id!r}")
        if session_id in self._sessions:
            raise ValidationError(f"session {session_id!r} is open already")
        if session_id in self.allocator.reserved():
            raise ValidationError(f"session id {session_id!r} is a request the allocator reserves")
        if type(branches) is not int or branches <= 0:
            raise ValidationError(f"branches must be a positive int; got {branches!r}")
        self._check_fits(session_id, branches)  # AdmissionError: it could never fit
        session = Session(session_id, branches)
        self._sessions[session_id] = session
        return session

    def session(self, session_id: str) -> Session:
        found = self._sessions.get(session_id)
        if found is None:
            raise ValidationError(f"no open session {session_id!r}")
        return found

    @property
    def sessions(self) -> tuple[str, ...]:
        return tuple(self._sessions)

    def end_session(self, session: Session) -> None:
        """Retire the worker's rows for good and free every block (an open chunk is aborted
        with the rest; an offloaded session's host copy is dropped)."""
        self._own(session, offloaded_ok=True)
        session.offloaded = None
        self._drop_kv(session)
        if self.contexts is not None:
            self.contexts.release_session(session.session_id)
        session.ended = True
        del self._sessions[session.session_id]

    def reset(self, session: Session, keep_contexts: Iterable[str] = ()) -> None:
        """Start the session over (vLLM-Omni's session ``reset``): an open chunk or re-cache is
        aborted, every committed block goes back to the pool at once, the contexts not named in
        ``keep_contexts`` are released, and the next chunk starts again at position 0 (an
        offloaded session's host copy is dropped)."""
        self._own(session, offloaded_ok=True)
        keep = tuple(keep_contexts)
        if self.contexts is not None:
            unknown = sorted(set(keep) - set(self.contexts.names(session.session_id)))
            if unknown:
                raise ValidationError(f"session {session.session_id!r} has no contexts {unknown} to keep")
        elif keep:
            raise ValidationError(f"session {session.session_id!r} has no contexts to keep: {list(keep)}")
        session.offloaded = None
        self._drop_kv(session)
        if self.contexts is not None:
            self.contexts.release_session(session.session_id, keep)
        session.committed_tokens = 0
        session.chunks_committed = 0
        session.row_offset = 0

    def _drop_kv(self, session: Session) -> None:
        """Abort the open chunk and re-cache, retire the rows and free every block."""
        if session.recache is not None:
            self.abort_recache(session.recache)
        if session.reserved:
            self.worker.retire(session.session_id, self.allocator.generation)
            self.allocator.free(session.session_id)
            session.reserved = False
        if session.open_chunk is not None:
            session.open_chunk.state = ChunkState.ABORTED
            session.open_chunk = None

    # -- contexts ------------------------------------------------------------------------------

    def _contexts(self) -> SessionContexts:
        if self.contexts is None:
            raise StateError(
                "this SessionCache has no cross-attention contexts: pass contexts=SessionContexts(...)"
            )
        return self.contexts

    def set_context(self, session: Session, name: str, tokens: int) -> tuple[PagedRow, ...] | None:
        """Reserve the session's context ``name`` (``tokens`` keys, one row per branch; write-
        once) and return the rows the host's forward over the context worker writes; None when
        its pool is short (nothing taken)."""
        self._own(session)
        context = self._contexts().set(session.session_id, name, tokens, session.branches)
        return context.rows() if context is not None else None

    def context_rows(self, session: Session, name: str) -> tuple[PagedRow, ...]:
        """The rows of a written context (:class:`StateError` while any token is unwritten)."""
        self._own(session)
        return self._contexts().written(session.session_id, name).rows()

    def context_kv(
        self, session: Session, name: str, layer: str, branch: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A written context's keys and values of one cross-attention layer, gathered from its
        pages (:meth:`SessionContexts.kv`)."""
        self._own(session)
        return self._contexts().kv(session.session_id, name, layer, branch)

    def context_attend(self, session: Session, name: str, layer: str, q: torch.Tensor) -> torch.Tensor:
        """A denoise step's cross-attention of ``q`` (``[branches * Lq, heads, head_size]``,
        branch-major) over the written context's pages of one cross-attention layer, every
        branch in one call of the context worker's backend, nothing copied out per step
        (:meth:`SessionContexts.attend`)."""
        self._own(session)
        self._contexts().written(session.session_id, name)
        return self._contexts().attend(session.session_id, name, layer, q)

    def context_reader(self, contexts: Iterable[tuple[Session, str]], query_tokens: int) -> ContextReader:
        """One reader over several sessions' contexts (each branch a row of ``query_tokens``
        queries): ``reader.attend(layer, q)`` is one backend call per layer for all of them
        (:meth:`SessionContexts.reader`)."""
        pairs = []
        for session, name in contexts:
            self._own(session)
            pairs.append((session.session_id, name))
        return self._contexts().reader(pairs, query_tokens)

    def release_context(self, session: Session, name: str) -> None:
        """Release a context now (its blocks back to the pool); ``set_context`` may write it again."""
        self._own(session)
        self._contexts().get(session.session_id, name)
        self._contexts().release(session.session_id, name)

    # -- re-cache ------------------------------------------------------------------------------

    def begin_recache(
        self, session: Session, contexts: Mapping[str, int] | None = None
    ) -> RecachePass | None:
        """Open a re-cache of every committed token (LongLive's prompt switch): a shadow with fresh
        blocks, plus new contexts (``name -> tokens``) staged to replace the session's. The host
        runs one forward over ``pass.rows()`` (and writes each staged context over
        ``pass.context_rows(name)``), then :meth:`commit_recache` or :meth:`abort_recache`. None
        when a pool is short (nothing taken). A session whose first chunks are shared through the
        prefix cache (``SharedStarts``) is re-cached the same way: the shadow takes fresh blocks
        there too, and the commit drops the session's references to the shared ones (sessions
        still holding them keep reading them)."""
        self._own(session)
        sid = session.session_id
        if session.open_chunk is not None or session.recache is not None:
            raise StateError(f"session {sid!r} has a chunk or a re-cache open: commit or abort it first")
        if session.committed_tokens == 0:
            raise StateError(f"session {sid!r} has no committed KV to re-cache")
        staged = dict(contexts or {})
        if staged:
            known = self._contexts().names(sid)
            unknown = sorted(set(staged) - set(known))
            if unknown:
                raise ValidationError(
                    f"session {sid!r} re-cache: no contexts {unknown} to replace (has {list(known)})"
                )
        live = self.live_spans(session)
        if live != ((0, session.committed_tokens),):
            self._check_live_from_served()
        shadow_id = f"{sid}/recache"
        shadow = self.allocator.shadow(sid, shadow_id)
        if shadow is None:
            return None
        self._install_or_free(shadow)
        recache = RecachePass(
            sid,
            shadow_id,
            session.committed_tokens,
            session.branches,
            tuple(staged),
            live=live,
            row_live=self.live_row_spans(session),
        )
        for name, tokens in staged.items():
            if self._contexts().stage(sid, name, tokens, session.branches) is None:
                self._drop_shadow(recache)
                return None
        session.recache = recache
        return recache

    def live_spans(self, session: Session) -> tuple[tuple[int, int], ...]:
        """The committed tokens a later chunk can still see, on the host's timeline:
        ``[(0, committed)]`` until the window slides past the sink, then the sink and the window
        (an empty one left out)."""
        committed = session.committed_tokens
        keep = self.mask.retention(committed)
        if keep.first_live <= keep.pinned:
            return ((0, committed),) if committed else ()
        spans = [(0, keep.pinned)] if keep.pinned else []
        if keep.first_live < committed:
            spans.append((keep.first_live, committed))
        return tuple(spans)

    def live_row_spans(self, session: Session) -> tuple[tuple[int, int], ...]:
        """:meth:`live_spans` at the session's row positions (what ``worker.resolve(...).written``
        and the block places index): the sink's where they are, the window's
        :attr:`Session.row_offset` lower once the rows were compacted."""
        off = session.row_offset
        return tuple(
            (a, b) if a < self.compact_from or not off else (a - off, b - off)
            for a, b in self.live_spans(session)
        )

    def _check_live_from_served(self) -> None:
        lacking = [b.name for b in self.worker.backends if not b.capabilities.supports_live_from]
        if lacking:
            raise UnsupportedFeatureError(
                f"a re-cache after the window slid reads the live keys only (PagedRow.live_from); backends {lacking} "
                f"of platform {self.worker.platform.name!r} do not serve that (supports_live_from)"
            )

    def recache_context_rows(self, recache: RecachePass, name: str) -> tuple[PagedRow, ...]:
        """The rows that write the staged context ``name`` of an open re-cache."""
        self._open_recache(recache)
        return self._contexts().get(recache.session_id, name, staged=True).rows()

    def commit_recache(self, recache: RecachePass) -> RequestAllocation:
        """Swap the re-cached KV in (the shadow's blocks replace the session's at every live
        place, a REPLACE; the old blocks back to the pool) and the staged contexts; refused
        (:class:`StateError`, nothing changes) while any token of the shadow or of a staged
        context is unwritten."""
        session = self._open_recache(recache)
        for b in range(recache.branches):
            written = self.worker.resolve(recache.shadow_id, b).written
            gap = tuple(g for a0, b0 in recache.row_spans for g in missing_spans(written, a0, b0))
            if gap:
                raise StateError(
                    f"re-cache of session {recache.session_id!r} branch {b}: tokens {list(gap)} were never written; "
                    "run the forwards over pass.forwards() (pass.rows()) before committing"
                )
        for name in recache.contexts:
            gaps = self._contexts().unwritten(self._contexts().get(recache.session_id, name, staged=True))
            if gaps:
                raise StateError(
                    f"re-cache of session {recache.session_id!r}: staged context {name!r} (branch, tokens) {gaps} "
                    "were never written"
                )
        narrowed = None if recache.spans == ((0, recache.tokens),) else recache.row_spans
        snapshot = self.allocator.adopt(
            recache.session_id,
            recache.shadow_id,
            install=lambda s: self.worker.adopt(s, recache.shadow_id, narrowed),
        )
        if recache.contexts:
            self._contexts().swap(recache.session_id, recache.contexts)
        recache.done = True
        session.recache = None
        return snapshot

    def abort_recache(self, recache: RecachePass) -> None:
        """Drop the shadow and the staged contexts: the session's KV and contexts as before."""
        session = self._open_recache(recache)
        self._drop_shadow(recache)
        recache.done = True
        session.recache = None

    def _drop_shadow(self, recache: RecachePass) -> None:
        self.worker.retire(recache.shadow_id, self.allocator.generation)
        self.allocator.free(recache.shadow_id)
        if self.contexts is not None:
            self.contexts.drop_staged(recache.session_id)

    def _open_recache(self, recache: RecachePass) -> Session:
        if not isinstance(recache, RecachePass):
            raise ValidationError(f"expected a RecachePass; got {type(recache).__name__}")
        session = self._sessions.get(recache.session_id)
        if session is None or session.recache is not recache:
            raise StateError(f"re-cache {recache.shadow_id!r} of session {recache.session_id!r} is not open")
        return session

    # -- chunks --------------------------------------------------------------------------------

    def append_chunk(self, session: Session) -> Chunk | None:
        """Reserve the next chunk's blocks (every branch, all or nothing) and install them on
        the worker; None when the pool is short (nothing taken)."""
        self._own(session)
        if session.open_chunk is not None:
            raise StateError(
                f"session {session.session_id!r} has chunk {session.open_chunk.index} open: commit or abort it first"
            )
        if session.recache is not None:
            raise StateError(f"session {session.session_id!r} has a re-cache open: commit or abort it first")
        tokens = self.policy.chunk_tokens
        start = session.committed_tokens
        sid = session.session_id
        if not session.reserved:
            request = KVRequest(sid, tuple(SequenceRequest(b, 0, tokens) for b in range(session.branches)))
            snapshot = self.allocator.reserve(request)  # AdmissionError: it can never fit
            if snapshot is None and self._pool_short(session):
                snapshot = self.allocator.reserve(request)
            if snapshot is None:
                return None
            self._install_or_free(snapshot)
            session.reserved = True
        elif self.allocator.extend(sid, None, tokens, install=self.worker.install) is None and (
            not self._pool_short(session)
            or self.allocator.extend(sid, None, tokens, install=self.worker.install) is None
        ):
            return None
        chunk = Chunk(
            sid, session.chunks_committed, start, tokens, session.branches, row_offset=session.row_offset
        )
        session.open_chunk = chunk
        session.last_used = self._tick()
        return chunk

    def commit(self, chunk: Chunk) -> RequestAllocation | None:
        """The chunk's last write becomes committed; retention then releases what slid out of
        the window (returned to the pool at once). A chunk whose tokens were not written by
        every paged layer is a :class:`StateError` (nothing changes)."""
        session = self._open(chunk)
        for row in chunk.rows():
            binding = self.worker.resolve(row.request_id, row.sequence_id)
            gap = missing_spans(binding.written, row.kv_start_pos, row.seq_len)
            if gap:
                raise StateError(
                    f"session {chunk.session_id!r} chunk {chunk.index} branch {row.sequence_id}: tokens "
                    f"{[(a + chunk.row_offset, b + chunk.row_offset) for a, b in gap]} "
                    "were never written; run a forward over chunk.rows() before committing"
                )
        chunk.state = ChunkState.COMMITTED
        session.open_chunk = None
        session.committed_tokens = chunk.end
        session.chunks_committed += 1
        snapshot = self._slide(session)
        snapshot = self._compact(session) or snapshot
        session.history.append(len(self.allocator.blocks_of(session.session_id)))
        session.last_used = self._tick()
        return snapshot

    def abort(self, chunk: Chunk) -> None:
        """Drop the chunk: its tokens and the blocks only they used (the session exactly as
        before :meth:`append_chunk`; a first chunk takes the reservation with it)."""
        session = self._open(chunk)
        sid = session.session_id
        if session.committed_tokens == 0:
            self.worker.retire(sid, self.allocator.generation)
            self.allocator.free(sid)
            session.reserved = False
        else:
            self.allocator.truncate(sid, None, chunk.tokens, install=self.worker.install)
        chunk.state = ChunkState.ABORTED
        session.open_chunk = None

    def run_chunk(self, session: Session, steps: Callable[[Chunk], None]) -> Chunk | None:
        """``append_chunk``, the host's ``steps(chunk)`` (its denoise loop), then ``commit``; any
        exception from ``steps`` aborts the chunk and propagates. None when the pool is short."""
        chunk = self.append_chunk(session)
        if chunk is None:
            return None
        try:
            steps(chunk)
        except BaseException:
            self.abort(chunk)
            raise
        self.commit(chunk)
        return chunk

    # -- internals -----------------------------------------------------------------------------

    def _own(self, session: Session, *, offloaded_ok: bool = False) -> None:
        if not isinstance(session, Session) or self._sessions.get(session.session_id) is not session:
            raise ValidationError(f"not an open session of this cache: {session!r}")
        if session.offloaded is not None and not offloaded_ok:
            raise StateError(
                f"session {session.session_id!r} is offloaded to host memory: reload(session) it first "
                "(or end_session it)"
            )

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _pool_short(self, session: Session) -> bool:
        return self.on_pool_short is not None and bool(self.on_pool_short(session))

    def _open(self, chunk: Chunk) -> Session:
        if not isinstance(chunk, Chunk):
            raise ValidationError(f"expected a Chunk; got {type(chunk).__name__}")
        session = self._sessions.get(chunk.session_id)
        if session is not None and session.offloaded is not None:
            self._own(session)  # StateError naming it
        if session is None or session.open_chunk is not chunk:
            raise StateError(
                f"chunk {chunk.index} of session {chunk.session_id!r} is not open (state {chunk.state.value})"
            )
        return session

    def _install_or_free(self, snapshot: RequestAllocation) -> None:
        try:
            self.worker.install(snapshot)
        except BaseException:
            self.allocator.free(snapshot.request_id)
            raise

    def _slide(self, session: Session) -> RequestAllocation | None:
        block = self.allocator.block_size
        # row positions: the mask is the same shifted by whole chunks (the offset is)
        keep = self.mask.retention(session.committed_tokens - session.row_offset)
        releasable = keep.releasable_blocks(block)  # a range: every place the window passed
        if not releasable:
            return None
        snapshot = self.worker.registry.snapshot_of(session.session_id) if self.worker.registry else None
        if snapshot is None:
            raise StateError(f"session {session.session_id!r} is not installed on the worker")
        row = snapshot.sequences[0].block_ids[0]
        start, stop = releasable.start, min(releasable.stop, len(row))
        if stop <= start:
            return None
        # the places still holding a block, found in C (a long session's row is mostly released)
        held = np.fromiter(row[start:stop], dtype=np.intp, count=stop - start) != NULL_BLOCK
        fresh = (np.flatnonzero(held) + start).tolist()
        if not fresh:
            return None
        return self.allocator.release(session.session_id, None, fresh, install=self.worker.install)

    def _compact(self, session: Session) -> RequestAllocation | None:
        """Cut the released places right past the sink's blocks out of the session's rows once
        they reach :attr:`compact_tokens` (a COMPACT: the rows keep their blocks, later positions
        move down by whole chunks, ``row_offset`` grows by as much). The mask sees the same keys:
        every later query's window starts past the cut (``docs/sessions.md``, "Row compaction")."""
        every = self.compact_tokens
        if every is None:
            return None
        snapshot = self.worker.registry.snapshot_of(session.session_id) if self.worker.registry else None
        if snapshot is None:
            return None
        block = self.allocator.block_size
        # past the sink's blocks and any row's prefix (a shared start lies in the sink: the same)
        prefix = max(max(s.prefix_len, s.cached_prefix_len) for s in snapshot.sequences)
        at = max(self.compact_from, cdiv(prefix, block) * block)
        row = snapshot.sequences[0].block_ids[0]
        first = at // block
        if len(row) - first < every // block:
            return None
        places = np.fromiter(row[first:], dtype=np.intp, count=len(row) - first) != NULL_BLOCK
        held = np.flatnonzero(places)
        released = int(held[0]) if held.size else len(row) - first  # the run of released places
        tokens = released * block // every * every
        if tokens == 0:
            return None
        compacted = self.allocator.compact(
            session.session_id, at, tokens, install=lambda s: self.worker.compact(s, at, tokens)
        )
        session.row_offset += tokens
        return compacted

    def kv_blocks_bound(self) -> int:
        """Blocks one branch of a session holds at most while a chunk is open: the sink, the
        window and the chunk, each rounded out to whole blocks, plus one block a chunk boundary
        inside a block may straddle."""
        p, block = self.policy, self.allocator.block_size
        if p.window_chunks is None and not p.reset_at_boundary:
            raise ValidationError("a session without a window keeps every chunk: its KV is unbounded")
        return (
            cdiv(p.sink_chunks * p.chunk_tokens, block)
            + cdiv(((p.window_chunks or 0) + 1) * p.chunk_tokens, block)
            + 1
        )

    def _check_fits(self, session_id: str, branches: int) -> None:
        """:class:`AdmissionError` naming the numbers when a session of ``branches`` rows could
        never run here: more rows than a request or the worker has; with a window, a bound
        (:meth:`kv_blocks_bound` per branch) larger than the pool; without one, a first chunk
        larger than the pool (``diffusion_kv.core.sessions.admission``)."""
        alloc = self.allocator
        limit = min(alloc.max_rows_per_request, alloc.worker_rows)
        if branches > limit:
            raise AdmissionError(
                f"session {session_id!r} needs {branches} rows (one per branch); the limit is {limit} "
                f"(max_rows_per_request {alloc.max_rows_per_request}, worker rows {alloc.worker_rows})"
            )
        total = alloc.pool.num_total
        if self.policy.window_chunks is None:
            first = cdiv(self.policy.chunk_tokens, alloc.block_size) * branches
            if first > total:
                raise AdmissionError(
                    f"session {session_id!r} needs {first} blocks for its first chunk ({branches} branches); "
                    f"the pool has {total} in total"
                )
            return
        bound = self.kv_blocks_bound()
        if bound * branches > total:
            raise AdmissionError(
                f"session {session_id!r} may hold {bound * branches} blocks ({bound} per branch x {branches}: "
                f"sink + window + chunk); the pool has {total} in total"
            )
