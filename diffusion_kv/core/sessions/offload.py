"""Offload: an idle session's committed K/V moved to host memory, its blocks back in the pool.

:func:`offload` takes a session with no open chunk, copies the bytes of every live block of
every branch and layer (K and V, the pages' own dtype viewed as bytes, so fp8 pages come back
bit for bit) to host memory, notes each row's length, which block places were released
(``NULL_BLOCK`` holes: a window slid past them) and which tokens were readable, retires the
worker rows and frees the blocks. While offloaded every call on the session other than
:func:`reload` and ``end_session`` is a :class:`StateError` naming it (``end_session`` drops
the host copy).

:func:`reload` reserves blocks for the live places only
(:meth:`~diffusion_kv.core.allocator.DiffusionKVAllocator.restore`: the holes stay holes, so a
long stream whose window slid needs only sink + window blocks), installs the rows (a fresh
INSTALL: the worker refused every snapshot of the session before, by its tombstone), copies the
bytes back into the new blocks and declares the same tokens readable as before. Positions stay
absolute; the session goes on exactly where it was. The fp8 ``k_scale``/``v_scale`` of every
layer are recorded at offload and must be unchanged at reload (pages written under other scales
decode to other values): a change is a :class:`StateError` and the session stays offloaded.
Blocks the session shared through the prefix cache come back as its own copies (it drops its
references when it goes).

:func:`offload_lru` is the policy hook for a short pool: set
``cache.on_pool_short = lru_offloader(cache)`` and ``append_chunk`` offloads the least recently
used idle sessions (other than the one asking) until the chunk fits, then tries again.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from diffusion_kv.core.allocation import NULL_BLOCK
from diffusion_kv.core.allocator import KVRequest, SequenceRequest
from diffusion_kv.core.batch import key_value_caches
from diffusion_kv.core.errors import StateError
from diffusion_kv.core.layout import cdiv
from diffusion_kv.core.registry import TokenSpans, WrittenSpan
from diffusion_kv.core.sessions.cache import Session, SessionCache

Scales = tuple[tuple[float, ...], tuple[float, ...]] | None


@dataclass(frozen=True)
class OffloadedKV:
    """A session's committed K/V in host memory (what :func:`offload` keeps)."""

    seq_lens: tuple[int, ...]
    """Per branch: the row's length (absolute positions)."""
    released: tuple[int, ...]
    """Block places a window released (``NULL_BLOCK``), the same in every branch."""
    written: tuple[TokenSpans, ...]
    """Per branch: the tokens readable when it went."""
    pages: dict[str, tuple[torch.Tensor, torch.Tensor]]
    """Per layer: the K and V bytes of the live blocks (branch by branch, place by place)."""
    scales: dict[str, Scales]
    """Per layer: its fp8 ``(k_scale, v_scale)`` values (None: unquantised pages)."""
    live_blocks: int
    """Blocks the session held (and takes again at reload)."""

    @property
    def nbytes(self) -> int:
        return sum(k.numel() + v.numel() for k, v in self.pages.values())


def _kernel_ids(cache: SessionCache, blocks: list[int]) -> torch.Tensor:
    """The kernel block ids backing scheduler ``blocks`` (a block of ``r`` kernel blocks is
    stored at ``b * r .. b * r + r - 1``)."""
    assert cache.worker.block_tables is not None
    r = cache.worker.block_tables.blocks_per_kv_block[0]
    ids = [b * r + k for b in blocks for k in range(r)]
    return torch.tensor(ids, dtype=torch.long, device=cache.worker.device)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype != torch.uint8 else t


def _scales(cache: SessionCache) -> dict[str, Scales]:
    return {
        name: (g.kv_scales.values if g.kv_scales is not None else None)
        for name, g in cache.worker.layers.items()
    }


def offload(cache: SessionCache, session: Session) -> int:
    """Move ``session``'s committed K/V to host memory and free its blocks (module docstring);
    returns the blocks returned to the pool. A session with an open chunk, one already
    offloaded, or one holding nothing is a :class:`StateError` (nothing changes)."""
    cache._own(session)  # StateError when offloaded already
    sid = session.session_id
    if session.open_chunk is not None:
        raise StateError(
            f"session {sid!r} has chunk {session.open_chunk.index} open: commit or abort it before offloading"
        )
    if session.recache is not None:
        raise StateError(f"session {sid!r} has a re-cache open: commit or abort it before offloading")
    registry = cache.worker.registry
    snapshot = registry.snapshot_of(sid) if registry is not None else None
    if not session.reserved or snapshot is None:
        raise StateError(f"session {sid!r} holds no committed K/V to offload")
    rows = [s.block_ids[0] for s in snapshot.sequences]
    released = tuple(p for p, b in enumerate(rows[0]) if b == NULL_BLOCK)
    if any(tuple(p for p, b in enumerate(r) if b == NULL_BLOCK) != released for r in rows):
        raise StateError(f"session {sid!r}: its branches released different block places")
    live = [b for r in rows for b in r if b != NULL_BLOCK]
    kernel = _kernel_ids(cache, live)
    pages: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for name, kv in cache.worker.kv_caches.items():
        k, v = key_value_caches(kv)
        pages[name] = (
            _bytes(k).index_select(0, kernel).to("cpu", copy=True),
            _bytes(v).index_select(0, kernel).to("cpu", copy=True),
        )
    written = tuple(cache.worker.resolve(sid, s.sequence_id).written for s in snapshot.sequences)
    kept = OffloadedKV(
        seq_lens=tuple(s.seq_len for s in snapshot.sequences),
        released=released,
        written=written,
        pages=pages,
        scales=_scales(cache),
        live_blocks=len(live),
    )
    cache.worker.retire(sid, cache.allocator.generation)
    freed = cache.allocator.free(sid)
    session.reserved = False
    session.offloaded = kept
    return freed


def reload(cache: SessionCache, session: Session) -> bool:
    """Bring an offloaded ``session`` back bit-exact (module docstring); False when the pool or
    the worker rows are short (nothing changes, it stays offloaded)."""
    cache._own(session, offloaded_ok=True)
    kept = session.offloaded
    sid = session.session_id
    if not isinstance(kept, OffloadedKV):
        raise StateError(f"session {sid!r} is not offloaded")
    now = _scales(cache)
    changed = sorted(n for n, s in kept.scales.items() if now.get(n) != s)
    if changed:
        raise StateError(
            f"session {sid!r} cannot reload: the fp8 k_scale/v_scale of layers {changed} changed since it was "
            "offloaded (its pages would decode to other values); it stays offloaded"
        )
    request = KVRequest(sid, tuple(SequenceRequest(b, 0, n) for b, n in enumerate(kept.seq_lens)))
    snapshot = cache.allocator.restore(request, kept.released)
    if snapshot is None:
        return False
    try:
        cache.worker.install(snapshot)
    except BaseException:
        cache.allocator.free(sid)
        raise
    live = [b for s in snapshot.sequences for b in s.block_ids[0] if b != NULL_BLOCK]
    kernel = _kernel_ids(cache, live)
    for name, kv in cache.worker.kv_caches.items():
        k, v = key_value_caches(kv)
        saved_k, saved_v = kept.pages[name]
        _bytes(k).index_copy_(0, kernel, saved_k.to(k.device))
        _bytes(v).index_copy_(0, kernel, saved_v.to(v.device))
    registry = cache.worker.registry
    assert registry is not None
    spans: list[WrittenSpan] = []
    for s, written in zip(snapshot.sequences, kept.written, strict=True):
        binding = cache.worker.resolve(sid, s.sequence_id)
        spans.extend(((sid, s.sequence_id, None), binding.install_serial, a, b) for a, b in written)
    registry.record_writes(spans)
    session.reserved = True
    session.offloaded = None
    session.last_used = cache._tick()
    return True


def _need(cache: SessionCache, session: Session) -> int:
    """Blocks ``session``'s next chunk takes from the pool."""
    block, tokens = cache.allocator.block_size, cache.policy.chunk_tokens
    if not session.reserved:
        return cdiv(tokens, block) * session.branches
    n = session.committed_tokens
    return (cdiv(n + tokens, block) - cdiv(n, block)) * session.branches


def offload_lru(cache: SessionCache, asking: Session) -> bool:
    """Offload idle sessions (no open chunk, holding blocks, not ``asking``), least recently
    used first, until the pool has what ``asking``'s next chunk needs or none is left; True
    when any was offloaded."""
    need = _need(cache, asking)
    idle = sorted(
        (
            s
            for s in map(cache.session, cache.sessions)
            if s is not asking
            and s.open_chunk is None
            and s.recache is None
            and s.reserved
            and s.offloaded is None
        ),
        key=lambda s: s.last_used,
    )
    done = False
    for s in idle:
        if cache.allocator.pool.num_free >= need:
            break
        offload(cache, s)
        done = True
    return done


def lru_offloader(cache: SessionCache) -> Callable[[Session], bool]:
    """The hook for ``cache.on_pool_short``: :func:`offload_lru` on ``cache``."""
    return lambda asking: offload_lru(cache, asking)


__all__ = ["OffloadedKV", "lru_offloader", "offload", "offload_lru", "reload"]
