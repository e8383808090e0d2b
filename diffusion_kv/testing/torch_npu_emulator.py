"""A pure-PyTorch stand-in for the few ``torch_npu`` operators diffusion-kv uses.

The real ``torch_npu`` cannot be imported without the CANN toolkit, so the npu plugin is tested
on CPU against this emulator. It is held to the released wheels (torch-npu 2.10.0.post4, the
targeted build, and 2.14.0, whose texts for these operators are identical):

* **schemas**: every operator carries the schema string of the wheel's own registration
  (``torch_npu/lib/libtorch_npu.so``; the ATB operators: ``libop_plugin_atb.so``). In the CI lane
  ``ci/npu_contract_lane.sh`` the operators are *bound* to the downloaded wheels
  (:mod:`diffusion_kv.testing.npu_contract`): they become ``torch.library`` operators with the
  wheel's schema, this emulator as their CPU kernel and the wheel's own meta function as their
  Meta kernel, so argument names, defaults and output shapes are the wheel's;
* **math**: every operator computes what the documentation specifies (float32 accumulation,
  output in the query dtype), on CPU tensors;
* **contract**: it refuses what the documentation (``torch_npu/_op_plugin_docs.py``) refuses,
  raising :class:`EmulatedNpuError` (a ``RuntimeError``, like torch_npu's operator errors):
  a wrong ``input_layout``, dtype, mask or ``cache_mode``, non-contiguous inputs, slots outside
  ``[0, blocks * block_size - 1]``, and the TND layout's limits (bfloat16, head sizes 128/192,
  ``T`` and row counts, sparse modes 0/3/4, query length < KV length for ``sparse_mode=3``);
* **honesty about gaps**: valid inputs it does not model (quantisation, rope, shared prefixes,
  other layouts, 5-D NZ caches, int8 queries, undocumented behaviour) raise
  ``NotImplementedError`` saying "not emulated", never an error that claims the op refuses.

Two behaviours are modelled although the documentation leaves them open (docs/ascend.md,
"first checks for a hardware run"): ``sparse_mode=3`` with a query as long as its keys is
accepted (``EmulatorProfile.literal_sparse3`` refuses it, as the text reads literally), and
rows with no visible key produce zeros. Combinations outside the TND documentation (float16,
other head sizes) are refused unless ``EmulatorProfile.unverified_tnd`` is set, which tests use
to exercise them on purpose, never as evidence that they work on hardware.

Every completed call is recorded in :attr:`TorchNpuEmulator.calls` so tests can count writes
and attention calls. Use it through :func:`emulated_torch_npu`, which installs the emulator's
module as ``sys.modules["torch_npu"]`` for the duration of a ``with`` block. The module carries
``__diffusion_kv_emulator__ = True``; the npu plugin reads that marker to report itself
available ("torch_npu emulator (CPU)") and to place its tensors on the CPU.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import sys
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from importlib.machinery import ModuleSpec
from typing import Any, Protocol

import torch

from diffusion_kv.platforms.npu.kernels import EMULATOR_ATB_ATTRIBUTE, EMULATOR_ATTRIBUTE

__all__ = [
    "EMULATED_OPS",
    "EmulatedCall",
    "EmulatedNpuError",
    "EmulatedOp",
    "EmulatorProfile",
    "OpSpec",
    "TorchNpuEmulator",
    "emulated_torch_npu",
]

MASK_SIZE = 2048
INT32_MAX = 2147483647

LAYOUTS = {
    "BSH": 3,
    "BSND": 4,
    "BNSD": 4,
    "TND": 3,
    "NTD": 3,
    "BNSD_BSND": 4,
    "BSH_BNSD": 3,
    "BSND_BNSD": 4,
    "NTD_TND": 3,
    "BSH_NBSD": 3,
    "BSND_NBSD": 4,
    "BNSD_NBSD": 4,
    "TND_NTD": 3,
    "NSD": 3,
}
"""Every ``input_layout`` the wheels' meta registration of FIA accepts, with the query rank it
implies (``get_query_and_attention_out_layout`` in ``op_plugin/meta/_meta_registrations.py``).
Only ``TND`` is emulated; the others are valid but "not emulated"."""

FIA_FLOAT_DTYPES = (torch.float16, torch.bfloat16)
TND_DTYPES = (torch.bfloat16,)
"""The TND constraints of both FIA entry points: bfloat16 only."""
TND_HEAD_SIZES = ((128, 128), (192, 128), (192, 192))
"""``(query/key head size, value head size)`` pairs the TND constraints list (v2 page; the v1
page lists the 192 rows only)."""
TND_MAX_TOKENS = {"v1": 65536, "v2": 1 << 20}
"""``T`` of a TND call: "T<=65536" (v1 page), "T<=1M" (v2 page)."""
MAX_BATCHES = {"v1": 65536, "v2": 4096}
"""Batch entries: B <= 65536 (v1, multi-token queries); TND length lists <= 4096 (v2 page)."""
TND_SPARSE_MODES = (0, 3, 4)
"""TND: sparse_mode 0 without a mask, 3 with the compressed mask, or 4 with it."""
UNIMPLEMENTED_SPARSE_MODES = (5, 6, 7, 8)
"""Prefix, global, dilated, block_local: documented as not implemented."""

SCATTER_DTYPES = tuple(
    d
    for d in (
        torch.float16,
        torch.float32,
        torch.bfloat16,
        torch.int8,
        torch.uint8,
        torch.int16,
        getattr(torch, "uint16", None),
        torch.int32,
        getattr(torch, "uint32", None),
        getattr(torch, "float8_e5m2", None),
        getattr(torch, "float8_e4m3fn", None),
    )
    if d is not None
)
"""The scatter writer's documented dtypes that torch has (hifloat8 is a torch_npu dtype)."""
MASK_DTYPES = (torch.bool, torch.int8, torch.uint8)

SCATTER_SCHEMA = (
    "npu_scatter_pa_kv_cache(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
    "Tensor slot_mapping, *, Tensor? compress_lens=None, Tensor? compress_seq_offsets=None, "
    "Tensor? seq_lens=None, str? cache_mode='PA_NZ') -> ()"
)
SCATTER_SCHEMA_NO_CACHE_MODE = (
    "npu_scatter_pa_kv_cache(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
    "Tensor slot_mapping, *, Tensor? compress_lens=None, Tensor? compress_seq_offsets=None, "
    "Tensor? seq_lens=None) -> ()"
)
RESHAPE_AND_CACHE_SCHEMA = (
    "_npu_reshape_and_cache(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
    "Tensor slot_indices) -> ()"
)
_FIA_ARGUMENTS = (
    "Tensor query, Tensor key, Tensor value, *, Tensor? pse_shift=None, "
    "Tensor? atten_mask=None, SymInt[]? actual_seq_lengths=None, SymInt[]? actual_seq_lengths_kv=None, "
    "Tensor? dequant_scale1=None, Tensor? quant_scale1=None, Tensor? dequant_scale2=None, "
    "Tensor? quant_scale2=None, Tensor? quant_offset2=None, Tensor? antiquant_scale=None, "
    "Tensor? antiquant_offset=None, Tensor? key_antiquant_scale=None, Tensor? key_antiquant_offset=None, "
    "Tensor? value_antiquant_scale=None, Tensor? value_antiquant_offset=None, Tensor? block_table=None, "
    "Tensor? query_padding_size=None, Tensor? kv_padding_size=None, Tensor? key_shared_prefix=None, "
    "Tensor? value_shared_prefix=None, SymInt[]? actual_shared_prefix_len=None, Tensor? query_rope=None, "
    "Tensor? key_rope=None, Tensor? key_rope_antiquant_scale=None, int num_heads=1, float scale=1.0, "
    "int pre_tokens=2147483647, int next_tokens=2147483647, str input_layout='BSH', "
    "int num_key_value_heads=0, int sparse_mode=0, int inner_precise=0, int block_size=0, "
    "int antiquant_mode=0, int key_antiquant_mode=0, int value_antiquant_mode=0, "
    "bool softmax_lse_flag=False"
)
FIA_SCHEMA = f"npu_fused_infer_attention_score({_FIA_ARGUMENTS}) -> (Tensor, Tensor)"
FIA_OUT_SCHEMA = (
    f"npu_fused_infer_attention_score.out({_FIA_ARGUMENTS}, Tensor? workspace=None, Tensor[] out) "
    "-> (Tensor, Tensor)"
)
FIA_WORKSPACE_SCHEMA = f"_npu_fused_infer_attention_score_get_max_workspace({_FIA_ARGUMENTS}) -> Tensor"
FIA_V2_SCHEMA = (
    "npu_fused_infer_attention_score_v2(Tensor query, Tensor key, Tensor value, *, Tensor? query_rope=None, "
    "Tensor? key_rope=None, Tensor? pse_shift=None, Tensor? atten_mask=None, SymInt[]? actual_seq_qlen=None, "
    "SymInt[]? actual_seq_kvlen=None, Tensor? block_table=None, Tensor? dequant_scale_query=None, "
    "Tensor? dequant_scale_key=None, Tensor? dequant_offset_key=None, Tensor? dequant_scale_value=None, "
    "Tensor? dequant_offset_value=None, Tensor? dequant_scale_key_rope=None, Tensor? quant_scale_out=None, "
    "Tensor? quant_offset_out=None, Tensor? quant_scale_p=None, Tensor? learnable_sink=None, "
    "int num_query_heads=1, int num_key_value_heads=0, float softmax_scale=1.0, int pre_tokens=2147483647, "
    "int next_tokens=2147483647, str input_layout='BSH', int sparse_mode=0, int block_size=0, "
    "int query_quant_mode=0, int key_quant_mode=0, int value_quant_mode=0, int inner_precise=0, "
    "bool return_softmax_lse=False, int? query_dtype=None, int? key_dtype=None, int? value_dtype=None, "
    "int? query_rope_dtype=None, int? key_rope_dtype=None, int? key_shared_prefix_dtype=None, "
    "int? value_shared_prefix_dtype=None, int? dequant_scale_query_dtype=None, "
    "int? dequant_scale_key_dtype=None, int? dequant_scale_value_dtype=None, "
    "int? dequant_scale_key_rope_dtype=None, int? out_dtype=None) -> (Tensor, Tensor)"
)
_PAGED_ATTENTION_ARGUMENTS = (
    "Tensor query, Tensor key_cache, Tensor value_cache, int num_kv_heads, int num_heads, float scale_value, "
    "Tensor block_table, Tensor context_lens, Tensor(a!) out"
)
PAGED_ATTENTION_SCHEMA = (
    f"_npu_paged_attention({_PAGED_ATTENTION_ARGUMENTS}, *, Tensor? workspace=None) -> ()"
)
PAGED_ATTENTION_WORKSPACE_SCHEMA = (
    f"_npu_paged_attention_get_workspace({_PAGED_ATTENTION_ARGUMENTS}) -> Tensor"
)


@dataclass(frozen=True)
class OpSpec:
    """One emulated operator: its name on ``torch_npu``, its registration and its schema."""

    name: str
    """The attribute on ``torch_npu`` (for an overload, the packet's name)."""
    namespace: str
    """``npu`` (aclnn operators in ``libtorch_npu.so``) or ``atb`` (``libop_plugin_atb.so``)."""
    schema: str
    """The schema the wheel registers, without the namespace (torch-npu 2.10.0.post4's text)."""
    method: str
    """The :class:`TorchNpuEmulator` method that implements it."""
    overload: str = ""

    @property
    def qualified(self) -> str:
        """``namespace::name`` or ``namespace::name.overload``."""
        return f"{self.namespace}::{self.name}" + (f".{self.overload}" if self.overload else "")


EMULATED_OPS: tuple[OpSpec, ...] = (
    OpSpec("npu_scatter_pa_kv_cache", "npu", SCATTER_SCHEMA, "npu_scatter_pa_kv_cache"),
    OpSpec("npu_fused_infer_attention_score", "npu", FIA_SCHEMA, "npu_fused_infer_attention_score"),
    OpSpec(
        "npu_fused_infer_attention_score", "npu", FIA_OUT_SCHEMA, "npu_fused_infer_attention_score_out", "out"
    ),
    OpSpec(
        "_npu_fused_infer_attention_score_get_max_workspace",
        "npu",
        FIA_WORKSPACE_SCHEMA,
        "_npu_fused_infer_attention_score_get_max_workspace",
    ),
    OpSpec("npu_fused_infer_attention_score_v2", "npu", FIA_V2_SCHEMA, "npu_fused_infer_attention_score_v2"),
    OpSpec("_npu_reshape_and_cache", "atb", RESHAPE_AND_CACHE_SCHEMA, "_npu_reshape_and_cache"),
    OpSpec("_npu_paged_attention", "atb", PAGED_ATTENTION_SCHEMA, "_npu_paged_attention"),
    OpSpec(
        "_npu_paged_attention_get_workspace",
        "atb",
        PAGED_ATTENTION_WORKSPACE_SCHEMA,
        "_npu_paged_attention_get_workspace",
    ),
)
"""Every operator the emulator offers, with the schema the released wheel registers for it."""

_FIA_UNMODELLED = (
    "pse_shift",
    "dequant_scale1",
    "quant_scale1",
    "dequant_scale2",
    "quant_scale2",
    "quant_offset2",
    "antiquant_scale",
    "antiquant_offset",
    "key_antiquant_scale",
    "key_antiquant_offset",
    "value_antiquant_scale",
    "value_antiquant_offset",
    "query_padding_size",
    "kv_padding_size",
    "key_shared_prefix",
    "value_shared_prefix",
    "actual_shared_prefix_len",
    "query_rope",
    "key_rope",
    "key_rope_antiquant_scale",
)


class EmulatedNpuError(RuntimeError):
    """An argument the real operator refuses (the message starts with the op name)."""


@dataclass(frozen=True)
class EmulatedCall:
    """One completed operator call: tensor shapes/dtypes and the scalar arguments."""

    op: str
    shapes: Mapping[str, tuple[int, ...]]
    dtypes: Mapping[str, torch.dtype]
    args: Mapping[str, Any]


@dataclass(frozen=True)
class EmulatorProfile:
    """Which torch_npu build to emulate, and how strictly."""

    version: str = "2.10.0.post4"
    scatter_pa_kv_cache: bool = True
    """Offer ``npu_scatter_pa_kv_cache``."""
    scatter_cache_mode: bool = True
    """Its schema has ``cache_mode`` (False: the older builds whose schema lacks it)."""
    nnal_installed: bool = True
    """The ATB operators' library loads (it needs NNAL's ``libatb.so``). ``_npu_reshape_and_cache``
    and ``_npu_paged_attention`` exist either way, as in a real torch_npu (lazy wrappers); without
    NNAL their first call raises ``OSError``."""
    fused_infer_attention: bool = True
    strict_unique_slots: bool = True
    """Refuse duplicate slots (the scatter writer leaves the result undefined)."""
    strict_mask_content: bool = True
    """Check that a compressed mask really is ``triu(ones(2048, 2048), 1)``."""
    strict_block_size: bool = True
    """With multi-token queries, require block_size a multiple of 128 in [128, 512]."""
    unverified_tnd: bool = False
    """UNVERIFIED combinations: also accept TND calls the wheels' TND text does not list
    (float16; any head size <= 512 that is a multiple of 16). For tests that exercise such
    combinations on purpose; it is not evidence that hardware accepts them."""
    literal_sparse3: bool = False
    """Read the TND text's "query length < KV length per batch" for ``sparse_mode=3`` literally
    and refuse equal lengths too (off: equal lengths are accepted, an open point)."""


class EmulatedOp:
    """A callable shaped like a ``torch.ops`` packet: ``op(...)``, ``op.default._schema``."""

    def __init__(self, name: str, schema: str, fn: Callable[..., Any], out: Callable[..., Any] | None = None):
        self.__name__ = name
        self.__qualname__ = name
        self._fn = fn
        self._schema = torch._C.parse_schema(schema)
        self.__signature__ = inspect.signature(fn)
        if out is not None:
            self.out = out

    @property
    def default(self) -> EmulatedOp:
        return self

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._fn(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<emulated torch_npu op {self.__name__}>"


class ContractBinding(Protocol):
    """What the emulator needs of a binding to the released wheels (see :mod:`.npu_contract`)."""

    def overload(self, qualified: str) -> Any | None:
        """The ``torch.ops`` overload bound for ``namespace::name[.overload]``, or None."""


_BINDING: list[ContractBinding] = []
_CURRENT: contextvars.ContextVar[TorchNpuEmulator | None] = contextvars.ContextVar(
    "diffusion_kv_npu_emulator", default=None
)


def set_contract_binding(binding: ContractBinding | None) -> None:
    """Make emulators built from now on expose ``binding``'s operators (None: their own)."""
    _BINDING[:] = [binding] if binding is not None else []


def contract_binding() -> ContractBinding | None:
    return _BINDING[0] if _BINDING else None


def current_emulator() -> TorchNpuEmulator:
    """The emulator whose bound operator is being called (the bound CPU kernels read it)."""
    emulator = _CURRENT.get()
    if emulator is None:
        raise RuntimeError("a bound torch_npu operator was called outside an emulator (use emulator.module)")
    return emulator


class BoundOp:
    """An emulator operator that goes through a ``torch.library`` registration with the wheel's
    schema (CPU kernel: this emulator; Meta kernel: the wheel's own)."""

    def __init__(self, emulator: TorchNpuEmulator, name: str, overload: Any, out: Any | None = None) -> None:
        self.__name__ = name
        self._emulator = emulator
        self._overload = overload
        if out is not None:
            self.out = BoundOp(emulator, f"{name}.out", out)

    @property
    def default(self) -> Any:
        """The bound ``torch.ops`` overload (``._schema`` is the wheel's schema)."""
        return self._overload

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        token = _CURRENT.set(self._emulator)
        try:
            return self._overload(*args, **kwargs)
        finally:
            _CURRENT.reset(token)

    def __repr__(self) -> str:
        return f"<torch_npu op {self.__name__} bound to {self._overload._schema.name}>"


class _NnalMissing:
    """An ATB operator whose library did not load: torch_npu's lazy wrapper raises on call."""

    def __init__(self, name: str, inner: Any) -> None:
        self.__name__ = name
        self._inner = inner

    @property
    def default(self) -> Any:
        return self._inner.default

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise OSError(
            f"{self.__name__}: libatb.so: cannot open shared object file: No such file or directory "
            "(emulated: NNAL is not installed)"
        )


def _fail(op: str, message: str) -> EmulatedNpuError:
    return EmulatedNpuError(f"{op}: {message}")


def _not_emulated(op: str, message: str) -> NotImplementedError:
    return NotImplementedError(f"{op}: {message} (valid, but not emulated)")


def _require_contiguous(op: str, **tensors: torch.Tensor | None) -> None:
    for name, t in tensors.items():
        if t is not None and not t.is_contiguous():
            raise _fail(op, f"{name} is not contiguous (non-contiguous inputs are not supported)")


def _describe(
    tensors: Mapping[str, torch.Tensor | None],
) -> tuple[dict[str, tuple[int, ...]], dict[str, torch.dtype]]:
    shapes = {k: tuple(t.shape) for k, t in tensors.items() if t is not None}
    dtypes = {k: t.dtype for k, t in tensors.items() if t is not None}
    return shapes, dtypes


def attend_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    allowed: torch.Tensor,
    scale: float,
    sink: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The shared attention math of every emulated attention operator.

    ``query [ql, N, D]``, ``key [kl, KVH, D]``, ``value [kl, KVH, Dv]``, ``allowed [ql, kl]`` bool.
    Query head ``h`` reads KV head ``h // (N // KVH)``. Scores accumulate in float32; rows with
    no allowed key produce zeros (and ``lse = -inf``). ``sink`` (``[N]``) adds one logit per
    head to the softmax denominator without contributing a value.
    Returns ``(out [ql, N, Dv] float32, lse [ql, N] float32)``.
    """
    ql, num_heads, _ = query.shape
    kl, kv_heads, _ = key.shape
    dv = value.shape[-1]
    groups = num_heads // kv_heads
    q = query.float().reshape(ql, kv_heads, groups, -1).permute(1, 2, 0, 3)  # [KVH, g, ql, D]
    k = key.float().permute(1, 0, 2)  # [KVH, kl, D]
    v = value.float().permute(1, 0, 2)  # [KVH, kl, Dv]
    scores = torch.matmul(q, k[:, None].transpose(-1, -2)) * scale  # [KVH, g, ql, kl]
    scores = scores.masked_fill(~allowed, float("-inf"))
    row_ok = allowed.any(dim=-1)  # [ql]
    if sink is not None:
        sink_logits = sink.float().reshape(kv_heads, groups, 1, 1).expand(kv_heads, groups, ql, 1)
        scores = torch.cat([scores, sink_logits], dim=-1)
    lse = torch.logsumexp(scores, dim=-1)  # [KVH, g, ql]
    probs = torch.softmax(scores, dim=-1)
    if sink is not None:
        probs = probs[..., :kl]
    probs = torch.where(row_ok[:, None], probs, torch.zeros((), dtype=probs.dtype))
    out = torch.matmul(probs, v[:, None])  # [KVH, g, ql, Dv]
    out = out.permute(2, 0, 1, 3).reshape(ql, num_heads, dv)
    lse = lse.permute(2, 0, 1).reshape(ql, num_heads)
    if sink is None:
        lse = torch.where(row_ok[:, None], lse, torch.full_like(lse, float("-inf")))
    return out, lse


def allowed_keys(
    sparse_mode: int, query_len: int, kv_len: int, pre_tokens: int, next_tokens: int
) -> torch.Tensor:
    """``[query_len, kv_len]`` bool: which keys query row ``r`` of one batch may see."""
    r = torch.arange(query_len)[:, None]
    j = torch.arange(kv_len)[None, :]
    if sparse_mode == 0:
        return torch.ones(query_len, kv_len, dtype=torch.bool)
    if sparse_mode == 2:
        return j <= r
    if sparse_mode == 3:
        return j <= r + (kv_len - query_len)
    if sparse_mode == 4:
        p = r + (kv_len - query_len)
        return (j >= p - pre_tokens) & (j <= p + next_tokens)
    raise ValueError(f"sparse_mode {sparse_mode} has no mask-free rule")


@dataclass
class _FiaPlan:
    """A validated FIA call, ready for the math."""

    batches: list[tuple[int, int, int]]
    """``(q_start, q_end, kv_len)`` per batch."""
    num_heads: int
    kv_heads: int
    head_size_v: int
    paged: bool
    kv_starts: list[int] = field(default_factory=list)


class TorchNpuEmulator:
    """The emulator: operators, their validation, and a log of completed calls."""

    def __init__(self, profile: EmulatorProfile | None = None) -> None:
        self.profile = profile or EmulatorProfile()
        self.calls: list[EmulatedCall] = []
        self._checked_masks: set[tuple[int, int, tuple[int, ...], torch.dtype]] = set()
        self.binding = contract_binding()
        """The binding to a released wheel in force when this emulator was built (or None)."""
        self.module = self._build_module()

    # -- bookkeeping --------------------------------------------------------------------------

    def count(self, op: str) -> int:
        """Completed calls of ``op``."""
        return sum(1 for c in self.calls if c.op == op)

    def ops(self) -> list[str]:
        """Names of completed calls, in order."""
        return [c.op for c in self.calls]

    def reset(self) -> None:
        self.calls.clear()

    def _record(self, op: str, tensors: Mapping[str, torch.Tensor | None], **args: Any) -> None:
        shapes, dtypes = _describe(tensors)
        self.calls.append(EmulatedCall(op, shapes, dtypes, dict(args)))

    def _op(self, spec: OpSpec, out: OpSpec | None = None) -> Any:
        """``spec`` as ``torch_npu`` offers it: bound to the wheel when a binding is in force."""
        binding = self.binding
        bound = binding.overload(spec.qualified) if binding is not None else None
        if bound is not None:
            bound_out = binding.overload(out.qualified) if binding is not None and out is not None else None
            return BoundOp(self, spec.name, bound, bound_out)
        return EmulatedOp(
            spec.name,
            spec.schema,
            getattr(self, spec.method),
            out=getattr(self, out.method) if out is not None else None,
        )

    def _build_module(self) -> types.ModuleType:
        module = types.ModuleType("torch_npu", "diffusion-kv's pure-torch emulator of torch_npu (CPU)")
        module.__spec__ = ModuleSpec("torch_npu", loader=None, origin=__name__)
        module.__version__ = self.profile.version  # type: ignore[attr-defined]
        setattr(module, EMULATOR_ATTRIBUTE, True)
        setattr(module, EMULATOR_ATB_ATTRIBUTE, self.profile.nnal_installed)
        module.emulator = self  # type: ignore[attr-defined]
        p = self.profile
        specs = {s.qualified: s for s in EMULATED_OPS}
        if p.scatter_pa_kv_cache:
            if p.scatter_cache_mode:
                module.npu_scatter_pa_kv_cache = self._op(specs["npu::npu_scatter_pa_kv_cache"])  # type: ignore[attr-defined]
            else:
                module.npu_scatter_pa_kv_cache = EmulatedOp(  # type: ignore[attr-defined]
                    "npu_scatter_pa_kv_cache", SCATTER_SCHEMA_NO_CACHE_MODE, self._scatter_without_cache_mode
                )
        if p.fused_infer_attention:
            module.npu_fused_infer_attention_score = self._op(  # type: ignore[attr-defined]
                specs["npu::npu_fused_infer_attention_score"],
                specs["npu::npu_fused_infer_attention_score.out"],
            )
            module._npu_fused_infer_attention_score_get_max_workspace = self._op(  # type: ignore[attr-defined]
                specs["npu::_npu_fused_infer_attention_score_get_max_workspace"]
            )
            module.npu_fused_infer_attention_score_v2 = self._op(  # type: ignore[attr-defined]
                specs["npu::npu_fused_infer_attention_score_v2"]
            )
        for name in ("_npu_reshape_and_cache", "_npu_paged_attention", "_npu_paged_attention_get_workspace"):
            op = self._op(specs[f"atb::{name}"])
            setattr(module, name, op if p.nnal_installed else _NnalMissing(name, op))
        utils = types.SimpleNamespace(get_cann_version=lambda module="CANN": "")
        module.npu = types.SimpleNamespace(utils=utils, is_available=lambda: False)  # type: ignore[attr-defined]
        return module

    # -- K/V writers --------------------------------------------------------------------------

    def npu_scatter_pa_kv_cache(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        *,
        compress_lens: torch.Tensor | None = None,
        compress_seq_offsets: torch.Tensor | None = None,
        seq_lens: torch.Tensor | None = None,
        cache_mode: str | None = "PA_NZ",
    ) -> None:
        """Scatter ``key``/``value`` ``[T, KVH, D]`` into paged caches at ``slot_mapping``.

        ``cache_mode`` ``None`` or ``"Norm"``: ND caches ``[NB, BS, KVH, D]``. ``"PA_NZ"`` (the
        default): NZ caches ``[NB, KVH*D/L, BS, L]`` with ``L = 32 bytes / element size``.
        Every slot must lie in ``[0, NB*BS - 1]`` (the documented range: no padding value).
        """
        op = "npu_scatter_pa_kv_cache"
        if compress_lens is not None or compress_seq_offsets is not None or seq_lens is not None:
            raise _not_emulated(op, "the KV-compression scenario (4-D key/value) is")
        if cache_mode not in (None, "Norm", "PA_NZ"):
            raise _fail(op, f"cache_mode must be 'Norm' or 'PA_NZ'; got {cache_mode!r}")
        nz = cache_mode == "PA_NZ"
        self._check_writer_inputs(
            op, key, value, key_cache, value_cache, slot_mapping, (torch.int32, torch.int64)
        )
        _tokens, kv_heads, dk = key.shape
        dv = value.shape[2]
        if nz:
            lanes = 32 // key.element_size()
            nb, bs = key_cache.shape[0], key_cache.shape[2]
            for name, cache, d in (("key_cache", key_cache, dk), ("value_cache", value_cache, dv)):
                if (kv_heads * d) % lanes:
                    raise _fail(
                        op, f"PA_NZ needs kv_heads*head_size divisible by {lanes}; got {kv_heads * d}"
                    )
                want = (nb, kv_heads * d // lanes, bs, lanes)
                if tuple(cache.shape) != want:
                    raise _fail(
                        op,
                        f"cache_mode='PA_NZ' expects {name} of shape {want} ([blocks, H*D/{lanes}, block_size, "
                        f"{lanes}]); got {tuple(cache.shape)} (pass cache_mode='Norm' for ND caches)",
                    )
        else:
            nb, bs = key_cache.shape[0], key_cache.shape[1]
            for name, cache, d in (("key_cache", key_cache, dk), ("value_cache", value_cache, dv)):
                want = (nb, bs, kv_heads, d)
                if tuple(cache.shape) != want:
                    raise _fail(
                        op,
                        f"cache_mode={cache_mode!r} expects {name} of shape {want}; got {tuple(cache.shape)}",
                    )
        slots = self._check_slots(op, slot_mapping, nb * bs)
        if nz:
            self._write_nz(key, key_cache, slots, bs)
            self._write_nz(value, value_cache, slots, bs)
        else:
            key_cache.view(nb * bs, kv_heads, dk).index_copy_(0, slots, key)
            value_cache.view(nb * bs, kv_heads, dv).index_copy_(0, slots, value)
        self._record(
            op,
            {
                "key": key,
                "value": value,
                "key_cache": key_cache,
                "value_cache": value_cache,
                "slot_mapping": slot_mapping,
            },
            cache_mode=cache_mode,
        )

    def _scatter_without_cache_mode(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        *,
        compress_lens: torch.Tensor | None = None,
        compress_seq_offsets: torch.Tensor | None = None,
        seq_lens: torch.Tensor | None = None,
    ) -> None:
        raise NotImplementedError(
            "npu_scatter_pa_kv_cache: the layout rules of torch_npu builds whose schema lacks cache_mode are "
            "undocumented and not emulated (this profile only exercises writer selection)"
        )

    def _npu_reshape_and_cache(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_indices: torch.Tensor,
    ) -> None:
        """The ATB writer, ND layout: caches ``[NB, BS, KVH, D]``, int32 ``slot_indices``.

        The released wheels carry no documentation of this operator; what a negative slot does
        is therefore "not emulated".
        """
        op = "_npu_reshape_and_cache"
        self._check_writer_inputs(op, key, value, key_cache, value_cache, slot_indices, (torch.int32,))
        _tokens, kv_heads, dk = key.shape
        dv = value.shape[2]
        nb, bs = key_cache.shape[0], key_cache.shape[1]
        for name, cache, d in (("key_cache", key_cache, dk), ("value_cache", value_cache, dv)):
            if tuple(cache.shape) != (nb, bs, kv_heads, d):
                raise _fail(op, f"{name} must be [{nb}, {bs}, {kv_heads}, {d}]; got {tuple(cache.shape)}")
        if slot_indices.numel() and int(slot_indices.min()) < 0:
            raise _not_emulated(op, "negative slot_indices (no released documentation says what they do) are")
        slots = self._check_slots(op, slot_indices, nb * bs)
        key_cache.view(nb * bs, kv_heads, dk).index_copy_(0, slots, key)
        value_cache.view(nb * bs, kv_heads, dv).index_copy_(0, slots, value)
        self._record(
            op,
            {
                "key": key,
                "value": value,
                "key_cache": key_cache,
                "value_cache": value_cache,
                "slot_indices": slot_indices,
            },
        )

    def _check_writer_inputs(
        self,
        op: str,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slots: torch.Tensor,
        slot_dtypes: Sequence[torch.dtype],
    ) -> None:
        _require_contiguous(
            op, key=key, value=value, key_cache=key_cache, value_cache=value_cache, slot_mapping=slots
        )
        dtypes = {key.dtype, value.dtype, key_cache.dtype, value_cache.dtype}
        if len(dtypes) != 1:
            raise _fail(
                op, f"key, value and both caches must share one dtype; got {sorted(map(str, dtypes))}"
            )
        if key.dtype not in SCATTER_DTYPES:
            raise _fail(op, f"unsupported dtype {key.dtype}")
        if slots.dtype not in slot_dtypes:
            raise _fail(op, f"slot dtype must be one of {[str(d) for d in slot_dtypes]}; got {slots.dtype}")
        if key.dim() != 3 or value.dim() != 3:
            raise _fail(
                op,
                f"key and value must be 3-D [tokens, kv_heads, head_size]; got {key.dim()}-D/{value.dim()}-D",
            )
        if key_cache.dim() != 4 or value_cache.dim() != 4:
            raise _fail(op, "key_cache and value_cache must be 4-D")
        if key.shape[:2] != value.shape[:2]:
            raise _fail(
                op, f"key {tuple(key.shape)} and value {tuple(value.shape)} disagree on [tokens, kv_heads]"
            )
        if slots.dim() != 1 or slots.shape[0] != key.shape[0]:
            raise _fail(
                op, f"slots must be 1-D with one entry per token ({key.shape[0]}); got {tuple(slots.shape)}"
            )

    def _check_slots(self, op: str, slots: torch.Tensor, capacity: int) -> torch.Tensor:
        values = slots.to(torch.long)
        if values.numel():
            low, high = int(values.min()), int(values.max())
            if low < 0 or high >= capacity:
                bad = low if low < 0 else high
                raise _fail(
                    op,
                    f"slot {bad} is outside [0, {capacity - 1}] (the documented range; "
                    "there is no padding value: drop padding tokens before the call)",
                )
        if self.profile.strict_unique_slots and values.numel() != torch.unique(values).numel():
            raise _fail(op, "duplicate slots (the result would be undefined on hardware)")
        return values

    @staticmethod
    def _write_nz(src: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor, block_size: int) -> None:
        lanes = cache.shape[3]
        flat = src.reshape(src.shape[0], -1, lanes)  # [n, H*D/L, L]
        cache[slots // block_size, :, slots % block_size, :] = flat

    # -- fused infer attention ------------------------------------------------------------------

    def npu_fused_infer_attention_score(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        *,
        pse_shift: torch.Tensor | None = None,
        atten_mask: torch.Tensor | None = None,
        actual_seq_lengths: Sequence[int] | None = None,
        actual_seq_lengths_kv: Sequence[int] | None = None,
        dequant_scale1: torch.Tensor | None = None,
        quant_scale1: torch.Tensor | None = None,
        dequant_scale2: torch.Tensor | None = None,
        quant_scale2: torch.Tensor | None = None,
        quant_offset2: torch.Tensor | None = None,
        antiquant_scale: torch.Tensor | None = None,
        antiquant_offset: torch.Tensor | None = None,
        key_antiquant_scale: torch.Tensor | None = None,
        key_antiquant_offset: torch.Tensor | None = None,
        value_antiquant_scale: torch.Tensor | None = None,
        value_antiquant_offset: torch.Tensor | None = None,
        block_table: torch.Tensor | None = None,
        query_padding_size: torch.Tensor | None = None,
        kv_padding_size: torch.Tensor | None = None,
        key_shared_prefix: torch.Tensor | None = None,
        value_shared_prefix: torch.Tensor | None = None,
        actual_shared_prefix_len: Sequence[int] | None = None,
        query_rope: torch.Tensor | None = None,
        key_rope: torch.Tensor | None = None,
        key_rope_antiquant_scale: torch.Tensor | None = None,
        num_heads: int = 1,
        scale: float = 1.0,
        pre_tokens: int = INT32_MAX,
        next_tokens: int = INT32_MAX,
        input_layout: str = "BSH",
        num_key_value_heads: int = 0,
        sparse_mode: int = 0,
        inner_precise: int = 0,
        block_size: int = 0,
        antiquant_mode: int = 0,
        key_antiquant_mode: int = 0,
        value_antiquant_mode: int = 0,
        softmax_lse_flag: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """FIA for TND queries, over paged caches (``block_table``) or dense TND K/V.

        Returns ``(attention_out [T, N, Dv] in the query dtype, softmax_lse)``; ``softmax_lse``
        is float32 ``[T, N, 1]`` with ``softmax_lse_flag``, else an empty ``[0]`` tensor (what
        the wheel's meta registration returns; its docstring says ``[1]``).
        """
        arguments = locals()
        given = [name for name in _FIA_UNMODELLED if arguments[name] is not None]
        if given:
            raise _not_emulated("npu_fused_infer_attention_score", f"{given} are")
        return self._fia(
            "npu_fused_infer_attention_score",
            "v1",
            query,
            key,
            value,
            atten_mask=atten_mask,
            actual_seq_lengths=actual_seq_lengths,
            actual_seq_lengths_kv=actual_seq_lengths_kv,
            block_table=block_table,
            num_heads=num_heads,
            scale=scale,
            pre_tokens=pre_tokens,
            next_tokens=next_tokens,
            input_layout=input_layout,
            num_key_value_heads=num_key_value_heads,
            sparse_mode=sparse_mode,
            inner_precise=inner_precise,
            block_size=block_size,
            softmax_lse_flag=softmax_lse_flag,
            sink=None,
        )

    def npu_fused_infer_attention_score_out(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        *,
        workspace: torch.Tensor | None = None,
        out: Sequence[torch.Tensor],
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``.out`` variant: the same computation written into ``out = [attn_out, lse]``."""
        attn, lse = self.npu_fused_infer_attention_score(query, key, value, **kwargs)
        if len(out) != 2:
            raise _fail("npu_fused_infer_attention_score.out", "out must be [attention_out, softmax_lse]")
        if tuple(out[0].shape) != tuple(attn.shape) or out[0].dtype != attn.dtype:
            raise _fail(
                "npu_fused_infer_attention_score.out",
                f"attention_out buffer {tuple(out[0].shape)}/{out[0].dtype} must be {tuple(attn.shape)}/{attn.dtype}",
            )
        out[0].copy_(attn)
        if out[1].shape == lse.shape:
            out[1].copy_(lse)
        return out[0], out[1]

    def _npu_fused_infer_attention_score_get_max_workspace(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **kwargs: Any
    ) -> torch.Tensor:
        """A workspace for graph capture: the emulator needs none (an empty byte tensor)."""
        return torch.empty(0, dtype=torch.uint8)

    def npu_fused_infer_attention_score_v2(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        *,
        atten_mask: torch.Tensor | None = None,
        actual_seq_qlen: Sequence[int] | None = None,
        actual_seq_kvlen: Sequence[int] | None = None,
        block_table: torch.Tensor | None = None,
        num_query_heads: int = 1,
        num_key_value_heads: int = 0,
        softmax_scale: float = 1.0,
        pre_tokens: int = INT32_MAX,
        next_tokens: int = INT32_MAX,
        input_layout: str = "BSH",
        sparse_mode: int = 0,
        inner_precise: int = 0,
        block_size: int = 0,
        return_softmax_lse: bool = False,
        learnable_sink: torch.Tensor | None = None,
        **unmodelled: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The renamed-argument v2 entry point, plus the optional per-head ``learnable_sink``."""
        op = "npu_fused_infer_attention_score_v2"
        defaults = {"query_quant_mode": 0, "key_quant_mode": 0, "value_quant_mode": 0}
        given = sorted(k for k, v in unmodelled.items() if v is not None and v != defaults.get(k))
        if given:
            raise _not_emulated(op, f"{given} are")
        if learnable_sink is not None:
            if tuple(learnable_sink.shape) != (num_query_heads,):
                raise _fail(
                    op, f"learnable_sink must be [{num_query_heads}]; got {tuple(learnable_sink.shape)}"
                )
            if learnable_sink.dtype != torch.bfloat16:
                raise _fail(op, f"learnable_sink must be bfloat16; got {learnable_sink.dtype}")
        return self._fia(
            op,
            "v2",
            query,
            key,
            value,
            atten_mask=atten_mask,
            actual_seq_lengths=actual_seq_qlen,
            actual_seq_lengths_kv=actual_seq_kvlen,
            block_table=block_table,
            num_heads=num_query_heads,
            scale=softmax_scale,
            pre_tokens=pre_tokens,
            next_tokens=next_tokens,
            input_layout=input_layout,
            num_key_value_heads=num_key_value_heads,
            sparse_mode=sparse_mode,
            inner_precise=inner_precise,
            block_size=block_size,
            softmax_lse_flag=return_softmax_lse,
            sink=learnable_sink,
        )

    def _fia(
        self,
        op: str,
        entry: str,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        *,
        atten_mask: torch.Tensor | None,
        actual_seq_lengths: Sequence[int] | None,
        actual_seq_lengths_kv: Sequence[int] | None,
        block_table: torch.Tensor | None,
        num_heads: int,
        scale: float,
        pre_tokens: int,
        next_tokens: int,
        input_layout: str,
        num_key_value_heads: int,
        sparse_mode: int,
        inner_precise: int,
        block_size: int,
        softmax_lse_flag: bool,
        sink: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        plan = self._fia_validate(
            op,
            entry,
            query,
            key,
            value,
            atten_mask,
            actual_seq_lengths,
            actual_seq_lengths_kv,
            block_table,
            num_heads,
            input_layout,
            num_key_value_heads,
            sparse_mode,
            inner_precise,
            block_size,
            pre_tokens,
            next_tokens,
        )
        tokens = query.shape[0]
        out = torch.zeros((tokens, plan.num_heads, plan.head_size_v), dtype=torch.float32)
        # Rows past actual_seq_lengths[-1] are not computed (undefined on hardware): zeros here.
        lse = torch.zeros((tokens, plan.num_heads), dtype=torch.float32)
        for b, (q0, q1, kv_len) in enumerate(plan.batches):
            if q1 == q0:
                continue
            if kv_len == 0:  # no keys (an open point on hardware): zero output, lse = -inf
                lse[q0:q1] = float("-inf")
                continue
            if plan.paged:
                assert block_table is not None
                k_rows, v_rows = self._gather_pages(key, value, block_table[b], kv_len, plan, block_size)
            else:
                start = plan.kv_starts[b]
                k_rows, v_rows = key[start : start + kv_len], value[start : start + kv_len]
            allowed = allowed_keys(sparse_mode, q1 - q0, kv_len, pre_tokens, next_tokens)
            o, row_lse = attend_reference(query[q0:q1], k_rows, v_rows, allowed, scale, sink)
            out[q0:q1] = o
            lse[q0:q1] = row_lse
        self._record(
            op,
            {
                "query": query,
                "key": key,
                "value": value,
                "block_table": block_table,
                "atten_mask": atten_mask,
            },
            input_layout=input_layout,
            sparse_mode=sparse_mode,
            block_size=block_size,
            num_heads=num_heads,
            num_key_value_heads=num_key_value_heads,
            scale=scale,
            actual_seq_lengths=list(actual_seq_lengths or ()),
            actual_seq_lengths_kv=list(actual_seq_lengths_kv or ()),
        )
        lse_out = lse[..., None] if softmax_lse_flag else torch.empty(0, dtype=torch.float32)
        return out.to(query.dtype), lse_out

    def _gather_pages(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        table_row: torch.Tensor,
        kv_len: int,
        plan: _FiaPlan,
        block_size: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(kv_len)
        blocks = table_row.to(torch.long)[pos // block_size]
        offsets = pos % block_size
        kvh = plan.kv_heads
        if key.dim() == 3:
            k = key.view(key.shape[0], block_size, kvh, -1)[blocks, offsets]
            v = value.view(value.shape[0], block_size, kvh, -1)[blocks, offsets]
        else:  # (blocks, kv_heads, block_size, head_size)
            k = key[blocks, :, offsets, :]
            v = value[blocks, :, offsets, :]
        return k, v

    def _fia_validate(
        self,
        op: str,
        entry: str,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        atten_mask: torch.Tensor | None,
        actual_seq_lengths: Sequence[int] | None,
        actual_seq_lengths_kv: Sequence[int] | None,
        block_table: torch.Tensor | None,
        num_heads: int,
        input_layout: str,
        num_key_value_heads: int,
        sparse_mode: int,
        inner_precise: int,
        block_size: int,
        pre_tokens: int,
        next_tokens: int,
    ) -> _FiaPlan:
        if input_layout not in LAYOUTS:
            raise _fail(op, f"input_layout {input_layout!r} is not one of {sorted(LAYOUTS)}")
        if query.dim() != LAYOUTS[input_layout]:
            raise _fail(
                op,
                f"input_layout {input_layout} needs a {LAYOUTS[input_layout]}-D query; got {query.dim()}-D",
            )
        if input_layout != "TND":
            raise _not_emulated(op, f"input_layout={input_layout!r} is (only 'TND' is modelled)")
        _require_contiguous(op, query=query, key=key, value=value)
        if query.dtype == torch.int8:
            raise _not_emulated(op, "an int8 (quantised) query is")
        if query.dtype not in FIA_FLOAT_DTYPES:
            raise _fail(op, f"query dtype must be float16, bfloat16 or int8; got {query.dtype}")
        if key.dtype in (torch.int8, torch.int32) or value.dtype in (torch.int8, torch.int32):
            raise _not_emulated(
                op, f"int8/int4 (pseudo-quantised) key/value ({key.dtype}, {value.dtype}) are"
            )
        if key.dtype != query.dtype or value.dtype != query.dtype:
            raise _fail(
                op, f"query, key and value must share a dtype; got {query.dtype}, {key.dtype}, {value.dtype}"
            )
        if query.dtype not in TND_DTYPES and not self.profile.unverified_tnd:
            raise _fail(
                op,
                f"the TND layout takes bfloat16 only; got {query.dtype} "
                "(unverified combinations: EmulatorProfile(unverified_tnd=True))",
            )
        if inner_precise not in (0, 1, 2, 3):
            raise _fail(op, f"inner_precise must be 0..3; got {inner_precise}")
        tokens, n, d = query.shape
        if tokens > TND_MAX_TOKENS[entry]:
            raise _fail(op, f"the TND layout takes T <= {TND_MAX_TOKENS[entry]} query tokens; got {tokens}")
        if num_heads <= 0 or num_heads != n:
            raise _fail(op, f"num_heads={num_heads} does not match the query's {n} heads")
        kvh = num_key_value_heads or num_heads
        if num_heads > 256 or kvh > 256:
            raise _fail(op, f"num_heads={num_heads} and num_key_value_heads={kvh} must be <= 256")
        if num_heads % kvh:
            raise _fail(op, f"num_heads={num_heads} must be a multiple of num_key_value_heads={kvh}")
        if num_heads // kvh > 64:
            raise _fail(op, f"num_heads / num_key_value_heads = {num_heads // kvh} exceeds 64")
        if d > 512 or d % 16:
            raise _fail(op, f"head size {d} must be <= 512 and a multiple of 16 for float16/bfloat16")
        if sparse_mode in UNIMPLEMENTED_SPARSE_MODES:
            raise _fail(op, f"sparse_mode {sparse_mode} is documented as not implemented")
        if sparse_mode not in TND_SPARSE_MODES:
            raise _fail(op, f"sparse_mode {sparse_mode} is not supported with the TND layout (0, 3 or 4)")
        if actual_seq_lengths is None:
            raise _fail(op, "input_layout TND needs actual_seq_lengths (cumulative query ends)")
        cumulative = [int(x) for x in actual_seq_lengths]
        batches = len(cumulative)
        if batches == 0 or batches > MAX_BATCHES[entry]:
            raise _fail(op, f"actual_seq_lengths must hold 1..{MAX_BATCHES[entry]} entries; got {batches}")
        prev = 0
        for x in cumulative:
            if x < prev:
                raise _fail(
                    op, f"actual_seq_lengths must be non-decreasing and >= 0 for TND; got {cumulative}"
                )
            prev = x
        if cumulative[-1] > tokens:
            raise _fail(op, f"actual_seq_lengths ends at {cumulative[-1]} but the query has {tokens} tokens")
        if actual_seq_lengths_kv is None:
            raise _fail(op, "actual_seq_lengths_kv is required for TND")
        kv = [int(x) for x in actual_seq_lengths_kv]
        if len(kv) != batches:
            raise _fail(op, f"actual_seq_lengths_kv has {len(kv)} entries; actual_seq_lengths has {batches}")
        starts = [0, *cumulative[:-1]]
        query_lens = [e - s for s, e in zip(starts, cumulative, strict=True)]
        self._check_mask(op, sparse_mode, atten_mask)
        paged = block_table is not None
        plan = _FiaPlan(batches=[], num_heads=num_heads, kv_heads=kvh, head_size_v=0, paged=paged)
        if paged:
            assert block_table is not None
            kv_lens = kv
            self._check_paged(op, key, value, block_table, block_size, kvh, d, kv_lens, query_lens, plan)
        else:
            if key.dim() != 3 or value.dim() != 3 or key.shape[1] != kvh or value.shape[1] != kvh:
                raise _fail(
                    op,
                    f"TND key/value must be [T_kv, {kvh}, D]; got {tuple(key.shape)}, {tuple(value.shape)}",
                )
            if key.shape[2] != d:
                raise _fail(op, f"key head size {key.shape[2]} differs from the query's {d}")
            prev = 0
            for x in kv:
                if x < prev:
                    raise _fail(
                        op,
                        f"actual_seq_lengths_kv must be cumulative (non-decreasing) without a block table; got {kv}",
                    )
                prev = x
            if kv[-1] > key.shape[0]:
                raise _fail(op, f"actual_seq_lengths_kv ends at {kv[-1]} but key has {key.shape[0]} tokens")
            kv_starts = [0, *kv[:-1]]
            kv_lens = [e - s for s, e in zip(kv_starts, kv, strict=True)]
            plan.kv_starts = kv_starts
            plan.head_size_v = value.shape[2]
        if (d, plan.head_size_v) not in TND_HEAD_SIZES and not self.profile.unverified_tnd:
            raise _fail(
                op,
                f"the TND layout takes (query/key, value) head sizes {list(TND_HEAD_SIZES)}; got "
                f"({d}, {plan.head_size_v}) (unverified combinations: EmulatorProfile(unverified_tnd=True))",
            )
        self._check_lengths(op, sparse_mode, query_lens, kv_lens, pre_tokens, next_tokens)
        plan.batches = [(s, e, kl) for s, e, kl in zip(starts, cumulative, kv_lens, strict=True)]
        return plan

    def _check_lengths(
        self,
        op: str,
        sparse_mode: int,
        query_lens: list[int],
        kv_lens: list[int],
        pre_tokens: int,
        next_tokens: int,
    ) -> None:
        if sparse_mode == 3:
            for b, (ql, kl) in enumerate(zip(query_lens, kv_lens, strict=True)):
                if ql > kl or (self.profile.literal_sparse3 and ql == kl):
                    raise _fail(
                        op,
                        f"batch {b}: sparse_mode=3 with the TND layout needs the query length below the KV "
                        f"length; got {ql} query and {kl} KV tokens",
                    )
        if sparse_mode == 4:
            if pre_tokens + next_tokens < 0:
                raise _fail(
                    op, f"sparse_mode=4 needs pre_tokens + next_tokens >= 0; got {pre_tokens}, {next_tokens}"
                )
            for b, (ql, kl) in enumerate(zip(query_lens, kv_lens, strict=True)):
                if pre_tokens < -ql or next_tokens < -kl:
                    raise _fail(
                        op,
                        f"batch {b}: sparse_mode=4 needs pre_tokens >= -{ql} and next_tokens >= -{kl}; "
                        f"got {pre_tokens}, {next_tokens}",
                    )

    def _check_mask(self, op: str, sparse_mode: int, mask: torch.Tensor | None) -> None:
        if sparse_mode == 0:
            if mask is not None:
                raise _fail(
                    op,
                    "the TND layout takes sparse_mode=0 without a mask only "
                    "(pass no mask for full attention; a mask would be applied literally)",
                )
            return
        if mask is None:
            raise _fail(op, f"sparse_mode={sparse_mode} requires the compressed atten_mask")
        if tuple(mask.shape) not in (
            (MASK_SIZE, MASK_SIZE),
            (1, MASK_SIZE, MASK_SIZE),
            (1, 1, MASK_SIZE, MASK_SIZE),
        ):
            raise _fail(
                op, f"sparse_mode={sparse_mode} needs a {MASK_SIZE}x{MASK_SIZE} mask; got {tuple(mask.shape)}"
            )
        if mask.dtype not in MASK_DTYPES:
            raise _fail(op, f"atten_mask dtype must be bool, int8 or uint8; got {mask.dtype}")
        if self.profile.strict_mask_content:
            key = (mask.data_ptr(), mask._version, tuple(mask.shape), mask.dtype)
            if key not in self._checked_masks:
                template = torch.triu(torch.ones(MASK_SIZE, MASK_SIZE, dtype=torch.bool), diagonal=1)
                if not torch.equal(mask.reshape(MASK_SIZE, MASK_SIZE).to(torch.bool), template):
                    raise _fail(
                        op,
                        f"sparse_mode={sparse_mode} needs the compressed causal template "
                        "triu(ones(2048, 2048), diagonal=1) (1 = masked)",
                    )
                self._checked_masks.add(key)

    def _check_paged(
        self,
        op: str,
        key: torch.Tensor,
        value: torch.Tensor,
        block_table: torch.Tensor,
        block_size: int,
        kvh: int,
        d: int,
        kv_lens: list[int],
        query_lens: list[int],
        plan: _FiaPlan,
    ) -> None:
        if block_table.dtype != torch.int32 or block_table.dim() != 2:
            raise _fail(
                op, f"block_table must be a 2-D int32 tensor; got {block_table.dim()}-D {block_table.dtype}"
            )
        if block_size <= 0:
            raise _fail(op, "block_size must be > 0 with a block_table")
        multi_token = any(ql > 1 for ql in query_lens)
        if multi_token:
            if self.profile.strict_block_size and (block_size % 128 or not 128 <= block_size <= 512):
                raise _fail(
                    op,
                    f"block_size {block_size} must be a multiple of 128 in [128, 512] for multi-token queries",
                )
        elif block_size > 512 or block_size % 16:
            raise _fail(
                op, f"block_size {block_size} must be <= 512 and a multiple of 16 for float16/bfloat16 caches"
            )
        batches = len(kv_lens)
        if block_table.shape[0] != batches:
            raise _fail(op, f"block_table has {block_table.shape[0]} rows; the batch has {batches}")
        if key.dim() == 5 and value.dim() == 5:
            raise _not_emulated(op, "5-D (NZ) paged caches are")
        if key.dim() != value.dim() or key.dim() not in (3, 4):
            raise _fail(op, f"paged key/value must be 3-, 4- or 5-D; got {key.dim()}-D/{value.dim()}-D")
        num_blocks = key.shape[0]
        if key.dim() == 3:
            if key.shape[1] != block_size or value.shape[1] != block_size or value.shape[0] != num_blocks:
                raise _fail(
                    op,
                    f"3-D caches must be [blocks, {block_size}, H*D]; got {tuple(key.shape)}, {tuple(value.shape)}",
                )
            if key.shape[2] != kvh * d:
                raise _fail(
                    op, f"key cache last dim {key.shape[2]} must be num_key_value_heads*head_size={kvh * d}"
                )
            if kvh * d > 65535:
                raise _fail(op, f"num_key_value_heads*head_size={kvh * d} exceeds 65535 for 3-D caches")
            if value.shape[2] % kvh:
                raise _fail(op, f"value cache last dim {value.shape[2]} is not a multiple of {kvh}")
            plan.head_size_v = value.shape[2] // kvh
        else:
            if tuple(key.shape[1:3]) != (kvh, block_size) or key.shape[3] != d:
                raise _fail(
                    op, f"4-D caches must be [blocks, {kvh}, {block_size}, {d}]; got {tuple(key.shape)}"
                )
            if value.shape[0] != num_blocks or tuple(value.shape[1:3]) != (kvh, block_size):
                raise _fail(
                    op, f"4-D value cache must be [blocks, {kvh}, {block_size}, Dv]; got {tuple(value.shape)}"
                )
            plan.head_size_v = value.shape[3]
        width = block_table.shape[1]
        for b, kl in enumerate(kv_lens):
            if kl < 0 or kl > width * block_size:
                raise _fail(
                    op,
                    f"batch {b}: kv length {kl} is outside [0, {width * block_size}] (table width {width})",
                )
            used = block_table[b, : -(-kl // block_size)]
            if used.numel() and (int(used.min()) < 0 or int(used.max()) >= num_blocks):
                raise _fail(op, f"batch {b}: block ids {used.tolist()} fall outside [0, {num_blocks})")

    # -- decode-only paged attention (ATB) ------------------------------------------------------

    def _npu_paged_attention(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        num_kv_heads: int,
        num_heads: int,
        scale_value: float,
        block_table: torch.Tensor,
        context_lens: torch.Tensor,
        out: torch.Tensor,
        *,
        workspace: torch.Tensor | None = None,
    ) -> None:
        """One query token per sequence over ND caches ``[NB, BS, KVH, D]``; writes ``out``."""
        op = "_npu_paged_attention"
        _require_contiguous(op, query=query, key_cache=key_cache, value_cache=value_cache)
        if query.dim() != 3 or query.shape[1] != num_heads:
            raise _fail(op, f"query must be [batch, {num_heads}, D]; got {tuple(query.shape)}")
        if key_cache.dim() != 4 or key_cache.shape[2] != num_kv_heads:
            raise _fail(
                op, f"key_cache must be [blocks, block_size, {num_kv_heads}, D]; got {tuple(key_cache.shape)}"
            )
        if num_heads % num_kv_heads:
            raise _fail(op, f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")
        if block_table.dtype != torch.int32 or context_lens.dtype != torch.int32:
            raise _fail(op, "block_table and context_lens must be int32")
        batch = query.shape[0]
        block_size = key_cache.shape[1]
        if tuple(out.shape) != (batch, num_heads, value_cache.shape[3]):
            raise _fail(
                op, f"out must be [{batch}, {num_heads}, {value_cache.shape[3]}]; got {tuple(out.shape)}"
            )
        lens = [int(x) for x in context_lens.tolist()]
        for b, kl in enumerate(lens):
            pos = torch.arange(kl)
            blocks = block_table[b].to(torch.long)[pos // block_size]
            k = key_cache[blocks, pos % block_size]
            v = value_cache[blocks, pos % block_size]
            if kl == 0:
                out[b] = 0
                continue
            o, _ = attend_reference(query[b : b + 1], k, v, torch.ones(1, kl, dtype=torch.bool), scale_value)
            out[b] = o[0].to(out.dtype)
        self._record(
            op,
            {"query": query, "key_cache": key_cache, "value_cache": value_cache, "block_table": block_table},
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            context_lens=lens,
        )

    def _npu_paged_attention_get_workspace(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        num_kv_heads: int,
        num_heads: int,
        scale_value: float,
        block_table: torch.Tensor,
        context_lens: torch.Tensor,
        out: torch.Tensor,
    ) -> torch.Tensor:
        """A workspace for graph capture: the emulator needs none (an empty byte tensor)."""
        return torch.empty(0, dtype=torch.uint8)


@contextlib.contextmanager
def emulated_torch_npu(profile: EmulatorProfile | None = None) -> Iterator[TorchNpuEmulator]:
    """Install a fresh emulator as ``torch_npu`` for the block; restore what was there after."""
    emulator = TorchNpuEmulator(profile)
    missing = object()
    previous = sys.modules.get("torch_npu", missing)
    sys.modules["torch_npu"] = emulator.module
    try:
        yield emulator
    finally:
        if previous is missing:
            sys.modules.pop("torch_npu", None)
        else:
            sys.modules["torch_npu"] = previous  # type: ignore[assignment]
