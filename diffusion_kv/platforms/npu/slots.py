"""Padding slots never reach an Ascend K/V writer.

The backend contract says ``-1`` slots are padding and must not be written. Neither Ascend
writer promises to skip them: ``npu_scatter_pa_kv_cache`` documents slots in
``[0, blocks * block_size - 1]`` only, and the ATB ``_npu_reshape_and_cache`` has no released
documentation at all. So both npu backends drop the padding themselves, through
:class:`PaddingFilter`, before calling the writer.

Finding the padding needs the slot values on the host: one device synchronisation per slot
tensor. The core hands every layer of a batch views of the same slot tensor, so the filter
keeps its plan for the last tensor it saw and every later layer of the batch reuses it without
synchronising. A plan is valid until the backend's next ``build`` (:meth:`PaddingFilter.reset`:
a host's BlockTables may rewrite one persistent slot buffer in place for the next batch) and
only for the same tensor (storage, offset, shape, stride, and the version counter where torch
keeps one; the tensor is held so its memory cannot be reused meanwhile).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_Identity = tuple[int, int, tuple[int, ...], tuple[int, ...], int | None]


def _version(slots: torch.Tensor) -> int | None:
    try:
        return int(slots._version)
    except RuntimeError:  # an inference-mode tensor keeps no version counter
        return None


def _identity(slots: torch.Tensor) -> _Identity:
    return (
        slots.untyped_storage().data_ptr(),
        int(slots.storage_offset()),
        tuple(slots.shape),
        tuple(slots.stride()),
        _version(slots),
    )


@dataclass(frozen=True)
class _Plan:
    slots: torch.Tensor
    """The slot tensor this plan was made for (held so its memory is not reused)."""
    identity: _Identity
    keep: torch.Tensor | None
    """Indices of the non-negative slots; None when every slot is real."""
    count: int


@dataclass(frozen=True)
class KeptTokens:
    """What a writer may be given: the tokens whose slot is not padding."""

    key: torch.Tensor
    value: torch.Tensor
    slots: torch.Tensor

    @property
    def empty(self) -> bool:
        return self.slots.shape[0] == 0


class PaddingFilter:
    """Drops the tokens of ``-1`` (padding) slots; one host sync per slot tensor."""

    def __init__(self) -> None:
        self._plan: _Plan | None = None
        self.syncs = 0
        """Slot tensors inspected on the host so far (tests read it)."""

    def reset(self) -> None:
        """Forget the plan (a new batch was built: its slots may reuse the old buffer)."""
        self._plan = None

    def _plan_for(self, slots: torch.Tensor) -> _Plan:
        identity = _identity(slots)
        plan = self._plan
        if plan is not None and plan.identity == identity:
            return plan
        self.syncs += 1
        keep = torch.nonzero(slots >= 0).flatten()  # the one device -> host synchronisation
        count = int(keep.shape[0])
        plan = _Plan(slots, identity, None if count == slots.shape[0] else keep, count)
        self._plan = plan
        return plan

    def keep(self, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> KeptTokens:
        """``key``/``value``/``slots`` restricted to the tokens with a real (``>= 0``) slot."""
        plan = self._plan_for(slots)
        if plan.keep is None:
            return KeptTokens(key, value, slots)
        return KeptTokens(
            key.index_select(0, plan.keep), value.index_select(0, plan.keep), slots.index_select(0, plan.keep)
        )
