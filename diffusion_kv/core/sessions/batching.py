"""Many sessions in one step, beside one-shot requests.

A worker's layers attend with one mask per KV-cache group, and every paged layer runs over every
row of the active batch, so a session's chunk-causal layers and a one-shot request's causal /
full layers are different layers: the session model and the one-shot model each have their own
:class:`~diffusion_kv.core.runner.PagedWorker` (and pool). One :class:`SessionScheduler` step
serves both kinds:

* **sessions**: every open chunk of every session of one :class:`SessionCache` -- sessions at
  different window fills, chunks at different denoise steps -- are the rows of one batch on the
  session worker (:meth:`BatchStepper.ensure_rows`). The translation plans every row's visible
  pages (sink, window, the chunk) once, when the batch is prepared (``PagedBatch.block_plan``);
  the batch is prepared again only when its composition changes (a chunk opens, commits or
  aborts), so consecutive denoise steps reuse it and the per-layer path does no host work;
* **one-shot requests**: the :class:`~diffusion_kv.core.scheduler.DiffusionScheduler` on the
  other worker admits, steps and retires its requests as it always does, in the same step;
* the host's model callback ``fn(step)`` gets both batches (:class:`MixedStep`) and runs each
  model's layers over its own batch. An exception in it fails the step's work of both kinds:
  each session's chunk is aborted (the session exactly as before the chunk), each request fails
  as :class:`DiffusionScheduler` decides. ``KeyboardInterrupt`` and other non-``Exception``
  errors close the scheduler (chunks aborted, requests cancelled) and propagate.

A chunk is queued with :meth:`SessionScheduler.submit_chunk` (``steps`` denoise steps; a clean
context pass at t = 0 is one more step: the last step's K/V are what commits). Queued chunks
open in submission order as blocks allow (back-pressure: one that does not fit waits and later
ones do not overtake it; an offloaded session is reloaded first); after its last step a chunk is
committed (retention slides the window and frees blocks at once).

**Graph capture** (not built here): a captured session step replays one graph per *window-fill
shape*, the bucket :attr:`SessionBatch.bucket` -- per row, its query tokens, how many earlier
chunks it sees (``min(index, sink_chunks + window_chunks)``, capped once the window filled) and where the
chunk starts inside a block (``start % block_size``, which moves when chunks straddle blocks).
Once every window has filled, a steady stream repeats a few buckets only; without a window the
visible chunks grow every chunk and no bucket repeats.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from diffusion_kv.core.errors import StateError, ValidationError
from diffusion_kv.core.rows import PagedRow
from diffusion_kv.core.runtime import BatchStepper
from diffusion_kv.core.scheduler import DiffusionScheduler, StepBatch, StepReport
from diffusion_kv.core.sessions.cache import Chunk, Session, SessionCache
from diffusion_kv.core.sessions.offload import reload
from diffusion_kv.core.translate import PreparedBatch


@dataclass(frozen=True)
class ChunkEntry:
    """One open chunk's part of a step: its rows (one per branch) are consecutive from
    ``row_offset``; its packed query tokens are ``[token_offset, token_offset + num_tokens)``."""

    session_id: str
    chunk: Chunk
    step: int
    """This step's denoise index for the chunk (0-based)."""
    steps: int
    rows: tuple[PagedRow, ...]
    row_offset: int
    token_offset: int
    fill: int
    """Earlier chunks the chunk sees (sink and window: its window fill)."""

    @property
    def num_tokens(self) -> int:
        return sum(r.query_len for r in self.rows)

    @property
    def last(self) -> bool:
        """The chunk commits after this step."""
        return self.step == self.steps - 1


@dataclass(frozen=True)
class SessionBatch:
    """The session rows of one step, prepared on the session worker."""

    entries: tuple[ChunkEntry, ...]
    rows: tuple[PagedRow, ...]
    prepared: PreparedBatch
    block_size: int

    @property
    def num_tokens(self) -> int:
        return sum(e.num_tokens for e in self.entries)

    @property
    def bucket(self) -> tuple[tuple[int, int, int], ...]:
        """The window-fill shape a captured step would replay (module docstring)."""
        return tuple(
            (row.query_len, e.fill, e.chunk.start % self.block_size) for e in self.entries for row in e.rows
        )


@dataclass(frozen=True)
class MixedStep:
    """What the model runs at one step: the session batch and the one-shot batch (either may be
    None when that kind has nothing to run)."""

    tick: int
    sessions: SessionBatch | None
    requests: StepBatch | None


@dataclass(frozen=True)
class MixedReport:
    tick: int
    opened: tuple[str, ...]
    """Sessions whose queued chunk opened (blocks reserved) at this step."""
    committed: tuple[tuple[str, int], ...]
    """``(session, chunk index)`` committed after this step."""
    aborted: tuple[tuple[str, int, str], ...]
    """``(session, chunk index, why)``: the step failed; the session is as before the chunk."""
    waiting: tuple[str, ...]
    """Sessions whose queued chunk waits for blocks."""
    session_rows: int
    session_tokens: int
    prepared: bool
    """The session batch was prepared at this step (its composition changed)."""
    requests: StepReport | None


@dataclass
class _Work:
    session: Session
    steps: int
    chunk: Chunk | None = None
    step: int = 0


MixedFn = Callable[[MixedStep], None]


class SessionScheduler:
    """Steps every open chunk of ``cache``'s sessions, and ``requests``' one-shot requests (on
    another worker), in one step (module docstring). ``max_session_tokens`` caps the session
    query tokens of one step (default: the session worker's ``max_num_batched_tokens``)."""

    def __init__(
        self,
        cache: SessionCache,
        requests: DiffusionScheduler | None = None,
        *,
        max_session_tokens: int | None = None,
    ) -> None:
        if not isinstance(cache, SessionCache):
            raise ValidationError(f"SessionScheduler takes a SessionCache; got {type(cache).__name__}")
        if requests is not None and not isinstance(requests, DiffusionScheduler):
            raise ValidationError(
                f"SessionScheduler takes a DiffusionScheduler or None; got {type(requests).__name__}"
            )
        if requests is not None and requests.runner is cache.worker:
            raise ValidationError(
                "one-shot requests and sessions need different workers: a worker's paged layers run over every "
                "row of its batch with one mask per KV-cache group"
            )
        budget = cache.worker.config.max_num_batched_tokens
        if max_session_tokens is not None:
            if type(max_session_tokens) is not int or max_session_tokens <= 0:
                raise ValidationError(
                    f"max_session_tokens must be a positive int; got {max_session_tokens!r}"
                )
            budget = min(budget, max_session_tokens)
        self.cache = cache
        self.requests = requests
        self.max_session_tokens = budget
        self._stepper = cache.worker.stepper()
        self._runtime: BatchStepper = self._stepper.__enter__()
        self._queue: deque[str] = deque()
        self._work: dict[str, _Work] = {}  # session id -> its queued or open chunk
        self._open: list[str] = []  # sessions with an open chunk, in the order they opened
        self._tick = 0
        self._closed = False
        self.preparations = 0

    # -- views --------------------------------------------------------------------------------

    @property
    def tick(self) -> int:
        return self._tick

    @property
    def waiting(self) -> tuple[str, ...]:
        return tuple(self._queue)

    @property
    def running(self) -> tuple[str, ...]:
        return tuple(self._open)

    @property
    def idle(self) -> bool:
        return not self._work and (self.requests is None or self.requests.idle)

    # -- work ---------------------------------------------------------------------------------

    def submit_chunk(self, session: Session, steps: int) -> None:
        """Queue ``session``'s next chunk for ``steps`` denoise steps. A session has one chunk
        in flight at a time (ValidationError otherwise)."""
        self._check_open()
        self.cache._own(session, offloaded_ok=True)
        if type(steps) is not int or steps <= 0:
            raise ValidationError(f"steps must be a positive int; got {steps!r}")
        sid = session.session_id
        if sid in self._work:
            raise ValidationError(f"session {sid!r} has a chunk queued or open in this scheduler already")
        if session.open_chunk is not None:
            raise StateError(
                f"session {sid!r} has chunk {session.open_chunk.index} open outside this scheduler: commit or abort it"
            )
        self._work[sid] = _Work(session, steps)
        self._queue.append(sid)

    def cancel(self, session: Session) -> bool:
        """Drop ``session``'s queued chunk or abort its open one (the session as before the
        chunk); False when it has none here."""
        sid = session.session_id
        work = self._work.pop(sid, None)
        if work is None:
            return False
        if work.chunk is None:
            self._queue.remove(sid)
        else:
            self._runtime.deactivate()
            self._open.remove(sid)
            self.cache.abort(work.chunk)
        return True

    # -- stepping -----------------------------------------------------------------------------

    def step(self, fn: MixedFn) -> MixedReport | None:
        """Open what fits, run one step of both kinds through ``fn``, commit finished chunks;
        None when neither kind had anything to do."""
        self._check_open()
        if not callable(fn):
            raise ValidationError(f"step takes the model callback fn(step); got {type(fn).__name__}")
        tick = self._tick
        opened = self._admit()
        try:
            sessions, prepared_now = self._compose()
        except Exception:
            self._abort_open()  # every open chunk: each session as before it; the error propagates
            raise
        except BaseException:
            self.close()
            raise
        error: list[BaseException] = []
        called = False

        def run(batch: StepBatch | None) -> None:
            nonlocal called
            called = True
            try:
                fn(MixedStep(tick, sessions, batch))
            except BaseException as exc:
                error.append(exc)
                raise

        request_report: StepReport | None = None
        try:
            if self.requests is not None and (self.requests.waiting or self.requests.running):
                request_report = self.requests.step(run)
            if not called and sessions is not None:
                run(None)
        except Exception:
            if not error:  # the one-shot scheduler itself failed, not the model
                raise
        except BaseException:
            self.close()
            raise
        if not called and sessions is None and request_report is None and not opened:
            return None
        committed: list[tuple[str, int]] = []
        aborted: list[tuple[str, int, str]] = []
        entries = sessions.entries if sessions is not None else ()
        if error and entries:
            why = f"{type(error[0]).__name__}: {error[0]}"
            self._runtime.deactivate()
            for e in entries:
                self._finish(e.session_id)
                self.cache.abort(e.chunk)
                aborted.append((e.session_id, e.chunk.index, why))
        elif entries:
            done = []
            for e in entries:
                self._work[e.session_id].step += 1
                if e.last:
                    done.append(e)
            if done:
                self._runtime.deactivate()  # records the step's writes before committing
                for e in done:
                    self._finish(e.session_id)
                    self.cache.commit(e.chunk)
                    committed.append((e.session_id, e.chunk.index))
        self._tick += 1
        return MixedReport(
            tick=tick,
            opened=opened,
            committed=tuple(committed),
            aborted=tuple(aborted),
            waiting=tuple(self._queue),
            session_rows=len(sessions.rows) if sessions is not None else 0,
            session_tokens=sessions.num_tokens if sessions is not None else 0,
            prepared=prepared_now,
            requests=request_report,
        )

    def run(self, fn: MixedFn, on_step: Callable[[MixedReport], None] | None = None) -> int:
        """Step until nothing is queued or open of either kind; returns the steps run."""
        steps = 0
        while not self.idle:
            report = self.step(fn)
            if report is None or (not report.session_rows and report.requests is None and self._queue):
                raise StateError(
                    f"sessions {list(self._queue)} wait for blocks, but nothing runs that could free any"
                )
            steps += 1
            if on_step is not None:
                on_step(report)
        return steps

    def close(self) -> None:
        """Abort every open chunk, drop the queue, close the one-shot scheduler (idempotent)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._runtime.deactivate()
            for sid in list(self._open):
                work = self._work[sid]
                assert work.chunk is not None
                self.cache.abort(work.chunk)
            self._open.clear()
            self._queue.clear()
            self._work.clear()
            if self.requests is not None:
                self.requests.close()
        finally:
            self._stepper.__exit__(None, None, None)

    def __enter__(self) -> SessionScheduler:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- internals ----------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise StateError("the session scheduler is closed")

    def _abort_open(self) -> None:
        """Abort every open chunk (a batch that could not be prepared): each session as before
        its chunk, the queue kept."""
        self._runtime.deactivate()
        for sid in list(self._open):
            work = self._work[sid]
            assert work.chunk is not None
            self._finish(sid)
            self.cache.abort(work.chunk)

    def _finish(self, sid: str) -> None:
        del self._work[sid]
        self._open.remove(sid)

    def _tokens(self) -> int:
        return sum(self.cache.policy.chunk_tokens * self._work[s].session.branches for s in self._open)

    def _admit(self) -> tuple[str, ...]:
        opened: list[str] = []
        tokens = self._tokens()
        while self._queue:
            sid = self._queue[0]
            work = self._work[sid]
            session = work.session
            need = self.cache.policy.chunk_tokens * session.branches
            if tokens + need > self.max_session_tokens:
                break
            self._runtime.deactivate()  # installing changes the block tables
            if session.offloaded is not None and not reload(self.cache, session):
                break
            chunk = self.cache.append_chunk(session)
            if chunk is None:
                break  # back-pressure: nothing taken, later chunks wait behind it
            self._queue.popleft()
            work.chunk = chunk
            self._open.append(sid)
            opened.append(sid)
            tokens += need
        return tuple(opened)

    def _compose(self) -> tuple[SessionBatch | None, bool]:
        if not self._open:
            return None, False
        entries: list[ChunkEntry] = []
        rows: list[PagedRow] = []
        window = self.cache.policy.window_chunks
        token_offset = 0
        for sid in self._open:
            work = self._work[sid]
            chunk = work.chunk
            assert chunk is not None
            chunk_rows = chunk.rows()
            fill = chunk.index if window is None else min(chunk.index, window + self.cache.policy.sink_chunks)
            entry = ChunkEntry(sid, chunk, work.step, work.steps, chunk_rows, len(rows), token_offset, fill)
            entries.append(entry)
            rows.extend(chunk_rows)
            token_offset += entry.num_tokens
        before = self._runtime.preparations
        prepared = self._runtime.ensure_rows(rows)
        now = self._runtime.preparations != before
        self.preparations += int(now)
        return SessionBatch(tuple(entries), tuple(rows), prepared, self.cache.allocator.block_size), now


__all__ = ["ChunkEntry", "MixedFn", "MixedReport", "MixedStep", "SessionBatch", "SessionScheduler"]
