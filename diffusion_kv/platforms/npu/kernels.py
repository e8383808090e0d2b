"""The kernel seam: the only place the NPU plugin touches ``torch_npu``.

:class:`AscendKernels` wraps whatever module ``import torch_npu`` returns (the real extension on
Ascend hardware, or the pure-torch emulator from :mod:`diffusion_kv.testing` in tests) and
offers the plugin exactly two operations:

* :meth:`AscendKernels.write_kv` - one paged K/V write. It uses
  ``npu_scatter_pa_kv_cache(..., cache_mode="Norm")`` when the installed torch_npu's schema has
  ``cache_mode``; otherwise the older ATB ``_npu_reshape_and_cache(..., slot_indices=...)``.
  The scatter op's default ``cache_mode`` is ``"PA_NZ"``, so the argument is always passed.
  Callers drop ``-1`` slots first (:mod:`.slots`): neither writer promises to skip them.

In a real torch_npu ``torch_npu._npu_reshape_and_cache`` always exists: it is a lazy wrapper
(``torch_npu/op_plugin/atb/_atb_ops.py``) whose library, ``libop_plugin_atb.so``, needs NNAL's
``libatb.so``; when that failed to load, the first call raises ``OSError``. So the ATB writer
counts as usable only when its operator is registered (``torch.ops.atb``), and an ``OSError``
from it is turned into an error that names NNAL.
* :meth:`AscendKernels.paged_attention` - one ``npu_fused_infer_attention_score`` call with a
  TND query, the K/V caches viewed as ``(blocks, block_size, kv_heads * head_size)``, an int32
  block table, cumulative query ends and per-row KV lengths. Causal calls use
  ``sparse_mode=3`` with the compressed 2048x2048 mask; full calls use ``sparse_mode=0`` and no
  mask (any mask with mode 0 would be applied literally).

``torch_npu`` is imported lazily, inside :meth:`AscendKernels.load` and
:func:`torch_npu_availability`, never at module import.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch

from diffusion_kv.core.capabilities import Availability
from diffusion_kv.core.errors import PlatformUnavailableError
from diffusion_kv.platforms.npu.constraints import MASK_SIZE

EMULATOR_ATTRIBUTE = "__diffusion_kv_emulator__"
"""A module installed as ``torch_npu`` that sets this attribute to True is the CPU emulator."""

EMULATOR_ATB_ATTRIBUTE = "__diffusion_kv_atb_loaded__"
"""On the emulator only: whether its ATB operator library counts as loaded (it stands in for
the ``torch.ops.atb`` registration a real torch_npu makes when NNAL is installed)."""

EMULATOR_REASON = "torch_npu emulator (CPU)"
"""The availability reason of the npu platform and its direct backend under the emulator."""

SCATTER_OP = "npu_scatter_pa_kv_cache"
RESHAPE_AND_CACHE_OP = "_npu_reshape_and_cache"
FIA_OP = "npu_fused_infer_attention_score"

NNAL_FIX = "source /usr/local/Ascend/nnal/atb/set_env.sh before starting Python"

SPARSE_MODE_FULL = 0
"""FIA ``defaultMask`` without a mask: every key below the row's KV length is visible."""
SPARSE_MODE_CAUSAL = 3
"""FIA ``rightDownCausal``: query ``r`` of a row sees keys ``j <= r + kv_len - q_len``."""


def loaded_emulator() -> Any | None:
    """The emulator module if one is installed as ``torch_npu`` in this process, else None."""
    module = sys.modules.get("torch_npu")
    if module is not None and getattr(module, EMULATOR_ATTRIBUTE, False) is True:
        return module
    return None


def torch_npu_availability() -> Availability:
    """Whether ``torch_npu`` imports here (the installed emulator counts), with the reason.

    This says nothing about devices: the platform's detector checks those.
    """
    if loaded_emulator() is not None:
        return Availability(True, EMULATOR_REASON)
    try:
        missing = importlib.util.find_spec("torch_npu") is None
    except (ImportError, ValueError):  # a module without a spec in sys.modules: try importing it
        missing = False
    if missing:
        return Availability(False, "torch_npu is not installed")
    try:
        module = importlib.import_module("torch_npu")
    except Exception as exc:  # e.g. CANN toolkit missing: the reason says so
        return Availability(False, f"torch_npu failed to import: {type(exc).__name__}: {exc}")
    return Availability(True, f"torch_npu {getattr(module, '__version__', 'unknown')}")


_MASKS: dict[str, torch.Tensor] = {}


def compressed_causal_mask(device: torch.device) -> torch.Tensor:
    """The ``int8`` 2048x2048 template FIA expects with ``sparse_mode=3`` (1 = masked).

    Ones strictly above the diagonal; FIA derives each row's causal band from it, so the same
    tensor serves every batch. One copy per device is kept.
    """
    key = str(torch.device(device))
    mask = _MASKS.get(key)
    if mask is None:
        mask = torch.triu(torch.ones(MASK_SIZE, MASK_SIZE, dtype=torch.int8), diagonal=1).to(device)
        _MASKS[key] = mask
    return mask


def accepts_keyword(op: Any, name: str) -> bool:
    """Whether a torch_npu operator takes keyword ``name``.

    Real torch_npu operators are ``torch.ops`` packets whose ``.default._schema`` lists the
    arguments; plain Python callables are inspected instead.
    """
    schema = getattr(getattr(op, "default", None), "_schema", None)
    arguments = getattr(schema, "arguments", None)
    if arguments is not None:
        return any(getattr(arg, "name", None) == name for arg in arguments)
    try:
        return name in inspect.signature(op).parameters
    except (TypeError, ValueError):
        return False


def _registered(namespace: str, name: str) -> bool:
    try:
        getattr(getattr(torch.ops, namespace), name)
    except (AttributeError, RuntimeError):
        return False
    return True


def _nnal_error(module: Any) -> str | None:
    """The load error torch_npu kept for its ATB library (``NNAL_EX``), when it has one."""
    atb_ops = getattr(getattr(getattr(module, "op_plugin", None), "atb", None), "_atb_ops", None)
    error = getattr(atb_ops, "NNAL_EX", None)
    return f"{type(error).__name__}: {error}" if isinstance(error, BaseException) else None


def atb_writer_problem(module: Any) -> str | None:
    """None when ``module``'s ATB ``_npu_reshape_and_cache`` can run; else why not.

    The attribute itself proves nothing (torch_npu always defines the lazy wrapper); what
    counts is whether the ATB library registered the operator.
    """
    if getattr(module, RESHAPE_AND_CACHE_OP, None) is None:
        return f"{RESHAPE_AND_CACHE_OP} is missing"
    if getattr(module, EMULATOR_ATTRIBUTE, False) is True:
        loaded = getattr(module, EMULATOR_ATB_ATTRIBUTE, False) is True
    else:
        loaded = _registered("atb", RESHAPE_AND_CACHE_OP)
    if loaded:
        return None
    cause = _nnal_error(module)
    return (
        f"{RESHAPE_AND_CACHE_OP} is only torch_npu's lazy wrapper: its ATB library (libop_plugin_atb.so, "
        f"which needs NNAL's libatb.so) did not load{f' ({cause})' if cause else ''}"
    )


class AscendKernels:
    """The torch_npu operators the plugin uses, resolved once per module."""

    def __init__(self, module: Any) -> None:
        self.module = module
        self.emulated = getattr(module, EMULATOR_ATTRIBUTE, False) is True
        version = getattr(module, "__version__", "unknown")
        scatter = getattr(module, SCATTER_OP, None)
        self._write: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]
        if scatter is not None and accepts_keyword(scatter, "cache_mode"):
            self.writer = SCATTER_OP
            self._write = self._scatter
        else:
            problem = atb_writer_problem(module)
            if problem is not None:
                found = "without a cache_mode argument" if scatter is not None else "missing"
                raise NotImplementedError(
                    f"torch_npu {version} offers no usable paged K/V writer: {SCATTER_OP} is {found} and "
                    f"{problem}. Install torch_npu 2.10.0.post4 or newer (its {SCATTER_OP} takes "
                    f"cache_mode='Norm'), or install NNAL for the ATB {RESHAPE_AND_CACHE_OP} ({NNAL_FIX})."
                )
            self.writer = RESHAPE_AND_CACHE_OP
            self._write = self._reshape_and_cache
        fia = getattr(module, FIA_OP, None)
        if fia is None:
            raise NotImplementedError(
                f"torch_npu {version} has no {FIA_OP}; the npu plugin needs fused-infer-attention "
                "(torch_npu 2.10.0.post4 or newer)"
            )
        self._fia: Callable[..., tuple[torch.Tensor, torch.Tensor]] = fia

    @classmethod
    def load(cls) -> AscendKernels:
        """Import ``torch_npu`` (or take the installed emulator) and resolve the operators."""
        module = importlib.import_module("torch_npu")
        return cls(module)

    # -- K/V write --------------------------------------------------------------------------

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Write ``key``/``value`` ``[T, kv_heads, head_size]`` into the ND caches at int32 slots
        (every slot a real one: callers drop padding first, see :mod:`.slots`).

        Both writers reject non-contiguous inputs, so the inputs are made contiguous here.
        """
        self._write(key.contiguous(), value.contiguous(), key_cache, value_cache, slot_mapping.contiguous())

    def _scatter(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slots: torch.Tensor,
    ) -> None:
        getattr(self.module, SCATTER_OP)(
            key=key,
            value=value,
            key_cache=key_cache,
            value_cache=value_cache,
            slot_mapping=slots,
            cache_mode="Norm",
        )

    def _reshape_and_cache(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slots: torch.Tensor,
    ) -> None:
        try:
            getattr(self.module, RESHAPE_AND_CACHE_OP)(
                key=key, value=value, key_cache=key_cache, value_cache=value_cache, slot_indices=slots
            )
        except OSError as exc:  # torch_npu's lazy ATB wrapper: NNAL's libatb.so could not be loaded
            raise PlatformUnavailableError(
                f"npu: the ATB writer {RESHAPE_AND_CACHE_OP} could not load its library "
                f"({type(exc).__name__}: {exc}); {NNAL_FIX}"
            ) from exc

    # -- attention --------------------------------------------------------------------------

    def paged_attention(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        *,
        block_table: torch.Tensor,
        actual_seq_lengths: Sequence[int],
        actual_seq_lengths_kv: Sequence[int],
        num_heads: int,
        num_kv_heads: int,
        scale: float,
        causal: bool,
        causal_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """One FIA call over paged K/V; returns ``[T, num_heads, head_size]``."""
        num_blocks, block_size = key_cache.shape[0], key_cache.shape[1]
        if causal:
            if causal_mask is None:
                raise ValueError("a causal FIA call needs the compressed causal mask")
            mask: torch.Tensor | None = causal_mask
            sparse_mode = SPARSE_MODE_CAUSAL
        else:
            mask, sparse_mode = None, SPARSE_MODE_FULL
        out, _lse = self._fia(
            query.contiguous(),
            key_cache.view(num_blocks, block_size, -1),
            value_cache.view(num_blocks, block_size, -1),
            atten_mask=mask,
            block_table=block_table,
            input_layout="TND",
            block_size=block_size,
            actual_seq_lengths=list(actual_seq_lengths),
            actual_seq_lengths_kv=list(actual_seq_lengths_kv),
            num_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            scale=scale,
            sparse_mode=sparse_mode,
        )
        result: torch.Tensor = out
        return result
