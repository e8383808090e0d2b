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
  against metadata it was not captured with. Capture again for the new batch.

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

    @property
    def valid(self) -> bool:
        """Whether the batch it was captured with is still the active one."""
        return self.translator.active_batch is self.batch

    def replay(self, *inputs: torch.Tensor) -> Any:
        """Copy ``inputs`` into the static buffers, replay, return the static outputs."""
        if not self.valid:
            raise StaleBatchError(
                "the captured step belongs to a batch that is no longer active (a new phase, preparation "
                "or BlockTables change since): capture it again for the active batch"
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
        self.graph.replay()
        self.replays += 1
        return self.static_output
