"""Capture a denoise step once, replay it for every later step with the same batch.

A diffusion model re-runs the same step with the same paged batch (the denoise phase: same
rows, same block tables, same slot mappings) for every step after the first two; only the
latent and the timestep change. :class:`CapturedStep` records one such step as a CUDA graph
and replays it, so the host cost of a step (Python per layer, kernel launches) is paid once.

Rules (each has a test):

* capture needs an active batch, a CUDA device, and backends that declare
  ``supports_graph_capture`` (their per-layer path launches work only: no host sync, no
  host-to-device copy, no data-dependent host control flow); anything else is refused with
  the reason;
* inputs are copied into static buffers before every replay, and the outputs are the graph's
  static buffers (consume or clone them before the next replay);
* a replay after the active batch changed (a new phase, a new preparation, a BlockTables
  mutation) is a :class:`~diffusion_kv.core.errors.StaleBatchError`: a graph is never replayed
  against metadata it was not captured with. Capture again for the new batch -- unless the new
  batch is *graph-equal* to the captured one: every backend of the worker gave both the same
  :meth:`~diffusion_kv.core.backend.PagedBackend.graph_key` (the same kernels over the same
  memory, which the new batch's preparation refilled) and the core hands their layers the same
  tensors (:meth:`~diffusion_kv.core.translate.Translator.graph_key`). The graph then replays for
  the new batch (``retargets`` counts those batches), so a host keeps one graph per batch shape
  -- a session's chunks once its window has filled, one graph per window-fill shape -- and
  captures only shapes it has not seen (:class:`StepGraphs`). A capture whose step took a
  piecewise plan (full attention spans: per-activation tensors) serves its own batch only;

* the garbage collector is run before a capture and kept off during it, so an unreachable
  earlier capture (kept alive by a reference cycle) is never destroyed mid-capture, which would
  invalidate the capture (CUDA forbids destroying a graph while a stream captures).

The first call runs the step eagerly (on a side stream, as CUDA graphs require before capture):
its result is the step's real output (``warmup_output``), so no step is wasted.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Sequence
from typing import Any

import torch

from diffusion_kv.core.errors import StaleBatchError, UnsupportedFeatureError, ValidationError
from diffusion_kv.core.translate import PreparedBatch, Translator


def _tensors(values: Sequence[Any], what: str) -> tuple[torch.Tensor, ...]:
    bad = [type(v).__name__ for v in values if not isinstance(v, torch.Tensor)]
    if bad:
        raise ValidationError(f"captured-step {what} must be tensors; got {bad}")
    return tuple(values)


def check_capture_args(fn: object, inputs: Sequence[object], warmups: object) -> None:
    """What capture takes: a callable step, tensors, and ``warmups`` an int >= 1."""
    if not callable(fn):
        raise ValidationError(f"capture takes the step function fn(*inputs); got {type(fn).__name__} {fn!r}")
    if type(warmups) is not int or warmups < 1:
        raise ValidationError(f"capture warmups must be an int >= 1; got {warmups!r}")
    _tensors(inputs, "inputs")


class CapturedStep:
    """One step function recorded as a CUDA graph over the translator's active batch."""

    def __init__(
        self,
        translator: Translator,
        fn: Callable[..., Any],
        inputs: Sequence[torch.Tensor],
        *,
        warmups: int = 1,
    ) -> None:
        check_capture_args(fn, inputs, warmups)
        state = translator.require_active()
        device = translator.device
        if device.type != "cuda":
            raise UnsupportedFeatureError(f"graph capture needs a CUDA device; the worker runs on {device}")
        self.translator = translator
        self.batch: PreparedBatch = state.batch
        self.fn = fn
        self.static_inputs = tuple(t.clone() for t in _tensors(inputs, "inputs"))
        side = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(warmups):
                self.warmup_output = fn(*self.static_inputs)
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        # Unreachable objects that own CUDA graphs (an earlier captured step kept alive only by a
        # reference cycle) are destroyed when the garbage collector runs; destroying a graph
        # while this capture is underway invalidates the capture. So collect first and keep the
        # collector off until the capture has ended.
        gc.collect()
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            with torch.cuda.graph(self.graph):
                self.static_output = fn(*self.static_inputs)
        finally:
            if was_enabled:
                gc.enable()
        self.replays = 0
        self.retargets = 0
        """Batches other than the captured one the graph replayed for (graph-equal ones)."""
        self.layers_done = frozenset(state.layers_done)
        """The paged layers the captured step ran: a replay for another batch counts them done,
        so that batch's writes are recorded as an eager step's would be."""
        self.key = translator.graph_key(self.batch) if state.plan is None and not state.packing else None
        """The captured batch's :meth:`Translator.graph_key` (None: it serves that batch only)."""

    def serves(self, batch: PreparedBatch | None, key: tuple[Any, ...] | None = None) -> bool:
        """Whether a replay computes ``batch``: the captured batch, or one graph-equal to it
        (``key``: the batch's :meth:`Translator.graph_key`, when the caller has it)."""
        if batch is None:
            return False
        if batch is self.batch:
            return True
        if self.key is None or batch.owner is not self.batch.owner:
            return False
        return (key if key is not None else self.translator.graph_key(batch)) == self.key

    @property
    def valid(self) -> bool:
        """Whether a replay now computes the active batch (the captured one or a graph-equal one)."""
        return self.serves(self.translator.active_batch)

    def replay(self, *inputs: torch.Tensor) -> Any:
        """Copy ``inputs`` into the static buffers, replay, return the static outputs."""
        active = self.translator.active_batch
        if not self.serves(active):
            raise StaleBatchError(
                "the captured step belongs to a batch that is no longer active (a new phase, preparation "
                "or BlockTables change since) and the active one is not graph-equal to it: capture it "
                "again for the active batch"
            )
        given = _tensors(inputs, "inputs")
        if len(given) != len(self.static_inputs):
            raise ValidationError(f"captured step takes {len(self.static_inputs)} inputs; got {len(given)}")
        for static, new in zip(self.static_inputs, given, strict=True):
            if new.shape != static.shape or new.dtype != static.dtype or new.device != static.device:
                raise ValidationError(
                    f"captured-step input {tuple(new.shape)} {new.dtype} {new.device} differs from the captured "
                    f"{tuple(static.shape)} {static.dtype} {static.device}"
                )
            static.copy_(new, non_blocking=True)
        if active is not self.batch:  # graph-equal: the graph computes it from here on
            assert active is not None
            self.batch = active
            self.retargets += 1
        state = self.translator.active_state
        if state is not None:
            state.layers_done.update(self.layers_done)
        self.graph.replay()
        self.replays += 1
        return self.static_output


class StepGraphs:
    """Captured steps kept by batch shape (``PagedWorker.step_graphs``): :meth:`run` replays the
    one that serves the active batch -- captured over it, or over a graph-equal one
    (:meth:`CapturedStep.serves`) -- and captures the step otherwise. A session's chunks, once
    its window has filled, are graph-equal on backends that give a
    :meth:`~diffusion_kv.core.backend.PagedBackend.graph_key`, so a stream captures one graph per
    window-fill shape; on others each new batch runs eagerly (below).

    ``fn`` must compute the same step for every call (only its ``inputs`` vary: they are copied
    into the graph's static buffers); the output of a replay is the graph's static buffer
    (consume or clone it before the next :meth:`run`). At most ``limit`` graphs are kept, the
    least recently used dropped first.

    A batch no backend keys (:meth:`Translator.graph_key` None) could only replay its own graph,
    for the steps left before the next preparation -- a session chunk's few denoise steps, which
    a capture costs more than it saves (the H100 numbers in ``docs/benchmarks.md``). Such a
    batch runs eagerly unless ``capture_unkeyed`` (a batch kept for many steps, such as a
    one-shot request's denoise phase). ``captures``, ``replays`` and ``eager`` count the calls."""

    def __init__(
        self,
        capture: Callable[..., CapturedStep],
        translator: Translator,
        limit: int = 8,
        capture_unkeyed: bool = False,
    ) -> None:
        if type(limit) is not int or limit < 1:
            raise ValidationError(f"step_graphs limit must be an int >= 1; got {limit!r}")
        if type(capture_unkeyed) is not bool:
            raise ValidationError(f"step_graphs capture_unkeyed must be a bool; got {capture_unkeyed!r}")
        self._capture = capture
        self.translator = translator
        self.limit = limit
        self.capture_unkeyed = capture_unkeyed
        self.steps: list[CapturedStep] = []
        """The kept captures, least recently used first."""
        self.captures = 0
        self.replays = 0
        self.eager = 0

    def run(self, fn: Callable[..., Any], *inputs: torch.Tensor) -> Any:
        """The step over the active batch: a kept graph's replay, or a new capture's eager
        output (the step runs once eagerly, then is recorded)."""
        check_capture_args(fn, inputs, 1)
        active = self.translator.require_active().batch
        key: tuple[Any, ...] | None = None
        keyed = False
        for i, step in enumerate(self.steps):
            if step.batch is not active:
                if step.key is None:
                    continue
                if not keyed:
                    key, keyed = self.translator.graph_key(active), True
                if key is None or not step.serves(active, key):
                    continue
            self.steps.append(self.steps.pop(i))
            self.replays += 1
            return step.replay(*inputs)
        if not self.capture_unkeyed:
            if not keyed:
                key, keyed = self.translator.graph_key(active), True
            if key is None:
                self.eager += 1
                return fn(*inputs)
        step = self._capture(fn, *inputs)
        self.steps.append(step)
        if len(self.steps) > self.limit:
            del self.steps[0]
        self.captures += 1
        return step.warmup_output
