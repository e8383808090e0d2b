"""Admission for sessions: how many more sessions of a policy fit the pool, now and at most.

A windowed session holds at most :meth:`SessionCache.kv_blocks_bound` blocks per branch while
a chunk is open (sink + window + the chunk, each rounded out to blocks, plus the block a chunk
boundary may straddle), however long it runs. So with ``B`` branches:

* ``per_session = kv_blocks_bound() * B`` -- what one more session may come to hold;
* ``at_most = num_total // per_session`` (and no more than the worker rows allow) -- how many
  such sessions an empty pool serves together, none ever short;
* ``now = (num_free - headroom) // per_session`` -- how many more fit today without any live
  session running short later, where ``headroom`` is what the live sessions may still take
  before they reach their own bound (an offloaded session holds nothing and counts nothing: it
  comes back only when :func:`~diffusion_kv.core.sessions.offload.reload` finds room).

A session without a window keeps every chunk, so its row grows until ``max_model_len``: its
``per_session`` is ``cdiv(max_model_len, block) * B``. ``begin_session`` refuses
(:class:`AdmissionError`, with the numbers) a session that could never fit: its rows exceed the
per-request or worker row limits, its bound exceeds the pool (windowed), or, without a window,
its first chunk alone exceeds the pool. Idle prefix-cache blocks are not counted as free here
(a chunk's extension takes blocks from the pool only).
"""

from __future__ import annotations

from dataclasses import dataclass

from diffusion_kv.core.errors import ValidationError
from diffusion_kv.core.layout import cdiv
from diffusion_kv.core.sessions.cache import SessionCache


@dataclass(frozen=True)
class Admission:
    """The answer of :func:`admission` (module docstring)."""

    branches: int
    per_session: int
    """Blocks one more session of this policy and ``branches`` may come to hold."""
    now: int
    """More sessions that fit now, every live session keeping room to reach its bound."""
    at_most: int
    """Sessions an empty pool serves together (the pool and the worker rows)."""
    free_blocks: int
    headroom: int
    """Blocks the live (not offloaded) sessions may still take before reaching their bound."""
    bounded: bool
    """The policy has a window (False: ``per_session`` is the ``max_model_len`` row)."""


def _check_branches(branches: object) -> int:
    if type(branches) is not int or branches <= 0:
        raise ValidationError(f"branches must be a positive int; got {branches!r}")
    return branches


def per_branch_bound(cache: SessionCache) -> int:
    """Blocks one branch of a session of ``cache``'s policy may come to hold."""
    if cache.policy.window_chunks is None:
        return cdiv(cache.allocator.max_model_len, cache.allocator.block_size)
    return cache.kv_blocks_bound()


def admission(cache: SessionCache, branches: int = 1) -> Admission:
    """How many more sessions of ``branches`` rows fit ``cache``'s pool now and at most."""
    branches = _check_branches(branches)
    alloc = cache.allocator
    per = per_branch_bound(cache) * branches
    rows = alloc.worker_rows // branches
    headroom = 0
    for sid in cache.sessions:
        s = cache.session(sid)
        if s.offloaded is None:
            headroom += max(0, per_branch_bound(cache) * s.branches - len(alloc.blocks_of(sid)))
    free = alloc.pool.num_free
    free_rows = alloc.free_rows // branches
    return Admission(
        branches=branches,
        per_session=per,
        now=max(0, min((free - headroom) // per, free_rows)),
        at_most=min(alloc.pool.num_total // per, rows),
        free_blocks=free,
        headroom=headroom,
        bounded=cache.policy.window_chunks is not None,
    )


def check_fits(cache: SessionCache, session_id: str, branches: int) -> None:
    """:class:`AdmissionError` naming the numbers when a session of ``branches`` rows could
    never run on ``cache`` (module docstring; what ``begin_session`` checks); nothing else."""
    cache._check_fits(session_id, _check_branches(branches))


__all__ = ["Admission", "admission", "check_fits", "per_branch_bound"]
