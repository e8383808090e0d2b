"""Cross-request prefix caching: content-addressed, refcounted prefix blocks.

A *cacheable unit* is one full block of a row's prefix. Three pieces decide which blocks may be
shared and under what identity; the scheduler side (:class:`PrefixCache`, used by
:class:`~diffusion_kv.core.allocator.DiffusionKVAllocator`) decides for how long.

**Identity.** Block ``i``'s key chains block ``i - 1``'s key with block ``i``'s content key;
block 0 chains the :class:`PrefixNamespace`. The host describes a row's content as
:class:`ContentSpan` s (token ids, or a digest of the conditioning latents of an image span);
the namespace folds in everything else that changes the stored K/V (model/weights identity,
adapter tag, KV layout, rank geometry, CFG branch), so two rows share a block only when every
token up to and including it was the same under the same weights, layout and geometry. The
mask is part of the identity too: a block's key folds in the ``full_attn_spans`` that touch the
run of blocks it lies in (below), since from the second layer on a token's K/V depend on the keys
its queries reached. A row without content spans has no keys: it is never cached and never hits.

**The boundary rule** (:func:`cacheable_cut`). A block before cut ``m`` may be reused only if no
query at a position ``< m`` attends to a key ``>= m``; otherwise its K/V depends on tokens after
the cut. Under the diffusion mask (causal, plus bidirectional ``full_attn_spans``) a query
``q < m`` reaches a key ``k >= m`` exactly when one span holds both, that is when a span
crosses ``m``. The cut is the largest block-aligned position, at most the covered prefix, that
no span crosses; a crossing span pulls the cut back to the block holding its start. The same
holds for every place a hit may stop: a block boundary a span crosses inside the cut is no place
to stop (the K/V before it depend on tokens after it), so :func:`block_keys` keys the blocks
between two uncrossed boundaries as one unit -- each of their keys folds in the content and spans
of the whole run -- and a lookup matches either all of such a run or only blocks computed from
the very same run.

**Ownership and eviction** (:class:`PrefixCache`). A published block has a reference count:
every live request that hit it or published it holds one. A block whose count reaches zero
stays cached, least recently used first out, and goes back to the pool only when an allocation
needs it (or the configured cap on cached blocks is reached). Lookups walk a row's keys from
the first and stop at the first miss, so a hit is always a leading run of blocks.

Nothing here imports a vendor package; keys are 16-byte BLAKE2b digests.
"""

from __future__ import annotations

import hashlib
from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from diffusion_kv.core.errors import ValidationError

KEY_BYTES = 16
Span = tuple[int, int]


def _digest(*parts: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=KEY_BYTES)
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.digest()


def _key_bytes(key: object, what: str) -> bytes:
    if isinstance(key, str) and key:
        return b"s:" + key.encode()
    if isinstance(key, bytes) and key:
        return b"b:" + key
    raise ValidationError(f"{what} must be a non-empty str or bytes; got {key!r}")


@dataclass(frozen=True)
class ContentSpan:
    """Tokens ``[start, end)`` of a row whose content the host names by ``key`` (a digest of
    the token ids, of an image's latents, ...). Two spans with equal keys must produce equal
    K/V at equal positions under one namespace."""

    start: int
    end: int
    key: bytes | str

    def __post_init__(self) -> None:
        if type(self.start) is not int or type(self.end) is not int or not 0 <= self.start < self.end:
            raise ValidationError(
                f"a content span needs integer bounds 0 <= start < end; got [{self.start!r}, {self.end!r})"
            )
        _key_bytes(self.key, f"content span [{self.start}, {self.end}) key")


def check_content(content: object, what: str = "content") -> tuple[ContentSpan, ...]:
    """``content`` as a tuple of sorted, non-overlapping :class:`ContentSpan` s."""
    if isinstance(content, (str, bytes)) or not isinstance(content, Iterable):
        raise ValidationError(f"{what} must be a sequence of ContentSpan; got {content!r}")
    spans = tuple(content)
    prev = 0
    for span in spans:
        if not isinstance(span, ContentSpan):
            raise ValidationError(f"{what} must hold ContentSpan; got {span!r}")
        if span.start < prev:
            raise ValidationError(f"{what} spans must be sorted and disjoint; got {list(spans)}")
        prev = span.end
    return spans


def covered_prefix(content: Sequence[ContentSpan]) -> int:
    """How many leading tokens ``content`` names without a gap."""
    end = 0
    for span in content:
        if span.start != end:
            break
        end = span.end
    return end


@dataclass(frozen=True)
class PrefixNamespace:
    """Everything besides the tokens that changes the stored K/V; rows under different
    namespaces never share a block.

    ``model`` names the weights (model id and revision, say); ``adapter`` a LoRA or other
    adapter (None: none); ``kv_layout`` the cache dtype, block size and head geometry;
    ``ranks`` the parallel geometry (Ulysses degree and rank, DCP degree and rank, ...);
    ``branch`` the CFG branch (cond and uncond never alias)."""

    model: str
    kv_layout: str
    ranks: str = ""
    adapter: str | None = None
    branch: int = 0

    def __post_init__(self) -> None:
        if type(self.model) is not str or not self.model:
            raise ValidationError(f"a prefix namespace needs a non-empty model identity; got {self.model!r}")
        if type(self.kv_layout) is not str or not self.kv_layout:
            raise ValidationError(f"a prefix namespace needs the KV layout; got {self.kv_layout!r}")
        if type(self.ranks) is not str:
            raise ValidationError(f"ranks must be a string; got {self.ranks!r}")
        if self.adapter is not None and (type(self.adapter) is not str or not self.adapter):
            raise ValidationError(f"adapter must be None or a non-empty string; got {self.adapter!r}")
        if type(self.branch) is not int or self.branch < 0:
            raise ValidationError(f"branch must be an int >= 0; got {self.branch!r}")

    def digest(self) -> bytes:
        return _digest(
            b"diffusion-kv prefix namespace v1",
            self.model.encode(),
            self.kv_layout.encode(),
            self.ranks.encode(),
            b"" if self.adapter is None else b"a:" + self.adapter.encode(),
            str(self.branch).encode(),
        )


def crosses(spans: Iterable[Span], m: int) -> list[Span]:
    """The spans that hold tokens on both sides of position ``m``."""
    return [(a, b) for a, b in spans if a < m < b]


def cacheable_cut(limit: int, full_attn_spans: Iterable[Span], block_size: int) -> int:
    """The largest multiple of ``block_size`` that is ``<= limit`` and crossed by no span
    (module docstring); 0 when none is."""
    if type(limit) is not int or limit < 0:
        raise ValidationError(f"limit must be an int >= 0; got {limit!r}")
    if type(block_size) is not int or block_size <= 0:
        raise ValidationError(f"block_size must be a positive int; got {block_size!r}")
    spans = [(int(a), int(b)) for a, b in full_attn_spans]
    m = limit - limit % block_size
    while m > 0:
        crossing = crosses(spans, m)
        if not crossing:
            break
        start = min(a for a, _ in crossing)
        m = start - start % block_size
    return m


def block_keys(
    content: Sequence[ContentSpan],
    namespace: PrefixNamespace,
    cut: int,
    block_size: int,
    full_attn_spans: Iterable[Span] = (),
) -> tuple[bytes, ...]:
    """The chained key of each full block before ``cut`` (every token of which ``content``
    must name, and which no span of ``full_attn_spans`` may cross).

    The blocks between two consecutive block boundaries that no span crosses form one run; each
    key of a run chains the previous key with its block's content and a digest of the run's
    content and of the spans inside it, so equal keys mean equal tokens and an equal mask over
    every token the block's K/V can depend on (module docstring)."""
    if type(cut) is not int or cut < 0 or cut % block_size:
        raise ValidationError(f"cut must be a multiple of the block size {block_size}; got {cut!r}")
    if cut > covered_prefix(content):
        raise ValidationError(
            f"cut {cut} lies past the {covered_prefix(content)} leading tokens the content spans name"
        )
    spans = sorted((int(a), int(b)) for a, b in full_attn_spans)
    crossing = crosses(spans, cut)
    if crossing:
        raise ValidationError(
            f"cut {cut} is crossed by full_attn_spans {crossing}: the K/V before it depend on tokens after it"
        )
    named = list(content)
    first = 0
    parts: list[list[bytes]] = []  # per block: its content parts
    for i in range(cut // block_size):
        lo, hi = i * block_size, (i + 1) * block_size
        block: list[bytes] = []
        while first < len(named) and named[first].end <= lo:
            first += 1
        j = first
        while j < len(named) and named[j].start < hi:
            s = named[j]
            a, b = max(s.start, lo), min(s.end, hi)
            block.append(_key_bytes(s.key, "content key"))
            block.append(f"{a - lo},{b - lo},{a - s.start}".encode())
            j += 1
        parts.append(block)
    keys: list[bytes] = []
    previous = namespace.digest()
    start = 0  # first block of the current run
    for end in range(1, len(parts) + 1):
        if end < len(parts) and crosses(spans, end * block_size):
            continue  # a span crosses this boundary: the run goes on
        lo, hi = start * block_size, end * block_size
        run = _digest(
            b"run",
            *(_digest(*block) for block in parts[start:end]),
            *(f"span {a},{b}".encode() for a, b in spans if a < hi and b > lo),
        )
        for i in range(start, end):
            previous = _digest(previous, *parts[i], run)
            keys.append(previous)
        start = end
    return tuple(keys)


@dataclass
class _Entry:
    block: int
    refs: int


class PrefixCache:
    """Published prefix blocks: key -> block id, with reference counts and an LRU of the
    blocks no live request holds. ``max_blocks`` caps the blocks kept published (None: the
    pool is the only limit).

    The cache never allocates; the allocator takes blocks back from it (:meth:`evict`) when the
    pool runs short and returns evicted ids to its pool.
    """

    def __init__(self, max_blocks: int | None = None) -> None:
        if max_blocks is not None and (type(max_blocks) is not int or max_blocks < 0):
            raise ValidationError(f"max_blocks must be None or an int >= 0; got {max_blocks!r}")
        self.max_blocks = max_blocks
        self._entries: dict[bytes, _Entry] = {}
        self._by_block: dict[int, bytes] = {}
        self._idle: OrderedDict[bytes, None] = OrderedDict()  # refs == 0, least recently used first
        self.hits = 0
        """Blocks found by lookups that admitted a request."""
        self.published = 0
        self.evictions = 0

    # -- views --------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    @property
    def num_idle(self) -> int:
        """Cached blocks no live request holds (evictable)."""
        return len(self._idle)

    def block_of(self, key: bytes) -> int | None:
        entry = self._entries.get(key)
        return entry.block if entry is not None else None

    def key_of(self, block: int) -> bytes | None:
        return self._by_block.get(block)

    def refs(self, key: bytes) -> int:
        entry = self._entries.get(key)
        return entry.refs if entry is not None else 0

    def blocks(self) -> dict[int, int]:
        """Every cached block id with its reference count."""
        return {e.block: e.refs for e in self._entries.values()}

    def stats(self) -> dict[str, int]:
        return {
            "cached_blocks": len(self._entries),
            "idle_blocks": len(self._idle),
            "hit_blocks": self.hits,
            "published_blocks": self.published,
            "evictions": self.evictions,
        }

    # -- operations (the allocator's) ---------------------------------------------------------

    def lookup(self, keys: Sequence[bytes]) -> list[int]:
        """The blocks of the longest leading run of ``keys`` that is cached (takes nothing)."""
        out: list[int] = []
        for key in keys:
            entry = self._entries.get(key)
            if entry is None:
                break
            out.append(entry.block)
        return out

    def acquire(self, keys: Sequence[bytes]) -> None:
        """Add a reference to each of ``keys`` (all cached; checked first)."""
        missing = [k.hex() for k in keys if k not in self._entries]
        if missing:
            raise ValidationError(f"acquire of uncached prefix keys {missing}")
        for key in keys:
            entry = self._entries[key]
            entry.refs += 1
            self._idle.pop(key, None)

    def release(self, keys: Sequence[bytes]) -> None:
        """Drop a reference to each of ``keys``; a block left unreferenced becomes idle (the
        last key of a chain first, so eviction takes chains from their tails)."""
        bad = [k.hex() for k, n in Counter(keys).items() if self.refs(k) < n]
        if bad:
            raise ValidationError(f"release of prefix keys not held: {bad}")
        for key in reversed(keys):
            entry = self._entries[key]
            entry.refs -= 1
            if entry.refs == 0:
                self._idle[key] = None

    def touch(self, keys: Sequence[bytes]) -> None:
        """Mark idle ``keys`` as just used (moves them to the back of the eviction order)."""
        for key in reversed(keys):
            if key in self._idle:
                self._idle.move_to_end(key)

    def room(self) -> int:
        """How many more blocks may be published before the cap (evicting idle ones)."""
        if self.max_blocks is None:
            return 1 << 62
        return self.max_blocks - len(self._entries) + len(self._idle)

    def publish(self, key: bytes, block: int) -> bool:
        """Cache ``block`` under ``key`` with one reference (the publisher's). False when the key
        is cached already (the block stays the publisher's own) or the cap leaves no room."""
        if key in self._entries:
            return False
        if block in self._by_block:
            raise ValidationError(f"block {block} is already cached under another key")
        if self.max_blocks is not None and len(self._entries) >= self.max_blocks:
            return False
        self._entries[key] = _Entry(block, 1)
        self._by_block[block] = key
        self.published += 1
        return True

    def evict(self, n: int, keep: Iterable[bytes] = ()) -> list[int]:
        """Remove up to ``n`` idle blocks, least recently used first (never one of ``keep``);
        returns their ids (for the pool)."""
        kept = set(keep)
        out: list[int] = []
        for key in list(self._idle):
            if len(out) >= n:
                break
            if key in kept:
                continue
            del self._idle[key]
            entry = self._entries.pop(key)
            del self._by_block[entry.block]
            out.append(entry.block)
        self.evictions += len(out)
        return out

    def evictable(self, keep: Iterable[bytes] = ()) -> int:
        kept = set(keep)
        return sum(1 for key in self._idle if key not in kept)


__all__ = [
    "ContentSpan",
    "PrefixCache",
    "PrefixNamespace",
    "block_keys",
    "cacheable_cut",
    "check_content",
    "covered_prefix",
    "crosses",
]
