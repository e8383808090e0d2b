"""Quantised KV pages: the KV-cache dtype as a choice of its own, and the scales that go with it.

A layer computes in its dtype (``LayerGeometry.dtype``: bfloat16, float16, float32) and may keep
its pages in another, smaller one (``LayerGeometry.cache_dtype``). The only one today is
``float8_e4m3fn`` (vLLM's ``--kv-cache-dtype fp8``): 1 byte per element, half of bfloat16's.

**Scales.** Per layer and KV head, ``k_scale`` and ``v_scale`` (vLLM's names; float32): a page
holds ``x / scale`` rounded to e4m3, and attention reads ``page * scale``. They are *static*: the
host sets them (a checkpoint's calibrated scales, or :meth:`KVScales.set` from an amax it
measured); the default is 1.0, vLLM's default without calibration, which covers ``|x| <= 448``
with e4m3's 3 mantissa bits of relative precision down to ``2**-6``. A value whose ``|x / scale|``
exceeds 448 is clamped to +-448 (never written as inf or nan) and counted:
:meth:`KVScales.saturations` reads the per-layer counts (a host sync, so only when asked). The
scales are tensors on the worker device held by each layer's geometry, so they reach the
backend with every write and attention call (and replay correctly under a captured CUDA graph
after :meth:`KVScales.set`); nothing is global.

**Error bound.** Round-to-nearest e4m3 has a relative error of at most ``2**-4`` per element
(``2**-9 * scale`` absolute below the normal range). The conformance kit checks a quantised backend
against dense attention over the *dequantised* K/V (what the pages hold) with the compute dtype's
tolerance, so a backend is held to exactness up to its own arithmetic; the error against
unquantised K/V is what the bench reports.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from diffusion_kv.core.errors import ValidationError

FP8_E4M3 = torch.float8_e4m3fn
FP8_MAX = 448.0
QUANTIZED_CACHE_DTYPES: frozenset[torch.dtype] = frozenset({FP8_E4M3})
"""Cache dtypes that hold scaled values (need :class:`KVScales`)."""

_NAMES: dict[str, torch.dtype | None] = {
    "auto": None,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "fp8": FP8_E4M3,
    "fp8_e4m3": FP8_E4M3,
    "float8_e4m3fn": FP8_E4M3,
}
CACHE_DTYPE_CHOICES = ("auto", "bfloat16", "float16", "fp8_e4m3")
"""What ``--kv-cache-dtype`` takes (``fp8`` and ``float8_e4m3fn`` are accepted for ``fp8_e4m3``)."""


def parse_kv_cache_dtype(value: object) -> torch.dtype | None:
    """``auto`` (None: the layer's own dtype), a name of :data:`CACHE_DTYPE_CHOICES`, or a
    torch dtype among them."""
    if isinstance(value, torch.dtype):
        if value in (torch.bfloat16, torch.float16, FP8_E4M3):
            return value
    elif isinstance(value, str) and value.lower() in _NAMES:
        return _NAMES[value.lower()]
    raise ValidationError(
        f"kv_cache_dtype must be one of {', '.join(CACHE_DTYPE_CHOICES)} (or fp8, float8_e4m3fn, a torch dtype "
        f"among them); got {value!r}"
    )


def is_unquantised(kv_cache_dtype: object, compute: torch.dtype | None = None) -> bool:
    """Whether ``kv_cache_dtype`` asks for pages in the layer's compute dtype: ``None``,
    ``"auto"`` (any spelling :func:`parse_kv_cache_dtype` takes) or ``compute`` itself (a dtype
    or its name). The one reading of "unquantised" every entry point uses (``RunnerConfig``, the
    CLI, requirements, the vLLM and vLLM-Omni integrations). A value the parser refuses is not
    unquantised (the caller reports it)."""
    if kv_cache_dtype is None or (compute is not None and kv_cache_dtype == compute):
        return True
    try:
        parsed = parse_kv_cache_dtype(kv_cache_dtype)
    except ValidationError:
        return False
    return parsed is None or (compute is not None and parsed == compute)


def cache_dtype_name(dtype: torch.dtype | None) -> str:
    if dtype is None:
        return "auto"
    return "fp8_e4m3" if dtype == FP8_E4M3 else str(dtype).removeprefix("torch.")


def resolve_cache_dtype(compute: torch.dtype, requested: torch.dtype | None, what: str) -> torch.dtype | None:
    """The cache dtype of a layer computing in ``compute`` (None: the same); a 16-bit cache dtype
    other than the compute dtype is refused (pages convert only to and from e4m3 with scales)."""
    if is_unquantised(requested, compute):
        return None
    if requested in QUANTIZED_CACHE_DTYPES:
        return requested
    raise ValidationError(
        f"{what}: kv_cache_dtype {cache_dtype_name(requested)} differs from the layer dtype "
        f"{str(compute).removeprefix('torch.')}; a cache holds the layer's dtype ('auto') or fp8_e4m3"
    )


def _per_head(value: object, heads: int, what: str) -> list[float]:
    problem = f"{what} must be a finite positive number or {heads} of them (one per KV head); got {value!r}"
    if isinstance(value, bool):
        raise ValidationError(problem)
    if isinstance(value, (int, float)):
        values = [float(value)] * heads
    elif isinstance(value, torch.Tensor):
        values = [float(x) for x in value.detach().to("cpu", torch.float64).reshape(-1).tolist()]
    elif isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        if any(isinstance(x, bool) or not isinstance(x, (int, float)) for x in value):
            raise ValidationError(problem)
        values = [float(x) for x in value]
    else:
        raise ValidationError(problem)
    if len(values) != heads or any(not (v > 0 and v < float("inf")) for v in values):
        raise ValidationError(problem)
    return values


def check_scale(value: object, heads: int, what: str) -> None:
    """Refuse a scale that is not a finite positive number or one per KV head
    (:class:`ValidationError` naming ``what``)."""
    _per_head(value, heads, what)


class KVScales:
    """One layer's ``k_scale``/``v_scale`` (``[Hkv]`` float32 on the worker device) and its
    saturation counters (``[2]`` int64: keys, values clamped at +-448 since the last reset)."""

    def __init__(
        self,
        num_kv_heads: int,
        device: torch.device,
        k_scale: object = 1.0,
        v_scale: object = 1.0,
        layer: str = "",
    ) -> None:
        self.layer = layer
        self.num_kv_heads = num_kv_heads
        self.k_scale = torch.tensor(
            _per_head(k_scale, num_kv_heads, f"layer {layer!r} k_scale"), dtype=torch.float32, device=device
        )
        self.v_scale = torch.tensor(
            _per_head(v_scale, num_kv_heads, f"layer {layer!r} v_scale"), dtype=torch.float32, device=device
        )
        self.saturated = torch.zeros(2, dtype=torch.int64, device=device)
        self._values = self._as_float32(self.k_scale, self.v_scale)
        self.version = 0
        """How many times :meth:`set` changed the scales (the prefix cache keys on the values)."""

    @staticmethod
    def _as_float32(k: torch.Tensor, v: torch.Tensor) -> tuple[tuple[float, ...], tuple[float, ...]]:
        return (
            tuple(float(x) for x in k.detach().to("cpu").tolist()),
            tuple(float(x) for x in v.detach().to("cpu").tolist()),
        )

    @property
    def values(self) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """``(k_scale, v_scale)`` per KV head as the tensors hold them (float32 values), kept on
        the host: reading them never syncs the device."""
        return self._values

    def identity(self) -> str:
        """The scales as exact text (``float.hex`` per head), for the prefix cache's identity:
        pages written under other scales decode to other values."""
        k, v = self._values
        return "k=" + ",".join(x.hex() for x in k) + ";v=" + ",".join(x.hex() for x in v)

    def set(self, k_scale: object, v_scale: object) -> None:
        """New scales, copied into the same tensors (a captured graph reads them at replay);
        both are checked before either changes. Pages written under the old scales are not
        rescaled: set scales before the first write of the K/V they describe. Bumps
        :attr:`version`; the prefix cache never serves a block written under other scales
        (``docs/architecture.md``, "Prefix caching")."""
        k = _per_head(k_scale, self.num_kv_heads, f"layer {self.layer!r} k_scale")
        v = _per_head(v_scale, self.num_kv_heads, f"layer {self.layer!r} v_scale")
        k_new = torch.tensor(k, dtype=torch.float32)
        v_new = torch.tensor(v, dtype=torch.float32)
        self.k_scale.copy_(k_new)
        self.v_scale.copy_(v_new)
        self._values = self._as_float32(k_new, v_new)
        self.version += 1

    @staticmethod
    def from_amax(amax: torch.Tensor) -> list[float]:
        """Scales mapping a per-head absolute maximum onto e4m3's largest value (448)."""
        return [max(float(a), 1e-12) / FP8_MAX for a in amax.detach().to("cpu", torch.float64).reshape(-1)]

    def saturations(self) -> tuple[int, int]:
        """``(keys, values)`` clamped since the last :meth:`reset_saturations` (syncs the device)."""
        k, v = self.saturated.tolist()
        return int(k), int(v)

    def reset_saturations(self) -> None:
        self.saturated.zero_()


def quantize(x: torch.Tensor, scale: torch.Tensor, counter: torch.Tensor | None = None) -> torch.Tensor:
    """``x [T, Hkv, D] / scale [Hkv]`` rounded to e4m3, clamped to +-448 (counted into
    ``counter``, a 0-d int64 device tensor, without a host sync)."""
    y = x.float() / scale[:, None]
    if counter is not None:
        counter.add_((y.abs() > FP8_MAX).sum())
    return y.clamp_(-FP8_MAX, FP8_MAX).to(FP8_E4M3)


def dequantize(pages: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``pages [..., Hkv, D]`` (e4m3) times ``scale [Hkv]``, in ``dtype``."""
    return (pages.float() * scale[:, None]).to(dtype)


def fake_quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """What a page holds for ``x``, read back: ``dequantize(quantize(x))`` in ``x``'s dtype."""
    return dequantize(quantize(x, scale), scale, x.dtype)


__all__ = [
    "CACHE_DTYPE_CHOICES",
    "FP8_E4M3",
    "FP8_MAX",
    "QUANTIZED_CACHE_DTYPES",
    "KVScales",
    "cache_dtype_name",
    "dequantize",
    "fake_quantize",
    "is_unquantised",
    "parse_kv_cache_dtype",
    "quantize",
    "resolve_cache_dtype",
]
