"""Sequence, CFG and decode-context parallelism around the paged call, on torch.distributed.

Every collective here goes through ``torch.distributed`` (NCCL on CUDA, HCCL on Ascend, gloo on
CPU); there is no transport of our own. Three forms of parallelism are supported:

* **Strict Ulysses** (:class:`UlyssesParallel`): each rank of the sequence-parallel group holds a
  shard of the sequence with every head. Before the paged call an all-to-all trades sequence
  shards for head shards (each rank then sees the whole sequence for ``heads / degree`` heads,
  which is what it registered and allocated KV for); after the call the inverse all-to-all
  restores the sequence shard. Synthetic tokens that pad the sequence to a multiple of the
  degree are cut out before the paged call and re-inserted (as zeros) after it, so pages only
  ever hold real tokens.
* **CFG-parallel** (:func:`select_cfg_branch`, :func:`select_cfg_rows`,
  :func:`gather_cfg_branches`): the CFG branches of a request run on different ranks; each rank
  installs, and attends with, only its branch's rows.
* **Decode context parallelism** (:class:`DCPMerger`): a row's KV is interleaved across the DCP
  ranks (``cp_interleave`` consecutive tokens per rank in turn); each rank attends its queries
  over its local keys, returning the partial output and its log-sum-exp, and the partials are
  merged across ranks by log-sum-exp weighting, which reproduces single-rank attention.

Ring attention, all-gather-KV and non-strict Ulysses are rejected at layer registration
(:class:`~diffusion_kv.core.runner.PagedWorker`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from diffusion_kv.core.allocation import RequestAllocation
from diffusion_kv.core.errors import StateError, ValidationError
from diffusion_kv.core.rows import PagedRow, PhaseRows

"""The ``torch.distributed`` backend used for each device type."""


def require_distributed(what: str) -> None:
    if not dist.is_available() or not dist.is_initialized():
        raise StateError(
            f"{what} needs an initialised torch.distributed process group "
            "(launch with torchrun and call torch.distributed.init_process_group first)"
        )


@dataclass(frozen=True)
class RankGroup:
    """One process group as seen from this rank: its size, this rank's index in it, the handle.

    ``group`` is a ``torch.distributed`` ProcessGroup; ``None`` means the default (world) group,
    or no communication at all when ``size == 1``.
    """

    size: int
    rank: int
    group: Any = None

    def __post_init__(self) -> None:
        if type(self.size) is not int or self.size <= 0:
            raise ValidationError(f"process group size must be a positive integer; got {self.size!r}")
        if type(self.rank) is not int or not 0 <= self.rank < self.size:
            raise ValidationError(f"rank must lie in [0, {self.size}); got {self.rank!r}")

    @classmethod
    def single(cls) -> RankGroup:
        """A group of one: every collective is the identity."""
        return cls(1, 0, None)

    @classmethod
    def of(cls, group: Any = None) -> RankGroup:
        """This rank's view of ``group`` (``None``: the default group)."""
        require_distributed("RankGroup.of")
        return cls(dist.get_world_size(group), dist.get_rank(group), group)


# --------------------------------------------------------------------------------------------
# Strict Ulysses
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SequencePadding:
    """Synthetic tokens at ``[start, start + length)`` of every row of the gathered sequence.

    Ulysses pads a sequence to a multiple of its degree. Where the padding sits depends on how
    the model assembles its sequence: at the end for a plain sequence (:meth:`rear`), or
    between the padded image tokens and rear joint tokens (:meth:`for_joint`).
    """

    start: int
    length: int

    def __post_init__(self) -> None:
        if type(self.start) is not int or self.start < 0:
            raise ValidationError(f"SequencePadding.start must be an int >= 0; got {self.start!r}")
        if type(self.length) is not int or self.length < 0:
            raise ValidationError(f"SequencePadding.length must be an int >= 0; got {self.length!r}")

    @classmethod
    def rear(cls, real_len: int, degree: int) -> SequencePadding:
        """Padding after ``real_len`` tokens, up to the next multiple of ``degree``."""
        return cls(real_len, (-real_len) % degree)

    @classmethod
    def for_joint(cls, padded_len: int, pad: int, joint_len: int, joint_strategy: str) -> SequencePadding:
        """Padding of a ``padded_len`` sequence (``pad`` synthetic tokens at its end) joined with
        ``joint_len`` replicated tokens in ``"front"`` or ``"rear"``."""
        if joint_strategy == "front":
            return cls(joint_len + padded_len - pad, pad)
        if joint_strategy == "rear":
            return cls(padded_len - pad, pad)
        raise ValidationError(f"joint_strategy must be 'front' or 'rear'; got {joint_strategy!r}")


PagedForward = Callable[[str, torch.Tensor, torch.Tensor, torch.Tensor, Any], torch.Tensor]
"""``(layer_name, q, k, v, attn_metadata) -> out``, e.g. ``PagedWorker.forward``."""


class UlyssesParallel:
    """Head sharding by all-to-all across the sequence-parallel group (strict Ulysses).

    Tensors are ``[B, L, H, D]`` (a 3-D ``[L, H, D]`` tensor is treated as ``B = 1``). Rank
    ``r`` of a degree-``N`` group owns query heads ``[r*H/N, (r+1)*H/N)`` and the matching KV
    heads, so grouped-query attention keeps its head grouping on every rank.
    """

    def __init__(self, group: RankGroup) -> None:
        if not isinstance(group, RankGroup):
            raise ValidationError(f"UlyssesParallel needs a RankGroup; got {type(group).__name__}")
        self.group = group

    @property
    def degree(self) -> int:
        return self.group.size

    def _all_to_all(self, chunks: torch.Tensor) -> torch.Tensor:
        """``chunks[j]`` goes to rank ``j``; the result's ``[j]`` came from rank ``j``."""
        if self.degree == 1:
            return chunks
        send = chunks.contiguous()
        out = torch.empty_like(send)  # like a contiguous tensor: all_to_all fills it in order
        dist.all_to_all_single(out, send, group=self.group.group)
        return out

    def _check(self, x: torch.Tensor, what: str) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or x.ndim not in (3, 4):
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValidationError(f"Ulysses {what} must be [B, L, H, D] or [L, H, D]; got {shape}")
        return x if x.ndim == 4 else x.unsqueeze(0)

    def scatter_heads(self, x: torch.Tensor, what: str = "tensor") -> torch.Tensor:
        """``[B, L/N, H, D]`` (sequence shard, all heads) -> ``[B, L, H/N, D]``."""
        x4 = self._check(x, what)
        n = self.degree
        b, ls, h, d = x4.shape
        if h % n:
            raise ValidationError(f"Ulysses {what} has {h} heads, not divisible by ulysses_degree={n}")
        chunks = x4.reshape(b, ls, n, h // n, d).permute(2, 0, 1, 3, 4)  # [N, B, Ls, h, D]
        got = self._all_to_all(chunks)  # [j] = rank j's sequence shard of my heads
        out = got.permute(1, 0, 2, 3, 4).reshape(b, n * ls, h // n, d)
        return out if x.ndim == 4 else out.squeeze(0)

    def gather_heads(self, x: torch.Tensor, what: str = "output") -> torch.Tensor:
        """``[B, L, H/N, D]`` -> ``[B, L/N, H, D]`` (the inverse of :meth:`scatter_heads`)."""
        x4 = self._check(x, what)
        n = self.degree
        b, seq, h, d = x4.shape
        if seq % n:
            raise ValidationError(f"Ulysses {what} has {seq} tokens, not divisible by ulysses_degree={n}")
        chunks = x4.reshape(b, n, seq // n, h, d).permute(1, 0, 2, 3, 4)  # [N, B, Ls, h, D]
        got = self._all_to_all(chunks)  # [j] = rank j's heads of my sequence shard
        out = got.permute(1, 2, 0, 3, 4).reshape(b, seq // n, n * h, d)
        return out if x.ndim == 4 else out.squeeze(0)

    @staticmethod
    def strip_padding(x: torch.Tensor, padding: SequencePadding | None) -> torch.Tensor:
        """Cut the synthetic tokens out of ``[B, L, ...]``."""
        if padding is None or padding.length == 0:
            return x
        end = padding.start + padding.length
        if end > x.shape[1]:
            raise ValidationError(
                f"Ulysses padding [{padding.start}, {end}) lies outside the gathered sequence of "
                f"{x.shape[1]} tokens"
            )
        return torch.cat([x[:, : padding.start], x[:, end:]], dim=1)

    @staticmethod
    def insert_padding(x: torch.Tensor, padding: SequencePadding | None) -> torch.Tensor:
        """Put zero tokens back where :meth:`strip_padding` cut them out."""
        if padding is None or padding.length == 0:
            return x
        zeros = x.new_zeros((x.shape[0], padding.length, *x.shape[2:]))
        return torch.cat([x[:, : padding.start], zeros, x[:, padding.start :]], dim=1)

    def attention(
        self,
        forward: PagedForward,
        layer_name: str,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_metadata: Any = None,
        *,
        padding: SequencePadding | None = None,
    ) -> torch.Tensor:
        """One paged layer under strict Ulysses.

        ``query``/``key``/``value`` are this rank's sequence shard with every head
        (``[B, L/N, H, D]``); the paged ``forward`` sees the whole unpadded sequence with this
        rank's heads; the result is this rank's sequence shard with every head again.
        """
        shapes = {tuple(t.shape[:-2]) for t in (query, key, value) if isinstance(t, torch.Tensor)}
        if len(shapes) != 1:
            raise ValidationError(
                "Ulysses query, key and value need one token layout; got shapes "
                f"{[tuple(t.shape) for t in (query, key, value)]}"
            )
        q = self.scatter_heads(self._check(query, "query"), "query")
        k = self.scatter_heads(self._check(key, "key"), "key")
        v = self.scatter_heads(self._check(value, "value"), "value")
        q, k, v = (self.strip_padding(t, padding) for t in (q, k, v))
        out = forward(layer_name, q, k, v, attn_metadata)
        out = self.insert_padding(self._check(out, "output"), padding)
        result = self.gather_heads(out)
        return result if query.ndim == 4 else result.squeeze(0)

    def gather_sequence(self, x: torch.Tensor) -> torch.Tensor:
        """All-gather sequence shards ``[B, L/N, ...]`` into ``[B, L, ...]`` (rank order)."""
        if self.degree == 1:
            return x
        send = x.contiguous()
        parts = [torch.empty_like(send) for _ in range(self.degree)]
        dist.all_gather(parts, send, group=self.group.group)
        return torch.cat(parts, dim=1)


# --------------------------------------------------------------------------------------------
# CFG-parallel
# --------------------------------------------------------------------------------------------


def select_cfg_branch(snapshot: RequestAllocation, cfg_size: int, cfg_rank: int) -> RequestAllocation:
    """The part of ``snapshot`` that rank ``cfg_rank`` of a CFG-parallel group installs.

    The request must carry exactly one sequence per CFG branch; branch ``cfg_rank`` is
    ``sequences[cfg_rank]``. The result keeps that sequence and the contexts it refers to, at
    the snapshot's generation. Nothing is installed here; a mismatch raises before any install.
    """
    if type(cfg_size) is not int or cfg_size <= 0:
        raise ValidationError(f"cfg_parallel_size must be a positive integer; got {cfg_size!r}")
    if type(cfg_rank) is not int or not 0 <= cfg_rank < cfg_size:
        raise ValidationError(f"cfg_parallel_rank must lie in [0, {cfg_size}); got {cfg_rank!r}")
    if not isinstance(snapshot, RequestAllocation):
        raise ValidationError(f"expected a RequestAllocation; got {type(snapshot).__name__}")
    if cfg_size == 1:
        return snapshot
    if len(snapshot.sequences) != cfg_size:
        raise ValidationError(
            f"request {snapshot.request_id!r} has {len(snapshot.sequences)} sequences; CFG-parallel size "
            f"{cfg_size} needs exactly one sequence per CFG branch"
        )
    branch = snapshot.sequences[cfg_rank]
    used = set(branch.context_ids)
    return RequestAllocation(
        snapshot.request_id,
        snapshot.allocation_generation,
        (branch,),
        tuple(c for c in snapshot.contexts if c.context_id in used),
    )


def select_cfg_rows(phases: PhaseRows, branches: Sequence[RequestAllocation]) -> PhaseRows:
    """Keep the rows that belong to the installed CFG branches ``branches``.

    Rows of a request listed in ``branches`` are kept only if their sequence (or context) is in
    that branch; rows of other requests are kept unchanged.
    """
    keep: dict[str, set[tuple[int | None, str | None]]] = {}
    for snap in branches:
        ids = keep.setdefault(snap.request_id, set())
        ids.update((s.sequence_id, None) for s in snap.sequences)
        ids.update((None, c.context_id) for c in snap.contexts)

    def mine(row: PagedRow) -> bool:
        ids = keep.get(row.request_id)
        return ids is None or (row.sequence_id, row.context_id) in ids

    prefill = tuple(r for r in phases.prefill if mine(r))
    denoise = tuple(r for r in phases.denoise if mine(r))
    if not prefill:
        raise ValidationError("no paged row of this rank's CFG branch is left in the phase rows")
    return PhaseRows(prefill, denoise)


def gather_cfg_branches(x: torch.Tensor, group: RankGroup) -> torch.Tensor:
    """All-gather each rank's branch output ``[b, ...]`` into ``[size*b, ...]`` (branch order)."""
    if group.size == 1:
        return x
    send = x.contiguous()
    parts = [torch.empty_like(send) for _ in range(group.size)]
    dist.all_gather(parts, send, group=group.group)
    return torch.cat(parts, dim=0)


# --------------------------------------------------------------------------------------------
# Decode context parallelism
# --------------------------------------------------------------------------------------------


def merge_partial_attention(outputs: Sequence[torch.Tensor], lses: Sequence[torch.Tensor]) -> torch.Tensor:
    """Combine partial attentions over disjoint key sets into attention over their union.

    ``outputs[i]`` is ``[T, H, D]`` (softmax-normalised over key set ``i``), ``lses[i]`` its
    ``[T, H]`` log-sum-exp (``-inf`` where no key was visible). The weights are
    ``exp(lse_i - max_j lse_j)``; a query with no visible key anywhere gets zeros.
    """
    if not outputs or len(outputs) != len(lses):
        raise ValidationError(f"need one LSE per partial output; got {len(outputs)} and {len(lses)}")
    lse = torch.stack([x.float() for x in lses])  # [N, T, H]
    top = lse.max(dim=0).values
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    weights = torch.exp(lse - top)  # -inf -> 0
    total = weights.sum(dim=0)
    acc = sum((o.float() * w[..., None] for o, w in zip(outputs, weights, strict=True)), torch.zeros(()))
    assert isinstance(acc, torch.Tensor)
    merged = acc / total.clamp_min(torch.finfo(torch.float32).tiny)[..., None]
    return merged.to(outputs[0].dtype)


class PartialMerger(Protocol):
    """Merges this rank's partial attention with the other DCP ranks' (what the executor calls)."""

    @property
    def size(self) -> int: ...

    @property
    def rank(self) -> int: ...

    def merge(self, output: torch.Tensor, lse: torch.Tensor) -> torch.Tensor: ...


class DCPMerger:
    """LSE merge of partial attention across the DCP group.

    Two collectives: an all-gather of the ``[T, H]`` log-sum-exps (so every rank derives the
    same weights) and an all-reduce of the weighted ``[T, H, D]`` outputs.
    """

    def __init__(self, group: RankGroup) -> None:
        if not isinstance(group, RankGroup):
            raise ValidationError(f"DCPMerger needs a RankGroup; got {type(group).__name__}")
        self.group = group

    @property
    def size(self) -> int:
        return self.group.size

    @property
    def rank(self) -> int:
        return self.group.rank

    def merge(self, output: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return output
        lse32 = lse.float().contiguous()
        every = [torch.empty_like(lse32) for _ in range(self.size)]
        dist.all_gather(every, lse32, group=self.group.group)
        stacked = torch.stack(every)
        top = stacked.max(dim=0).values
        top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
        weights = torch.exp(stacked - top)
        total = weights.sum(dim=0)
        acc = output.float() * weights[self.rank][..., None]
        dist.all_reduce(acc, op=dist.ReduceOp.SUM, group=self.group.group)
        merged = acc / total.clamp_min(torch.finfo(torch.float32).tiny)[..., None]
        return merged.to(output.dtype)


def dcp_key_positions(
    local_len: int, cp_size: int, cp_rank: int, interleave: int, device: Any = None
) -> torch.Tensor:
    """Absolute positions of a row's first ``local_len`` keys held by ``cp_rank``.

    Under DCP, position ``p`` lives on rank ``(p // interleave) % cp_size`` (vLLM's layout when
    ``interleave`` divides the block size); local key ``j`` is therefore position
    ``(j // I) * I * N + rank * I + j % I``.
    """
    j = torch.arange(local_len, device=device)
    return (j // interleave) * (interleave * cp_size) + cp_rank * interleave + j % interleave


# --------------------------------------------------------------------------------------------
# Groups, launch and cross-rank checks
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ParallelGroups:
    """This rank's groups: world = cfg x ulysses (rank = cfg_rank * ulysses + ulysses_rank)."""

    world: RankGroup
    ulysses: RankGroup
    cfg: RankGroup


def build_parallel_groups(ulysses_degree: int, cfg_parallel_size: int) -> ParallelGroups:
    """Split the default group into CFG-parallel and Ulysses groups (every rank must call this)."""
    require_distributed("build_parallel_groups")
    world = RankGroup.of(None)
    for name, value in (("ulysses_degree", ulysses_degree), ("cfg_parallel_size", cfg_parallel_size)):
        if type(value) is not int or value <= 0:
            raise ValidationError(f"{name} must be a positive integer; got {value!r}")
    if ulysses_degree * cfg_parallel_size != world.size:
        raise ValidationError(
            f"ulysses_degree={ulysses_degree} x cfg_parallel_size={cfg_parallel_size} = "
            f"{ulysses_degree * cfg_parallel_size} ranks, but the world has {world.size}"
        )
    uly_rank, cfg_rank = world.rank % ulysses_degree, world.rank // ulysses_degree
    ulysses = cfg = RankGroup.single()
    # new_group must be called by every rank for every group, in the same order.
    for c in range(cfg_parallel_size):
        ranks = [c * ulysses_degree + u for u in range(ulysses_degree)]
        handle = dist.new_group(ranks) if ulysses_degree > 1 else None
        if c == cfg_rank:
            ulysses = RankGroup(ulysses_degree, uly_rank, handle)
    for u in range(ulysses_degree):
        ranks = [c * ulysses_degree + u for c in range(cfg_parallel_size)]
        handle = dist.new_group(ranks) if cfg_parallel_size > 1 else None
        if u == uly_rank:
            cfg = RankGroup(cfg_parallel_size, cfg_rank, handle)
    return ParallelGroups(world, ulysses, cfg)


def init_distributed_from_env(backend: str) -> RankGroup:
    """Initialise the default process group from torchrun's environment, if not done already,
    with ``backend`` (the platform's ``distributed_backend``: gloo, nccl, hccl, a vendor's)."""
    if dist.is_initialized():
        return RankGroup.of(None)
    missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
    if missing:
        raise StateError(
            f"torch.distributed environment variable(s) {missing} are not set; launch with "
            "torchrun --nproc-per-node N"
        )
    if type(backend) is not str or not backend:
        raise ValidationError(f"a torch.distributed backend name is needed; got {backend!r}")
    dist.init_process_group(backend=backend)
    return RankGroup.of(None)


def verify_replicated(value: Any, group: RankGroup, what: str) -> None:
    """Raise on every rank unless ``value`` (picklable) is equal on every rank of ``group``."""
    if group.size == 1:
        return
    every: list[Any] = [None] * group.size
    dist.all_gather_object(every, value, group=group.group)
    differing = [r for r, v in enumerate(every) if v != every[0]]
    if differing:
        raise StateError(
            f"{what} differs across ranks: rank 0 has {every[0]!r}, rank(s) {differing} have "
            f"{[every[r] for r in differing]!r}"
        )
