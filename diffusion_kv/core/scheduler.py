"""Continuous batching of diffusion requests for standalone use.

:class:`DiffusionScheduler` sits on top of the scheduler-side allocator and the worker
(:class:`~diffusion_kv.core.runner.PagedWorker`) and steps many requests together, each at
its own step:

* **admission** in submission order, as blocks free up: a request is reserved all or nothing
  and installed; when the pool, the worker's rows or the step's token budget cannot take the
  next request, it waits (back-pressure; nothing is over-committed, and later requests do not
  overtake it);
* **one batch per step** with every running request at its own phase -- *prefill* at its
  first step (its rows write and attend over the whole sequence) and *denoise* afterwards
  (its rows write the target and attend over the cached prefix pages); a request without
  prefix is at prefill every step. Each row carries its own ``full_attn_spans``. The batch is
  prepared again only when its composition changes (an arrival, a phase change, a retirement);
* **retirement** of finished, failed and cancelled requests: their rows are retired from the
  worker for good (a tombstone refuses any snapshot of them still in flight) and their blocks
  returned to the pool on every terminal path;
* **prefix caching** (when the allocator has a
  :class:`~diffusion_kv.core.prefix_cache.PrefixCache`): a request that names its prefix content
  (``prefix_content``, per CFG row) gets chained block keys under a namespace of the model
  identity (``model_id``), its adapter, the worker's KV layout and rank geometry and its CFG
  branch, and its spans, cut by the boundary rule (none on a worker with a layer registered
  non-causal); on a hit its prefill step computes and writes only the
  uncached tokens; once its prefill step ran, its keyed blocks are sealed and published, so
  requests admitted later share them while it is still live;
* **reaping**: rows the worker holds for a request the allocator does not reserve (a late
  snapshot installed behind the scheduler's back, rows left by a scheduler that went away) are
  retired at the start of every step, so their blocks can serve the next owner.
* **outcomes, handed back once**: an ended request leaves every per-request structure, its
  payload is released, and its record is handed back once (:attr:`StepReport.outcomes`, or
  :meth:`DiffusionScheduler.drain_outcomes`); only a bounded window of recent outcomes
  (``outcome_memory``) stays for status queries, so nothing grows with the work served.

The scheduler and its allocator must describe the worker: every KV-cache group (``num_groups``),
its block size, the pool, row and length limits are checked at construction, and the
allocator's generations continue above the worker's high-water mark, so a scheduler started
again on a live worker is not taken for a late delivery.

The model runs through a callback that receives the :class:`StepBatch` (rows, spans, where each
request's tokens sit in the packed batch) and calls the runner's paged layers; an exception in
it fails the requests of that batch only (their K/V may be half written), and the scheduler goes
on with the others. ``KeyboardInterrupt`` and other non-``Exception`` errors cancel everything
and propagate.
"""

from __future__ import annotations

import copy
import enum
import hashlib
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

from diffusion_kv.core.allocator import AdmissionError, DiffusionKVAllocator, KVRequest, SequenceRequest
from diffusion_kv.core.capabilities import AttentionMode
from diffusion_kv.core.errors import DiffusionKVError, StateError, ValidationError
from diffusion_kv.core.kv_quant import cache_dtype_name
from diffusion_kv.core.layout import KVCacheGroup
from diffusion_kv.core.prefix_cache import (
    ContentSpan,
    PrefixNamespace,
    block_keys,
    cacheable_cut,
    check_content,
    covered_prefix,
)
from diffusion_kv.core.registry import KVCacheMode
from diffusion_kv.core.rows import PagedRow, Phase
from diffusion_kv.core.runner import PagedWorker
from diffusion_kv.core.runtime import BatchStepper
from diffusion_kv.core.translate import PreparedBatch

Span = tuple[int, int]


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in (RequestStatus.FINISHED, RequestStatus.FAILED, RequestStatus.CANCELLED)


def _positive(value: object, what: str, *, zero: bool = False) -> None:
    if type(value) is not int or value < (0 if zero else 1):
        raise ValidationError(f"{what} must be an int >= {0 if zero else 1}; got {value!r}")


def _check_callable(fn: object, what: str) -> None:
    if not callable(fn):
        raise ValidationError(f"{what}; got {type(fn).__name__} {fn!r}")


def _check_sizes(runner: PagedWorker, allocator: DiffusionKVAllocator) -> None:
    """Everything the allocator reserves must be installable on the worker."""
    layout = runner.layout
    assert layout is not None
    cp = runner.config.cp_size
    groups = [f"{g.spec.mode.value} layers, block size {g.block_size}" for g in layout.groups]
    problems = []
    if allocator.num_groups != len(layout.groups):
        problems.append(
            f"the worker has {len(layout.groups)} KV-cache group(s) ({'; '.join(groups)}) but the allocator "
            f"reserves blocks for {allocator.num_groups}: build it with num_groups={len(layout.groups)}"
        )
    tokens_per_block = {g.block_size * cp for g in layout.groups}
    if tokens_per_block != {allocator.block_size}:
        problems.append(
            f"allocator block size {allocator.block_size} does not match the worker's "
            f"{sorted(tokens_per_block)}" + (f" (block size x cp_size {cp})" if cp > 1 else "")
        )
    for what, mine, worker in (
        ("pool blocks", allocator.pool.num_total, layout.num_blocks),
        ("max_model_len", allocator.max_model_len, layout.max_model_len),
        ("max_rows_per_request", allocator.max_rows_per_request, layout.max_rows_per_request),
        ("worker_rows", allocator.worker_rows, layout.max_num_reqs),
    ):
        if mine > worker:
            problems.append(f"allocator {what} {mine} exceeds the worker's {worker}")
    if problems:
        raise ValidationError("the allocator does not describe this worker: " + "; ".join(problems))


def reap_unreserved(
    runner: PagedWorker, allocator: DiffusionKVAllocator, before: Callable[[], None] | None = None
) -> tuple[str, ...]:
    """Retire, for good, the worker rows of every request ``allocator`` does not reserve:
    nobody owns their blocks, so the allocator may hand them to someone else (a late snapshot
    installed after its request ended, rows a previous scheduler left). ``before`` runs first
    when there is something to reap (a runtime deactivating its batch). Returns the request
    ids reaped; one the worker fails to remove stays for the next call."""
    if not isinstance(runner, PagedWorker) or not isinstance(allocator, DiffusionKVAllocator):
        raise ValidationError(
            "reap_unreserved takes a PagedWorker and a DiffusionKVAllocator; got "
            f"{type(runner).__name__} and {type(allocator).__name__}"
        )
    registry = runner.registry
    if registry is None:
        return ()
    reserved = set(allocator.reserved())
    zombies = [rid for rid in registry.installed_requests() if rid not in reserved]
    if not zombies:
        return ()
    if before is not None:
        before()
    reaped = []
    for rid in zombies:
        through = max(allocator.generation, registry.generation_of(rid) or 0)
        try:
            runner.retire(rid, through)
        except DiffusionKVError:
            continue
        reaped.append(rid)
    return tuple(reaped)


def scales_version(runner: PagedWorker) -> int:
    """A counter that grows whenever a quantised layer's ``k_scale``/``v_scale`` is set
    (:meth:`~diffusion_kv.core.kv_quant.KVScales.set`); 0 on a worker without fp8 pages."""
    return sum(g.kv_scales.version for g in runner.layers.values() if g.kv_scales is not None)


def _group_identity(runner: PagedWorker, group: KVCacheGroup) -> str:
    layers = [runner.layers.get(n) for n in group.layer_names]
    spec = group.spec
    page = {
        cache_dtype_name(g.kv_dtype) if g is not None else cache_dtype_name(spec.cache_dtype or spec.dtype)
        for g in layers
    }
    text = (
        f"{spec.mode.value}/{group.block_size}/{spec.dtype}/pages {','.join(sorted(page))}/"
        f"{spec.num_kv_heads}x{spec.head_size}/layers {','.join(group.layer_names)}"
    )
    scales = [
        f"{g.layer_name} {g.kv_scales.identity()}"
        for g in layers
        if g is not None and g.kv_scales is not None
    ]
    if scales:
        text += "/scales " + hashlib.blake2b("|".join(scales).encode(), digest_size=8).hexdigest()
    return text


def worker_namespace(
    runner: PagedWorker, model_id: str, branch: int = 0, adapter: str | None = None
) -> PrefixNamespace:
    """The prefix-cache namespace of CFG branch ``branch`` on ``runner``'s worker: the model
    identity, the KV layout (per group: attention mode, block size, compute dtype, the pages'
    dtype, head geometry, its layers, and a digest of the fp8 ``k_scale``/``v_scale`` values as
    they are now) and the rank geometry (decode context parallelism, CFG parallelism, Ulysses and
    ring degrees). Keys made from it after a scale changed never match keys made before."""
    layout = runner.layout
    if layout is None:
        raise StateError("a prefix-cache namespace needs an initialised runner (initialize_kv_cache first)")
    groups = ";".join(_group_identity(runner, g) for g in layout.groups)
    c = runner.config
    ranks = (
        f"cp {c.cp_size}:{c.cp_rank}:{c.cp_interleave}, cfg {c.cfg_parallel_size}:{c.cfg_parallel_rank}, "
        f"{c.parallel!r}"
    )
    return PrefixNamespace(model_id, groups, ranks, adapter, branch)


def row_prefix_keys(
    runner: PagedWorker,
    namespace: PrefixNamespace,
    content: tuple[ContentSpan, ...],
    prefix_len: int,
    full_attn_spans: tuple[Span, ...],
    block_size: int,
) -> tuple[bytes, ...]:
    """The chained keys of the blocks one row may share: full blocks inside the named prefix
    (at most ``prefix_len``), before the cut of the boundary rule, keyed with the row's spans.
    Empty on a worker with a layer registered non-causal (:attr:`AttentionMode.FULL`): its
    prefix queries may see the target, so no prefix block is the same in another request."""
    layout = runner.layout
    if layout is None:
        raise StateError("prefix keys need an initialised runner (initialize_kv_cache first)")
    if not content or any(g.spec.mode is AttentionMode.FULL for g in layout.groups):
        return ()
    limit = min(prefix_len, covered_prefix(content))
    cut = cacheable_cut(limit, full_attn_spans, block_size)
    return block_keys(content, namespace, cut, block_size, full_attn_spans)


@dataclass(frozen=True)
class DiffusionRequest:
    """One request: ``cfg_rows`` sequences of ``prefix_len`` condition tokens (cached after the
    first step) followed by ``target_len`` tokens denoised for ``steps`` steps.

    ``full_attn_spans`` (absolute positions, the same for every CFG row) default to the target
    as one bidirectional span, ``((prefix_len, prefix_len + target_len),)``; the rest is causal.
    ``payload`` is the caller's (model inputs, say); the scheduler never reads it.

    ``prefix_content`` names, per CFG row, the content of the row's prefix tokens
    (:class:`~diffusion_kv.core.prefix_cache.ContentSpan` s inside ``[0, prefix_len)``) for
    prefix caching; empty (the default): the request is never cached and never hits.
    ``adapter`` tags an adapter (LoRA, ...) the K/V depend on.
    """

    request_id: str
    prefix_len: int
    target_len: int
    steps: int
    cfg_rows: int = 1
    full_attn_spans: tuple[Span, ...] | None = None
    payload: Any = field(default=None, compare=False, repr=False)
    prefix_content: tuple[tuple[ContentSpan, ...], ...] = ()
    adapter: str | None = None

    def __post_init__(self) -> None:
        if type(self.request_id) is not str or not self.request_id:
            raise ValidationError(f"request_id must be a non-empty string; got {self.request_id!r}")
        _positive(self.prefix_len, f"request {self.request_id!r} prefix_len", zero=True)
        _positive(self.target_len, f"request {self.request_id!r} target_len")
        _positive(self.steps, f"request {self.request_id!r} steps")
        _positive(self.cfg_rows, f"request {self.request_id!r} cfg_rows")
        if self.full_attn_spans is None:
            object.__setattr__(self, "full_attn_spans", ((self.prefix_len, self.seq_len),))
        else:
            try:
                if any(not isinstance(pair, (tuple, list)) for pair in self.full_attn_spans):
                    raise TypeError
                spans = tuple((a, b) for a, b in self.full_attn_spans)
            except (TypeError, ValueError):
                raise ValidationError(
                    f"request {self.request_id!r} full_attn_spans must be (start, end) pairs; "
                    f"got {self.full_attn_spans!r}"
                ) from None
            prev = 0
            for a, b in spans:
                if type(a) is not int or type(b) is not int or not prev <= a < b <= self.seq_len:
                    raise ValidationError(
                        f"request {self.request_id!r} full_attn_spans must be sorted, non-overlapping "
                        f"integer spans inside [0, {self.seq_len}]; got {list(spans)}"
                    )
                prev = b
            object.__setattr__(self, "full_attn_spans", spans)
        content = self.prefix_content
        if isinstance(content, (str, bytes)) or not isinstance(content, (tuple, list)):
            raise ValidationError(
                f"request {self.request_id!r} prefix_content must be one sequence of ContentSpan per CFG "
                f"row; got {content!r}"
            )
        if content and len(content) != self.cfg_rows:
            raise ValidationError(
                f"request {self.request_id!r} prefix_content has {len(content)} rows; it has "
                f"{self.cfg_rows} CFG rows (give one per row, or none)"
            )
        rows = tuple(check_content(c, f"request {self.request_id!r} prefix_content") for c in content)
        for r, row in enumerate(rows):
            if row and row[-1].end > self.prefix_len:
                raise ValidationError(
                    f"request {self.request_id!r} prefix_content of row {r} reaches token {row[-1].end}, past "
                    f"its prefix ({self.prefix_len} tokens): only prefix tokens are cached"
                )
        object.__setattr__(self, "prefix_content", rows)
        if self.adapter is not None and (type(self.adapter) is not str or not self.adapter):
            raise ValidationError(
                f"request {self.request_id!r} adapter must be None or a non-empty string; got {self.adapter!r}"
            )

    @property
    def seq_len(self) -> int:
        return self.prefix_len + self.target_len

    def kv_request(self, prefix_keys: tuple[tuple[bytes, ...], ...] = ()) -> KVRequest:
        """What the allocator reserves; ``prefix_keys`` per CFG row (prefix caching)."""
        return KVRequest(
            self.request_id,
            tuple(
                SequenceRequest(
                    i, self.prefix_len, self.target_len, prefix_keys=prefix_keys[i] if prefix_keys else ()
                )
                for i in range(self.cfg_rows)
            ),
        )

    def _check_step(self, step: object) -> int:
        if type(step) is not int or not 0 <= step < self.steps:
            raise ValidationError(
                f"request {self.request_id!r} step must be an int in [0, {self.steps}); got {step!r}"
            )
        return step

    def phase(self, step: int) -> Phase:
        """Prefill at the first step, and at every step of a request without prefix."""
        return Phase.PREFILL if self._check_step(step) == 0 or self.prefix_len == 0 else Phase.DENOISE

    def rows(self, step: int, cached: tuple[int, ...] = ()) -> tuple[PagedRow, ...]:
        """The request's paged rows at ``step`` (one per CFG row). ``cached``: per row, the
        prefix tokens found in the prefix cache, which the prefill step neither computes nor
        writes."""
        prefill = self.phase(step) is Phase.PREFILL
        out = []
        for i in range(self.cfg_rows):
            start = (cached[i] if cached else 0) if prefill else self.prefix_len
            out.append(PagedRow(self.request_id, self.seq_len - start, self.seq_len, start, sequence_id=i))
        return tuple(out)

    def step_tokens(self, step: int) -> int:
        return self.cfg_rows * (self.seq_len if self.phase(step) is Phase.PREFILL else self.target_len)


@dataclass
class RequestRecord:
    """A request's progress and outcome (``error`` is set for failed requests). Once the
    request has ended its ``request`` is a copy with ``payload=None``: the scheduler keeps no
    payload of a request that is over."""

    request: DiffusionRequest
    status: RequestStatus = RequestStatus.WAITING
    steps_done: int = 0
    submitted_tick: int = 0
    admitted_tick: int | None = None
    finished_tick: int | None = None
    error: str | None = None


@dataclass(frozen=True)
class BatchEntry:
    """One request's part of a step batch: its rows are consecutive, starting at ``row_offset``;
    its packed tokens are ``[token_offset, token_offset + num_tokens)``, row after row."""

    request: DiffusionRequest
    step: int
    phase: Phase
    rows: tuple[PagedRow, ...]
    row_offset: int
    token_offset: int

    @property
    def query_len(self) -> int:
        """Tokens of the first row (the whole sequence at prefill, less a prefix-cache hit; the
        target at denoise)."""
        return self.rows[0].query_len

    @property
    def num_tokens(self) -> int:
        return sum(r.query_len for r in self.rows)


@dataclass(frozen=True)
class StepBatch:
    """What the model runs at one scheduler step."""

    tick: int
    entries: tuple[BatchEntry, ...]
    rows: tuple[PagedRow, ...]
    full_attn_spans: tuple[tuple[Span, ...], ...]
    """Per row, for :class:`~diffusion_kv.core.layer_context.AttentionMetadata`."""
    prepared: PreparedBatch
    composition_steps: int
    """Consecutive steps this exact composition has been active, this one included."""
    stable_for: int
    """Steps (this one included) the composition lasts at least, unless a request is admitted
    or cancelled meanwhile."""

    @property
    def num_tokens(self) -> int:
        return sum(e.num_tokens for e in self.entries)


@dataclass(frozen=True)
class StepReport:
    tick: int
    admitted: tuple[str, ...]
    finished: tuple[str, ...]
    failed: tuple[str, ...]
    cancelled: tuple[str, ...]
    rows: int
    tokens: int
    prepared: bool
    """The batch was prepared at this step (its composition changed)."""
    blocks_in_use: int
    blocks_total: int
    reaped: tuple[str, ...] = ()
    """Requests whose rows the worker held without an allocator reservation: retired."""
    outcomes: tuple[RequestRecord, ...] = ()
    """The record of every request that ended since outcomes were last handed back, in the
    order they ended: this step's finished, failed and cancelled requests, and any cancelled
    between steps. Each outcome is handed back once, here or by
    :meth:`DiffusionScheduler.drain_outcomes`."""


StepFn = Callable[[StepBatch], None]

DEFAULT_OUTCOME_MEMORY = 1024
"""Ended requests whose record :class:`DiffusionScheduler` keeps for status queries (the most
recent ones; a few hundred bytes each, no payload)."""


class RecordsView(Mapping[str, RequestRecord]):
    """A read-only, live view of a scheduler's records: every waiting and running request, then
    the ``outcome_memory`` most recent ended ones. Building it copies nothing; a lookup, ``in``
    and ``len`` are O(1); iterating costs what it shows."""

    __slots__ = ("_live", "_recent")

    def __init__(self, live: Mapping[str, RequestRecord], recent: Mapping[str, RequestRecord]) -> None:
        self._live = live
        self._recent = recent

    def __getitem__(self, request_id: str) -> RequestRecord:
        rec = self._live.get(request_id)
        if rec is None:
            rec = self._recent[request_id]
        return rec

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._live or request_id in self._recent

    def __len__(self) -> int:
        return len(self._live) + len(self._recent)  # disjoint: a resubmitted id leaves the window

    def __iter__(self) -> Iterator[str]:
        yield from self._live
        yield from self._recent

    def __repr__(self) -> str:
        return f"RecordsView({len(self._live)} live, {len(self._recent)} recent outcomes)"


def _without_payload(request: DiffusionRequest) -> DiffusionRequest:
    """``request`` with ``payload=None`` (a shallow copy; the caller's request is unchanged)."""
    if request.payload is None:
        return request
    out = copy.copy(request)
    object.__setattr__(out, "payload", None)
    return out


class DiffusionScheduler(AbstractContextManager["DiffusionScheduler"]):
    """See the module docstring. ``max_batch_tokens`` caps the tokens of one step (default: the
    worker's ``max_num_batched_tokens``); ``max_running`` caps the requests stepped together.

    **Nothing grows with the work served.** The scheduler holds a record only for requests that
    are waiting or running. When a request ends (finished, failed, cancelled) its record leaves
    every per-request structure, its payload is released (the record keeps the request with
    ``payload=None``), and its outcome is handed back once: in the next :class:`StepReport`
    (``outcomes``), or by :meth:`drain_outcomes` (after :meth:`close`, say). For status queries
    the scheduler keeps the records of the ``outcome_memory`` most recent ended requests
    (default :data:`DEFAULT_OUTCOME_MEMORY`; 0 keeps none), least recent forgotten first;
    :meth:`record`, :meth:`status` and the :attr:`records` view answer in O(1) per request and
    copy nothing. Late snapshots of ended requests are refused by the worker's tombstones
    (:class:`~diffusion_kv.core.registry.RowRegistry`, ``generation_memory``), not by this
    window."""

    def __init__(
        self,
        runner: PagedWorker,
        allocator: DiffusionKVAllocator,
        *,
        max_batch_tokens: int | None = None,
        max_running: int | None = None,
        model_id: str | None = None,
        outcome_memory: int = DEFAULT_OUTCOME_MEMORY,
    ) -> None:
        if not isinstance(runner, PagedWorker):
            raise ValidationError(f"the scheduler needs a PagedWorker; got {type(runner).__name__}")
        if not isinstance(allocator, DiffusionKVAllocator):
            raise ValidationError(
                f"the scheduler needs a DiffusionKVAllocator; got {type(allocator).__name__}"
            )
        layout = runner.layout
        if layout is None or runner.registry is None:
            raise StateError("the scheduler needs an initialised runner (initialize_kv_cache first)")
        if runner.config.mode is not KVCacheMode.PAGED:
            raise ValidationError(f"the scheduler needs a paged runner; this one runs {runner.config.mode}")
        _check_sizes(runner, allocator)
        if allocator.prefix_cache is not None and (type(model_id) is not str or not model_id):
            raise ValidationError(
                "prefix caching needs the model/weights identity: pass model_id (a non-empty string naming "
                f"the weights, their revision and anything else the K/V depend on); got {model_id!r}"
            )
        if model_id is not None and (type(model_id) is not str or not model_id):
            raise ValidationError(f"model_id must be None or a non-empty string; got {model_id!r}")
        budget = runner.config.max_num_batched_tokens
        if max_batch_tokens is not None:
            _positive(max_batch_tokens, "max_batch_tokens")
            budget = min(budget, max_batch_tokens)
        if max_running is not None:
            _positive(max_running, "max_running")
        _positive(outcome_memory, "outcome_memory", zero=True)
        self._stepper = runner.stepper()
        self._runtime: BatchStepper = self._stepper.__enter__()
        # Nothing was refused: from here on the scheduler owns its side of the protocol.
        allocator.advance_generation(runner.generation_high_water)
        self.runner = runner
        self.allocator = allocator
        self.max_batch_tokens = budget
        self.max_running = max_running
        self.outcome_memory = outcome_memory
        self._live: dict[str, RequestRecord] = {}  # waiting and running requests only
        self._recent: OrderedDict[str, RequestRecord] = OrderedDict()  # the last outcome_memory outcomes
        self._outcomes: list[RequestRecord] = []  # ended, not yet handed back
        self._waiting: deque[str] = deque()
        self._running: list[str] = []
        self._cancel_pending: set[str] = set()
        self._quarantined: dict[str, str] = {}
        self._tick = 0
        self._last_rows: tuple[PagedRow, ...] | None = None
        self._same_steps = 0
        self._in_step = False
        self._close_pending = False
        self._closed = False
        self.peak_blocks_in_use = 0
        self.peak_blocks_held = 0
        """The most blocks live requests held at once (cached blocks nobody holds apart)."""
        self.preparations = 0
        self.model_id = model_id
        self._cached: dict[str, tuple[int, ...]] = {}  # request id -> prefix tokens hit, per row
        self._keys: dict[str, tuple[tuple[bytes, ...], ...]] = {}
        self._keyed_under: dict[str, int] = {}  # request id -> scales_version its keys were made at
        self._scales_seen = scales_version(runner)
        self.prefix_hit_tokens = 0
        """Prefix tokens admitted requests found cached (summed over their rows)."""
        self.prefix_hit_blocks = 0

    # -- views --------------------------------------------------------------------------------

    @property
    def tick(self) -> int:
        return self._tick

    @property
    def records(self) -> Mapping[str, RequestRecord]:
        """Waiting and running requests, then the ``outcome_memory`` most recent ended ones: a
        live, read-only :class:`RecordsView` (no copy; O(1) lookups)."""
        return RecordsView(self._live, self._recent)

    def record(self, request_id: str) -> RequestRecord | None:
        """The record of a waiting or running request, or of a recently ended one (within the
        ``outcome_memory`` window); None otherwise. O(1)."""
        rec = self._live.get(request_id)
        return rec if rec is not None else self._recent.get(request_id)

    def status(self, request_id: str) -> RequestStatus | None:
        """:attr:`RequestRecord.status` of :meth:`record`; None for an unknown or forgotten id."""
        rec = self.record(request_id)
        return rec.status if rec is not None else None

    def drain_outcomes(self) -> tuple[RequestRecord, ...]:
        """Hand back, once, the record of every request that ended since outcomes were last
        handed back (:attr:`StepReport.outcomes` hands them back at each step; this is for
        outcomes no step reported: cancellations between steps, :meth:`close`)."""
        out = tuple(self._outcomes)
        self._outcomes.clear()
        return out

    @property
    def pending_outcomes(self) -> int:
        """Ended requests whose outcome was not handed back yet."""
        return len(self._outcomes)

    @property
    def waiting(self) -> tuple[str, ...]:
        return tuple(self._waiting)

    @property
    def running(self) -> tuple[str, ...]:
        return tuple(self._running)

    @property
    def idle(self) -> bool:
        return not self._waiting and not self._running

    @property
    def blocks_in_use(self) -> int:
        pool = self.allocator.pool
        return pool.num_total - pool.num_free

    @property
    def quarantined(self) -> Mapping[str, str]:
        """Requests whose rows the worker failed to remove: their blocks stay reserved (reusing
        blocks the worker may still map would mix requests' K/V), with the error."""
        return dict(self._quarantined)

    @property
    def prefix_caching(self) -> bool:
        return self.allocator.prefix_cache is not None

    def namespace(self, branch: int = 0, adapter: str | None = None) -> PrefixNamespace:
        """The prefix-cache namespace of CFG branch ``branch`` on this worker
        (:func:`worker_namespace`)."""
        return worker_namespace(self.runner, self.model_id or "-", branch, adapter)

    def prefix_keys(self, request: DiffusionRequest) -> tuple[tuple[bytes, ...], ...]:
        """Per CFG row, the chained keys of the blocks ``request`` may share (empty without
        prefix caching or prefix content; :func:`row_prefix_keys`)."""
        if not self.prefix_caching or not request.prefix_content:
            return ()
        keys = tuple(
            row_prefix_keys(
                self.runner,
                self.namespace(branch, request.adapter),
                content,
                request.prefix_len,
                request.full_attn_spans or (),
                self.allocator.block_size,
            )
            for branch, content in enumerate(request.prefix_content)
        )
        return keys if any(keys) else ()

    # -- requests -----------------------------------------------------------------------------

    def submit(self, request: DiffusionRequest) -> None:
        """Queue ``request``; :class:`AdmissionError` when it can never run here."""
        self._check_open()
        if not isinstance(request, DiffusionRequest):
            raise ValidationError(f"submit takes a DiffusionRequest; got {type(request).__name__}")
        rid = request.request_id
        known = self._live.get(rid)
        if known is not None:
            raise ValidationError(f"request {rid!r} is already {known.status.value}")
        if rid in self._quarantined:
            raise ValidationError(f"request {rid!r} is quarantined ({self._quarantined[rid]})")
        if rid in self.allocator.reserved():
            raise ValidationError(
                f"request id {rid!r} is already reserved in the allocator by another owner (blocks "
                f"{self.allocator.blocks_of(rid)}); submit under another id, or free it first"
            )
        keys = self.prefix_keys(request)
        self.allocator.check(request.kv_request(keys))
        prefill_tokens = request.step_tokens(0)
        if prefill_tokens > self.max_batch_tokens:
            raise AdmissionError(
                f"request {rid!r} needs {prefill_tokens} tokens in its first step; a step takes at most "
                f"{self.max_batch_tokens}"
            )
        self._recent.pop(rid, None)  # an earlier request under this id: the new one supersedes it
        self._live[rid] = RequestRecord(request, submitted_tick=self._tick)
        self._keys[rid] = keys
        self._keyed_under[rid] = scales_version(self.runner)
        self._waiting.append(rid)

    def cancel(self, request_id: str) -> bool:
        """Cancel a waiting or running request (its blocks are freed; inside a step, once the
        step ends). False when it is unknown or already over."""
        if type(request_id) is not str or not request_id:
            raise ValidationError(f"cancel takes a non-empty request id string; got {request_id!r}")
        rec = self._live.get(request_id)
        if rec is None:
            return False
        if rec.status is RequestStatus.WAITING:
            self._waiting.remove(request_id)
            self._end(rec, RequestStatus.CANCELLED)
            return True
        if self._in_step:
            self._cancel_pending.add(request_id)
        else:
            self._retire([request_id], RequestStatus.CANCELLED)
        return True

    # -- stepping -----------------------------------------------------------------------------

    def step(self, fn: StepFn) -> StepReport | None:
        """Admit, run one batch with every running request through ``fn``, retire; None when
        there is nothing to run and nothing to report (no outcome to hand back, nothing refused
        or reaped)."""
        self._check_open()
        if self._in_step:
            raise StateError("scheduler.step was called from inside a step")
        _check_callable(fn, "step takes the model callback fn(batch)")
        tick = self._tick
        reaped = self._reap()
        self._drop_stale_prefixes()
        admitted, refused = self._admit()
        if not self._running:
            if not refused and not reaped and not self._outcomes:
                return None
            self._tick += 1
            return self._report(tick, admitted, (), refused, (), (), False, reaped)
        entries = self._compose()
        live = {e.request.request_id: self._live[e.request.request_id] for e in entries}
        rows = tuple(r for e in entries for r in e.rows)
        spans = tuple(e.request.full_attn_spans or () for e in entries for _ in e.rows)
        before = self._runtime.preparations
        failed: list[str] = []
        finished: list[str] = []
        try:
            prepared = self._runtime.ensure_rows(rows)
        except Exception as exc:
            failed = [e.request.request_id for e in entries]
            self._retire(
                failed, RequestStatus.FAILED, f"preparing the batch failed: {type(exc).__name__}: {exc}"
            )
            self._tick += 1
            return self._report(tick, admitted, (), (*refused, *failed), (), rows, False, reaped)
        prepared_now = self._runtime.preparations != before
        self.preparations += int(prepared_now)
        self._same_steps = 1 if prepared_now or rows != self._last_rows else self._same_steps + 1
        self._last_rows = rows
        batch = StepBatch(
            tick=tick,
            entries=entries,
            rows=rows,
            full_attn_spans=spans,
            prepared=prepared,
            composition_steps=self._same_steps,
            stable_for=min(self._lasts(e) for e in entries),
        )
        self._in_step = True
        try:
            fn(batch)
        except Exception as exc:
            self._in_step = False
            failed = [e.request.request_id for e in entries]
            self._retire(failed, RequestStatus.FAILED, f"{type(exc).__name__}: {exc}")
        except BaseException:
            self._in_step = False
            self.close()
            raise
        else:
            self._in_step = False
            sealed_failed = self._publish([e for e in entries if e.phase is Phase.PREFILL])
            for e in entries:
                rec = live[e.request.request_id]
                if e.request.request_id in sealed_failed:
                    continue
                rec.steps_done += 1
                if rec.steps_done == rec.request.steps:
                    finished.append(e.request.request_id)
            failed = list(sealed_failed)
            for rid, why in sealed_failed.items():
                self._retire([rid], RequestStatus.FAILED, why)
            self._retire(finished, RequestStatus.FINISHED)
        cancelled = sorted(self._cancel_pending - set(failed) - set(finished))
        self._cancel_pending.clear()
        self._retire(cancelled, RequestStatus.CANCELLED)
        self._tick += 1
        ended = [*failed, *finished, *cancelled]  # by final status: a failed removal is a failure
        by_status = {
            status: tuple(rid for rid in ended if live[rid].status is status)
            for status in (RequestStatus.FINISHED, RequestStatus.FAILED, RequestStatus.CANCELLED)
        }
        report = self._report(
            tick,
            admitted,
            by_status[RequestStatus.FINISHED],
            (*refused, *by_status[RequestStatus.FAILED]),
            by_status[RequestStatus.CANCELLED],
            rows,
            prepared_now,
            reaped,
        )
        if self._close_pending:  # close() was called inside this step: it takes effect now
            self.close()
        return report

    def run(
        self, fn: StepFn, on_step: Callable[[StepReport], None] | None = None
    ) -> dict[str, RequestRecord]:
        """Step until nothing is waiting or running; returns, by request id, the outcome of
        every request that ended meanwhile (and of any ended earlier and not yet handed back):
        the outcomes the steps' reports carried, which ``on_step`` sees too. For an endless
        stream, call :meth:`step` and take each report's ``outcomes`` instead."""
        _check_callable(fn, "run takes the model callback fn(batch)")
        if on_step is not None:
            _check_callable(on_step, "run's on_step takes a callback on_step(report) or None")
        ended: dict[str, RequestRecord] = {}
        while not self.idle:
            report = self.step(fn)
            if report is None:
                raise StateError(
                    f"requests {list(self._waiting)} wait, but nothing runs and none can be admitted "
                    "(the block pool or the worker rows are held outside this scheduler)"
                )
            ended.update((r.request.request_id, r) for r in report.outcomes)
            if on_step is not None:
                on_step(report)
        ended.update((r.request.request_id, r) for r in self.drain_outcomes())
        return ended

    def close(self) -> None:
        """Cancel every waiting and running request and release the runtime (idempotent).
        Inside a step (from the model callback) it takes effect when the step ends: the batch's
        requests end as the step decides (finished, failed) or cancelled, never both."""
        if self._closed:
            return
        if self._in_step:
            self._close_pending = True
            self._cancel_pending.update(self._running)
            for rid in list(self._waiting):
                self._end(self._live[rid], RequestStatus.CANCELLED)
            self._waiting.clear()
            return
        for rid in list(self._waiting):
            self._end(self._live[rid], RequestStatus.CANCELLED)
        self._waiting.clear()
        try:
            self._retire(list(self._running), RequestStatus.CANCELLED)
        finally:
            self._closed = True
            self._stepper.__exit__(None, None, None)

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ----------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed or self._close_pending:
            raise StateError(
                "the scheduler is closed" + (" (closing at the end of this step)" if not self._closed else "")
            )

    def _lasts(self, entry: BatchEntry) -> int:
        req = entry.request
        if entry.phase is Phase.PREFILL and req.prefix_len > 0:
            return 1  # its rows change to the denoise phase next step
        return req.steps - entry.step

    def _admit(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """Admit waiting requests in order while they fit; ``(admitted, failed)``. A request the
        allocator refuses (another owner took its id meanwhile) or the worker refuses fails; the
        ones behind it go on."""
        admitted: list[str] = []
        failed: list[str] = []
        tokens = sum(self._live[rid].request.step_tokens(self._live[rid].steps_done) for rid in self._running)
        while self._waiting:
            rid = self._waiting[0]
            rec = self._live[rid]
            if self.max_running is not None and len(self._running) >= self.max_running:
                break
            need = rec.request.step_tokens(0)
            if tokens + need > self.max_batch_tokens:
                break
            if rid in self.allocator.reserved():  # taken by another owner after submission
                self._waiting.popleft()
                self._end(
                    rec,
                    RequestStatus.FAILED,
                    f"request id {rid!r} was reserved in the allocator by another owner before admission",
                )
                failed.append(rid)
                continue
            if self._keys.get(rid) and self._keyed_under.get(rid) != self._scales_seen:
                # fp8 scales changed since submission: key under the scales its pages get now
                self._keys[rid] = self.prefix_keys(rec.request)
                self._keyed_under[rid] = self._scales_seen
            try:
                snapshot = self.allocator.reserve(rec.request.kv_request(self._keys.get(rid, ())))
            except DiffusionKVError as exc:
                self._waiting.popleft()
                self._end(rec, RequestStatus.FAILED, f"reservation failed: {type(exc).__name__}: {exc}")
                failed.append(rid)
                continue
            if snapshot is None:
                break  # back-pressure: the pool or the worker rows are full for now
            self._waiting.popleft()
            self._runtime.deactivate()  # installing changes the block tables
            try:
                self.runner.install(snapshot)
            except Exception as exc:
                self.allocator.free(rid)
                self._end(rec, RequestStatus.FAILED, f"install failed: {type(exc).__name__}: {exc}")
                failed.append(rid)
                continue
            rec.status = RequestStatus.RUNNING
            rec.admitted_tick = self._tick
            hit = tuple(s.cached_prefix_len for s in snapshot.sequences)
            self._cached[rid] = hit
            self.prefix_hit_tokens += sum(hit)
            self.prefix_hit_blocks += sum(hit) // self.allocator.block_size
            self._running.append(rid)
            admitted.append(rid)
            tokens += need
        self.peak_blocks_in_use = max(self.peak_blocks_in_use, self.blocks_in_use)
        self.peak_blocks_held = max(self.peak_blocks_held, self.allocator.blocks_held)
        return tuple(admitted), tuple(failed)

    def _publish(self, entries: list[BatchEntry]) -> dict[str, str]:
        """Seal and publish the keyed prefix blocks of the requests whose prefill step just ran;
        returns the requests whose seal the worker refused, with the reason (they fail: the
        allocator published nothing of theirs)."""
        refused: dict[str, str] = {}
        for e in entries:
            rid = e.request.request_id
            if not any(self._keys.get(rid, ())):
                continue
            if self._keyed_under.get(rid) != scales_version(self.runner):
                continue  # scales set during its prefill: its pages may mix two scales, share none
            self._runtime.deactivate()  # sealing changes what the rows may write
            try:
                self.allocator.publish(rid, self.runner.seal)
            except Exception as exc:
                refused[rid] = f"sealing its prefix for the prefix cache failed: {type(exc).__name__}: {exc}"
        return refused

    def _drop_stale_prefixes(self) -> None:
        """After an fp8 scale changed, no lookup can match a block cached before (its keys hold
        the old scales): give the idle ones back to the pool now instead of waiting for LRU."""
        now = scales_version(self.runner)
        if now == self._scales_seen:
            return
        self._scales_seen = now
        cache = self.allocator.prefix_cache
        if cache is not None:
            self.allocator.pool.free(cache.evict(cache.num_idle))

    def _reap(self) -> tuple[str, ...]:
        """Retire the rows of requests the allocator does not reserve (see module docstring)."""
        return reap_unreserved(self.runner, self.allocator, before=self._runtime.deactivate)

    def _compose(self) -> tuple[BatchEntry, ...]:
        # Short queries first (denoise rows before prefill rows), stable in admission order:
        # what backends that reorder batches require, and a deterministic composition.
        order = sorted(
            self._running,
            key=lambda rid: (
                self._live[rid]
                .request.rows(self._live[rid].steps_done, self._cached.get(rid, ()))[0]
                .query_len
            ),
        )
        entries: list[BatchEntry] = []
        row_offset = token_offset = 0
        for rid in order:
            rec = self._live[rid]
            step = rec.steps_done
            rows = rec.request.rows(step, self._cached.get(rid, ()))
            entry = BatchEntry(rec.request, step, rec.request.phase(step), rows, row_offset, token_offset)
            entries.append(entry)
            row_offset += len(rows)
            token_offset += entry.num_tokens
        return tuple(entries)

    def _retire(
        self, ids: list[str] | tuple[str, ...], status: RequestStatus, error: str | None = None
    ) -> None:
        if not ids:
            return
        self._runtime.deactivate()  # removing rows changes the block tables
        for rid in ids:
            rec = self._live[rid]
            if rid in self._running:
                self._running.remove(rid)
            try:  # for good: a snapshot of it still in flight is refused, not installed again
                self.runner.retire(rid, self.allocator.generation)
            except Exception as exc:  # the worker may still map the blocks: never reuse them
                self._quarantined[rid] = f"{type(exc).__name__}: {exc}"
                self._end(rec, RequestStatus.FAILED, f"removing its rows failed: {self._quarantined[rid]}")
                continue
            self.allocator.free(rid)
            self._end(rec, status, error)

    def _end(self, rec: RequestRecord, status: RequestStatus, error: str | None = None) -> None:
        """The request is over: it leaves every per-request structure, its payload is released,
        and its outcome waits to be handed back (and stays in the recent window)."""
        rid = rec.request.request_id
        self._cached.pop(rid, None)
        self._keys.pop(rid, None)
        del self._live[rid]
        self._keyed_under.pop(rid, None)
        rec.request = _without_payload(rec.request)
        rec.status = status
        rec.finished_tick = self._tick
        if error is not None:
            rec.error = error
        self._outcomes.append(rec)
        if self.outcome_memory:
            self._recent[rid] = rec
            if len(self._recent) > self.outcome_memory:
                self._recent.popitem(last=False)

    def _report(
        self,
        tick: int,
        admitted: tuple[str, ...],
        finished: list[str] | tuple[str, ...],
        failed: list[str] | tuple[str, ...],
        cancelled: list[str] | tuple[str, ...],
        rows: tuple[PagedRow, ...],
        prepared: bool,
        reaped: tuple[str, ...] = (),
    ) -> StepReport:
        return StepReport(
            tick=tick,
            admitted=tuple(admitted),
            finished=tuple(finished),
            failed=tuple(failed),
            cancelled=tuple(cancelled),
            rows=len(rows),
            tokens=sum(r.query_len for r in rows),
            prepared=prepared,
            blocks_in_use=self.blocks_in_use,
            blocks_total=self.allocator.pool.num_total,
            reaped=reaped,
            outcomes=self.drain_outcomes(),
        )


def iter_entries(batch: StepBatch) -> Iterator[tuple[BatchEntry, slice]]:
    """Each entry with the slice of the packed token axis its rows occupy."""
    for e in batch.entries:
        yield e, slice(e.token_offset, e.token_offset + e.num_tokens)


__all__ = [
    "DEFAULT_OUTCOME_MEMORY",
    "BatchEntry",
    "DiffusionRequest",
    "DiffusionScheduler",
    "Phase",
    "RecordsView",
    "RequestRecord",
    "RequestStatus",
    "StepBatch",
    "StepReport",
    "iter_entries",
    "reap_unreserved",
    "row_prefix_keys",
    "scales_version",
    "worker_namespace",
]
