"""Allocation snapshots: the scheduler -> worker record of one public request.

A snapshot carries both logical lengths and physical block ids so the worker can cross-check
them, and nothing else: no tensors, no device pointers. Snapshots are immutable, compare by
value, pickle, and round-trip through a plain ``dict`` (JSON-compatible) form.

Construction only normalises structure (lists become tuples); the semantic checks (types of
ids, exact block counts, ranges, limits) are the registry's, at install time, so a bad snapshot
is rejected by the worker with a message that names the identity.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from diffusion_kv.core.errors import ValidationError

BlockIds = tuple[tuple[int, ...], ...]
"""Block ids per KV-cache group: ``block_ids[g]`` lists the blocks of group ``g`` in order."""

NULL_BLOCK = -1
"""A place in a row's block list whose keys were released (retention: a sliding window moved
past them). Positions stay absolute: the row keeps its length, and the released place holds no
block. The worker's tables read it as the null entry (block 0, as past a row's end); no query
reads it (the block plan skips it, and page provenance refuses a row that would) and no write
lands there."""


def _block_ids(value: object, owner: str) -> BlockIds:
    if type(value) is tuple and all(type(group) is tuple for group in value):
        return value  # already normalised (the common case: snapshots built from snapshots)
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise ValidationError(
            f"{owner} block_ids must be a sequence of per-group block id lists; got {value!r}"
        )
    groups = []
    for index, group in enumerate(value):
        if isinstance(group, (str, bytes)) or not isinstance(group, Iterable):
            raise ValidationError(
                f"{owner} block_ids group {index} must be a sequence of ints; got {group!r}"
            )
        groups.append(tuple(group))
    return tuple(groups)


@dataclass(frozen=True)
class ContextAllocation:
    """A request-scoped context (e.g. a shared reference image) with its own worker row."""

    context_id: str
    cache_role: str
    num_tokens: int
    block_ids: BlockIds

    def __post_init__(self) -> None:
        object.__setattr__(self, "block_ids", _block_ids(self.block_ids, f"context {self.context_id!r}"))

    def to_dict(self) -> dict[str, Any]:
        return {
            "context_id": self.context_id,
            "cache_role": self.cache_role,
            "num_tokens": self.num_tokens,
            "block_ids": [list(g) for g in self.block_ids],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ContextAllocation:
        return cls(**_fields(data, ("context_id", "cache_role", "num_tokens", "block_ids"), "context"))


@dataclass(frozen=True)
class SequenceAllocation:
    """One sequence (e.g. one CFG branch): ``[prefix | target]`` tokens in one worker row.

    ``cached_prefix_len`` is the block-aligned part of the prefix already resident (a prefix
    cache hit); step 0 then writes only from there.
    """

    sequence_id: int
    prefix_len: int
    target_len: int
    seq_len: int
    block_ids: BlockIds
    context_ids: tuple[str, ...] = ()
    cached_prefix_len: int = 0

    def __post_init__(self) -> None:
        block_ids = self.block_ids
        if type(block_ids) is not tuple or not all(type(group) is tuple for group in block_ids):
            object.__setattr__(self, "block_ids", _block_ids(block_ids, f"sequence {self.sequence_id!r}"))
        if type(self.context_ids) is tuple:
            return  # already normalised (the common case)
        if isinstance(self.context_ids, str) or not isinstance(self.context_ids, Iterable):
            raise ValidationError(
                f"sequence {self.sequence_id!r} context_ids must be a sequence of strings; got {self.context_ids!r}"
            )
        object.__setattr__(self, "context_ids", tuple(self.context_ids))

    @classmethod
    def normalised(
        cls,
        sequence_id: int,
        prefix_len: int,
        target_len: int,
        seq_len: int,
        block_ids: BlockIds,
        context_ids: tuple[str, ...],
        cached_prefix_len: int,
    ) -> SequenceAllocation:
        """The record of fields already in normal form (``block_ids`` a tuple of tuples,
        ``context_ids`` a tuple), without re-normalising them: what a converter that built
        them calls per request. Equal to the constructor's record of the same fields."""
        self = object.__new__(cls)
        self.__dict__.update(
            {
                "sequence_id": sequence_id,
                "prefix_len": prefix_len,
                "target_len": target_len,
                "seq_len": seq_len,
                "block_ids": block_ids,
                "context_ids": context_ids,
                "cached_prefix_len": cached_prefix_len,
            }
        )
        return self

    def to_dict(self) -> dict[str, Any]:
        return {
            "sequence_id": self.sequence_id,
            "prefix_len": self.prefix_len,
            "target_len": self.target_len,
            "seq_len": self.seq_len,
            "block_ids": [list(g) for g in self.block_ids],
            "context_ids": list(self.context_ids),
            "cached_prefix_len": self.cached_prefix_len,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SequenceAllocation:
        names = ("sequence_id", "prefix_len", "target_len", "seq_len", "block_ids")
        kwargs = _fields(data, names, "sequence", optional=("context_ids", "cached_prefix_len"))
        return cls(**kwargs)


@dataclass(frozen=True)
class RequestAllocation:
    """Everything the scheduler allocated for one public request, at one generation."""

    request_id: str
    allocation_generation: int
    sequences: tuple[SequenceAllocation, ...]
    contexts: tuple[ContextAllocation, ...] = field(default=())

    def __post_init__(self) -> None:
        if (
            type(self.sequences) is tuple
            and type(self.contexts) is tuple
            and all(type(item) is SequenceAllocation for item in self.sequences)
            and all(type(item) is ContextAllocation for item in self.contexts)
        ):
            return  # already normalised (the common case)
        for name, kind in (("sequences", SequenceAllocation), ("contexts", ContextAllocation)):
            value = getattr(self, name)
            if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
                raise ValidationError(f"request {self.request_id!r} {name} must be a sequence; got {value!r}")
            items = tuple(value)
            bad = [item for item in items if not isinstance(item, kind)]
            if bad:
                raise ValidationError(
                    f"request {self.request_id!r} {name} must hold {kind.__name__}; got {bad[0]!r}"
                )
            object.__setattr__(self, name, items)

    @classmethod
    def normalised(
        cls,
        request_id: str,
        allocation_generation: int,
        sequences: tuple[SequenceAllocation, ...],
        contexts: tuple[ContextAllocation, ...] = (),
    ) -> RequestAllocation:
        """The record of fields already in normal form (``sequences`` a tuple of
        :class:`SequenceAllocation`, ``contexts`` one of :class:`ContextAllocation`), without
        checking them again: what a converter that built them calls per request. Equal to the
        constructor's record of the same fields."""
        self = object.__new__(cls)
        self.__dict__.update(
            {
                "request_id": request_id,
                "allocation_generation": allocation_generation,
                "sequences": sequences,
                "contexts": contexts,
            }
        )
        return self

    def content_key(self) -> tuple[Any, ...]:
        """What must not change between generations of one installed request."""
        return (self.request_id, self.sequences, self.contexts)

    @property
    def num_rows(self) -> int:
        return len(self.sequences) + len(self.contexts)

    def to_dict(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "allocation_generation": self.allocation_generation,
            "sequences": [s.to_dict() for s in self.sequences],
            "contexts": [c.to_dict() for c in self.contexts],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RequestAllocation:
        kwargs = _fields(
            data, ("request_id", "allocation_generation", "sequences"), "request", optional=("contexts",)
        )
        try:
            kwargs["sequences"] = tuple(SequenceAllocation.from_dict(s) for s in kwargs["sequences"])
            kwargs["contexts"] = tuple(ContextAllocation.from_dict(c) for c in kwargs.get("contexts", ()))
        except TypeError as exc:
            raise ValidationError(f"request snapshot has malformed sequences/contexts: {exc}") from exc
        return cls(**kwargs)


def _fields(
    data: Mapping[str, Any], required: Sequence[str], what: str, optional: Sequence[str] = ()
) -> dict[str, Any]:
    if not isinstance(data, Mapping):
        raise ValidationError(f"{what} snapshot must be a mapping; got {type(data).__name__}")
    missing = [k for k in required if k not in data]
    if missing:
        raise ValidationError(f"{what} snapshot lacks field(s) {missing}")
    unknown = sorted(set(data) - set(required) - set(optional))
    if unknown:
        raise ValidationError(f"{what} snapshot has unknown field(s) {unknown}")
    return {k: data[k] for k in (*required, *optional) if k in data}
