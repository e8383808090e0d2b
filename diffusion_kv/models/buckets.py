"""CUDA graphs for batches that change every step: the tiny DiT captured per token bucket, with
paged attention run eagerly between the captured pieces (the way vLLM's piecewise graphs work).

A captured whole step (:class:`~diffusion_kv.core.graphs.CapturedStep`) bakes in its paged batch:
it replays only while the rows stay the same. A serving batch changes whenever a request
arrives, finishes or moves from prefill to denoise. Here only what does not depend on the batch's
rows is captured:

* the token axis is padded to a bucket (``buckets``: a fixed, sorted list of token counts; a
  step with more tokens than the largest bucket runs eagerly);
* per bucket, ``layers + 1`` graphs over static buffers: RoPE tables and layer 0 up to its
  attention; each layer's tail (output projection, MLP) and the next layer up to its attention;
  the last tail and the final projection. Every bucket's graphs share one memory pool (below);
* between the pieces the paged attention layer runs eagerly on the real tokens only
  (``attention(name, q[:n], k[:n], v[:n])``): padding tokens never reach the paged cache, so
  they write no page, and the attention metadata is whatever the active batch is (never a
  stale capture). Its output is copied into the bucket's attention buffer; the padding part
  of that buffer stays zero.

Padding tokens carry zeros through the captured pieces (finite, discarded at the end). Buckets
are captured lazily, the first time a step needs one; capture time and the graph pool's memory
are counted (:attr:`BucketGraphs.capture_ms`, :attr:`BucketGraphs.graph_bytes`).

Every bucket's graphs share one memory pool. That is safe because a step replays one bucket's
graphs only, and nothing a replay leaves in pool memory is read after its step: the inputs (token
buffer, positions) and the attention buffers are allocated outside the pool, the queries, keys
and values a piece returns are read by the attention before the next piece runs, and the final
projection is copied out (``index_select``) before the step returns. So the pool holds the
largest bucket's working memory once, not every bucket's.

``default_buckets`` doubles up to 2048 tokens and then grows by a quarter of each power of two
(2048, 2560, 3072, 3584, 4096, 5120, ...): a GPU-bound step is padded by at most a quarter,
where powers of two throughout pad it by up to 2x. The price is memory: a captured bucket keeps
the queries, keys and values its pieces return alive (they are the graphs' output buffers), so
graph memory grows with the tokens of every bucket captured (on an H100 at the stream bench's
full shape: 11.4 GB for 13 quarter-octave buckets against 6.2 GB for 6 powers of two, for a
7 % faster stream; ``per_octave=1`` gives the old set).

A replay computes the step the eager path computes for the padded token axis: the same kernels
on the same inputs, so the real tokens' outputs equal an eager run over the padded axis; against
an eager run over the real tokens only, matrix products may take other kernels for the other
row count, so outputs agree within the dtype's rounding.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from diffusion_kv.core.errors import UnsupportedFeatureError, ValidationError
from diffusion_kv.models.tiny_dit import AttentionFn, Block, TinyDiT, rope_tables


def default_buckets(
    max_tokens: int, smallest: int = 256, per_octave: int = 4, fine_from: int = 2048
) -> tuple[int, ...]:
    """Token buckets from ``smallest`` up to the first that holds ``max_tokens``: doubling below
    ``fine_from``; from there each bucket grows by ``1 / per_octave`` of the largest power of two
    at or under it (2048, 2560, 3072, 3584, 4096, 5120, ... at the defaults), so a large step is
    padded by at most a ``1 / per_octave`` share rather than up to 2x. ``per_octave=1``: doubling
    throughout (powers of two from a power-of-two ``smallest``)."""
    for name, value in (
        ("max_tokens", max_tokens),
        ("smallest", smallest),
        ("per_octave", per_octave),
        ("fine_from", fine_from),
    ):
        if type(value) is not int or value <= 0:
            raise ValidationError(f"{name} must be a positive integer; got {value!r}")
    out = [smallest]
    while out[-1] < max_tokens:
        size = out[-1]
        if size < fine_from or per_octave == 1:
            out.append(2 * size)
        else:
            power = 1 << (size.bit_length() - 1)
            out.append(size + max(power // per_octave, 1))
    return tuple(out)


@dataclass
class _Bucket:
    tokens: int
    x: torch.Tensor  # [1, N, hidden] input
    positions: torch.Tensor  # [N] long
    attn: list[torch.Tensor]  # per layer [1, N, H, d]: the eager attention's output, padded
    graphs: list[torch.cuda.CUDAGraph] = field(default_factory=list)
    qkv: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=list)
    out: torch.Tensor | None = None  # [1, N, hidden]: the final projection of every token


class BucketGraphs:
    """The tiny DiT's packed step (:meth:`TinyDiT.run_packed`) with per-bucket piecewise graphs."""

    def __init__(self, model: TinyDiT, buckets: Sequence[int], device: torch.device) -> None:
        if device.type != "cuda":
            raise UnsupportedFeatureError(f"bucketed CUDA graphs need a CUDA device; got {device}")
        sizes = tuple(buckets)
        if not sizes or list(sizes) != sorted(set(sizes)) or sizes[0] <= 0:
            raise ValidationError(f"buckets must be positive, sorted and distinct; got {list(buckets)}")
        self.model = model
        self.buckets = sizes
        self.device = device
        self._captured: dict[int, _Bucket] = {}
        self._pool: Any = None  # one graph memory pool for every bucket (module docstring)
        self.capture_ms = 0.0
        self.graph_bytes = 0
        self.replays = 0
        self.eager = 0

    def bucket_for(self, tokens: int) -> int | None:
        """The smallest bucket holding ``tokens``, or None (the step runs eagerly)."""
        for size in self.buckets:
            if tokens <= size:
                return size
        return None

    @property
    def captured_buckets(self) -> tuple[int, ...]:
        return tuple(sorted(self._captured))

    def run(
        self, x: torch.Tensor, positions: torch.Tensor, attention: AttentionFn, out_index: torch.Tensor
    ) -> torch.Tensor:
        """``model.run_packed(x, positions, attention, out_index)``, replayed from the bucket's
        graphs where one holds the step's tokens."""
        n = x.shape[1]
        size = self.bucket_for(n)
        if size is None or torch.cuda.is_current_stream_capturing():
            self.eager += 1
            return self.model.run_packed(x, positions, attention, out_index)
        bucket = self._captured.get(size)
        if bucket is None:
            bucket = self._capture(size)
        bucket.x[:, :n].copy_(x)
        bucket.x[:, n:].zero_()
        bucket.positions[:n].copy_(positions)
        bucket.positions[n:].zero_()
        blocks = cast(list[Block], list(self.model.blocks))
        for i, graph in enumerate(bucket.graphs):
            graph.replay()
            if i < len(blocks):
                q, k, v = bucket.qkv[i]
                out = attention(blocks[i].name, q[:, :n], k[:, :n], v[:, :n])
                bucket.attn[i][:, :n].copy_(out)
        self.replays += 1
        assert bucket.out is not None
        return bucket.out[0, :n].index_select(0, out_index)

    # -- capture --------------------------------------------------------------------------------

    def _pieces(self, bucket: _Bucket) -> list[Callable[[], Any]]:
        model = self.model
        blocks = cast(list[Block], list(model.blocks))
        state: dict[str, Any] = {}

        def first() -> None:
            state["tables"] = rope_tables(bucket.positions, model.cfg.head_size) if model.cfg.rope else None
            state["x"] = bucket.x
            bucket.qkv.append(blocks[0].pre(bucket.x, state["tables"]))

        def middle(i: int) -> Callable[[], None]:
            def piece() -> None:
                state["x"] = blocks[i - 1].post(state["x"], bucket.attn[i - 1])
                bucket.qkv.append(blocks[i].pre(state["x"], state["tables"]))

            return piece

        def last() -> None:
            x = blocks[-1].post(state["x"], bucket.attn[-1])
            bucket.out = cast(torch.Tensor, model.final(model.final_norm(x)))

        return [first, *(middle(i) for i in range(1, len(blocks))), last]

    def _capture(self, size: int) -> _Bucket:
        model, device = self.model, self.device
        cfg = model.cfg
        began = time.perf_counter()
        torch.cuda.synchronize(device)
        reserved = torch.cuda.memory_reserved(device)
        bucket = _Bucket(
            tokens=size,
            x=torch.zeros((1, size, cfg.hidden), dtype=cfg.dtype, device=device),
            positions=torch.zeros(size, dtype=torch.long, device=device),
            attn=[
                torch.zeros((1, size, cfg.heads, cfg.head_size), dtype=cfg.dtype, device=device)
                for _ in model.blocks
            ],
        )
        pieces = self._pieces(bucket)
        side = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # one eager pass first: kernels chosen and compiled
            for piece in pieces:
                piece()
        torch.cuda.current_stream(device).wait_stream(side)
        bucket.qkv.clear()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        pool = self._pool
        gc.collect()  # no unreachable graph may be destroyed mid-capture (see core.graphs)
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            for piece in pieces:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    piece()
                bucket.graphs.append(graph)
        finally:
            if was_enabled:
                gc.enable()
        torch.cuda.synchronize(device)
        self.graph_bytes += max(torch.cuda.memory_reserved(device) - reserved, 0)
        self.capture_ms += (time.perf_counter() - began) * 1e3
        self._captured[size] = bucket
        return bucket
