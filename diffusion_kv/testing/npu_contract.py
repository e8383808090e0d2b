"""Bind the torch_npu emulator to a released torch-npu wheel's own operator contracts.

``ci/npu_wheel_contract.py`` reads a downloaded (never installed) torch-npu wheel and writes a
*contract* folder: the schema strings the wheel registers (``torch_npu/lib/libtorch_npu.so``;
ATB operators from ``libop_plugin_atb.so`` or, where the string is not recoverable,
``include/.../AtbOpsInterface.h``) and a Python file with the wheel's own meta functions
(``torch_npu/op_plugin/meta/_meta_registrations.py``, the functions and the helpers they
use, with torch_npu's imports replaced by inert stand-ins).

:func:`bind` then registers every emulated operator the contract has as a ``torch.library``
operator under its real name (``torch.ops.npu.*``, ``torch.ops.atb.*``) with

* the **wheel's schema**: the dispatcher parses every call, so an unknown or renamed keyword,
  a wrong argument type or a missing argument fails exactly as with the real torch_npu, and
  omitted arguments take the **wheel's defaults** (the CPU kernel fills them in before it
  calls the emulator);
* the **emulator** as its CPU kernel (:class:`~.torch_npu_emulator.TorchNpuEmulator` methods);
* the **wheel's meta function** as its Meta kernel; every CPU call is replayed on meta tensors
  and the emulator's outputs must have the shapes and dtypes the wheel's meta function gives.

Before anything is registered, every wheel schema is compared with the schema the emulator
embeds and with the emulator method's parameters; any difference (a renamed argument, a new
one, a changed default, a changed type) is a :class:`ContractMismatch`. Emulators built while
a binding is in force expose the bound operators (:class:`~.torch_npu_emulator.BoundOp`).

``tests/npu/conftest.py`` binds the contract named by ``DIFFUSION_KV_NPU_CONTRACT`` for the
whole session, so ``pytest tests/npu`` (the plugin's tests and the whole conformance kit)
runs through the wheel's contracts; :func:`bound` binds one for a block (tests of this module).
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import json
import sys
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch.utils import _pytree as pytree

from diffusion_kv.testing import torch_npu_emulator as emulator_module
from diffusion_kv.testing.torch_npu_emulator import EMULATED_OPS, OpSpec, current_emulator

__all__ = [
    "CONTRACT_ENV",
    "ContractMismatch",
    "WheelBinding",
    "WheelContract",
    "bind",
    "bound",
    "load_contract",
    "method_differences",
    "schema_differences",
]

CONTRACT_ENV = "DIFFUSION_KV_NPU_CONTRACT"
"""A contract folder (``contract.json``): ``tests/npu`` binds it for the whole session."""


class ContractMismatch(AssertionError):
    """The emulator and the released wheel disagree (schema, parameters or output shapes)."""


@dataclass(frozen=True)
class WheelContract:
    """What one torch-npu wheel says about the emulated operators."""

    version: str
    wheel: str
    schemas: Mapping[str, str]
    """``namespace::name[.overload]`` -> the wheel's schema string (with the namespace)."""
    sources: Mapping[str, str]
    """Same keys -> the wheel file the schema was read from."""
    meta_module: Path | None = None
    """A Python file defining the wheel's meta functions (None: no meta kernels)."""
    meta_functions: Mapping[str, str] = field(default_factory=dict)
    """``namespace::name`` -> the meta function's name in :attr:`meta_module`."""
    notes: tuple[str, ...] = ()
    """What the contract leaves out, and why (printed by the lane)."""


def load_contract(directory: str | Path) -> WheelContract:
    """The contract ``ci/npu_wheel_contract.py`` wrote into ``directory``."""
    root = Path(directory)
    data = json.loads((root / "contract.json").read_text())
    meta = data.get("meta_module")
    return WheelContract(
        version=data["version"],
        wheel=data["wheel"],
        schemas=dict(data["schemas"]),
        sources=dict(data["sources"]),
        meta_module=root / meta if meta else None,
        meta_functions=dict(data.get("meta_functions", {})),
        notes=tuple(data.get("notes", ())),
    )


def _alias(argument: Any) -> tuple[bool, list[str]] | None:
    info = argument.alias_info
    return None if info is None else (bool(info.is_write), sorted(info.before_set))


def _argument_text(argument: Any) -> str:
    alias = _alias(argument)
    mark = f"({''.join(alias[1])}{'!' if alias[0] else ''})" if alias else ""
    default = f"={argument.default_value!r}" if argument.has_default_value() else ""
    return f"{argument.type}{mark} {argument.name}{default}"


def _default_text(argument: Any) -> str:
    return "(required)" if not argument.has_default_value() else repr(argument.default_value)


def schema_differences(wheel: str, emulated: str) -> list[str]:
    """How the emulator's embedded schema differs from the wheel's (empty: they agree).

    Names, order, types (with alias annotations), keyword-only markers, defaults and returns
    are compared; quoting style is not.
    """
    w, e = torch._C.parse_schema(wheel), torch._C.parse_schema(emulated)
    out: list[str] = []
    if (w.name, w.overload_name) != (e.name, e.overload_name):
        out.append(
            f"operator {w.name}.{w.overload_name} in the wheel, {e.name}.{e.overload_name} in the emulator"
        )
    wa = {a.name: a for a in w.arguments}
    ea = {a.name: a for a in e.arguments}
    for name in wa.keys() - ea.keys():
        out.append(f"argument {name!r} is in the wheel's schema only ({_argument_text(wa[name])})")
    for name in ea.keys() - wa.keys():
        out.append(f"argument {name!r} is in the emulator's schema only (renamed or removed in the wheel)")
    common = wa.keys() & ea.keys()
    w_order = [a.name for a in w.arguments if a.name in common]
    e_order = [a.name for a in e.arguments if a.name in common]
    if w_order != e_order:
        out.append(f"the arguments are ordered {w_order} in the wheel, {e_order} in the emulator")
    for name in common:
        warg, earg = wa[name], ea[name]
        if str(warg.type) != str(earg.type) or _alias(warg) != _alias(earg):
            out.append(
                f"argument {name!r} has type {warg.type} (alias {_alias(warg)}) in the wheel, "
                f"{earg.type} (alias {_alias(earg)}) in the emulator"
            )
        if warg.kwarg_only != earg.kwarg_only:
            out.append(f"argument {name!r} is keyword-only={warg.kwarg_only} in the wheel")
        if _default_text(warg) != _default_text(earg):
            out.append(
                f"argument {name!r} defaults to {_default_text(warg)} in the wheel, {_default_text(earg)} here"
            )
    wr = [str(r.type) for r in w.returns]
    er = [str(r.type) for r in e.returns]
    if wr != er:
        out.append(f"returns {wr} in the wheel, {er} in the emulator")
    return sorted(out)


def method_differences(schema: str, method: Callable[..., Any]) -> list[str]:
    """How an emulator method's parameters differ from the wheel's schema (empty: the method
    takes every argument the dispatcher will pass, by the same names)."""
    parsed = torch._C.parse_schema(schema)
    params = inspect.signature(method).parameters
    var_keyword = any(p.kind is p.VAR_KEYWORD for p in params.values())
    named = {n: p for n, p in params.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    out: list[str] = []
    arguments = {a.name: a for a in parsed.arguments}
    for name, param in named.items():
        arg = arguments.get(name)
        if arg is None:
            out.append(f"the emulator's parameter {name!r} is not an argument of the wheel's schema")
            continue
        if arg.kwarg_only != (param.kind is param.KEYWORD_ONLY):
            out.append(f"{name!r}: keyword-only in {'the wheel' if arg.kwarg_only else 'the emulator'} only")
    if not var_keyword:
        for name in arguments.keys() - named.keys():
            out.append(f"the wheel's argument {name!r} is not a parameter of the emulator")
    return sorted(out)


def _load_meta(path: Path) -> ModuleType:
    name = f"_diffusion_kv_wheel_meta_{abs(hash(str(path)))}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ContractMismatch(f"cannot load the wheel's meta functions from {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


_LIBRARY: Any = torch.library.Library
"""torch's (untyped) registration class."""


def _to_meta(value: Any) -> Any:
    return pytree.tree_map_only(torch.Tensor, lambda t: torch.empty_like(t, device="meta"), value)


def _signature(value: Any) -> Any:
    return pytree.tree_map_only(torch.Tensor, lambda t: (tuple(t.shape), t.dtype), value)


class WheelBinding:
    """The emulated operators registered with one wheel's schemas (see the module docstring)."""

    def __init__(self, contract: WheelContract) -> None:
        self.contract = contract
        self.specs: dict[str, OpSpec] = {
            s.qualified: s for s in EMULATED_OPS if s.qualified in contract.schemas
        }
        self.calls: Counter[str] = Counter()
        """CPU calls per operator through the binding."""
        self.meta_checks: Counter[str] = Counter()
        """CPU calls whose outputs were compared with the wheel's meta function."""
        self._libraries: dict[str, Any] = {}
        self._overloads: dict[str, Any] = {}
        self._meta: dict[str, Callable[..., Any]] = {}
        self.unbound = sorted(s.qualified for s in EMULATED_OPS if s.qualified not in contract.schemas)
        """Emulated operators this contract has no schema for (they stay emulator-only)."""

    # -- checks before registration --------------------------------------------------------------

    def differences(self) -> list[str]:
        """Every disagreement between the wheel's schemas and the emulator (empty: none)."""
        probe = emulator_module.TorchNpuEmulator.__new__(emulator_module.TorchNpuEmulator)
        out: list[str] = []
        for qualified, spec in sorted(self.specs.items()):
            wheel = self.contract.schemas[qualified]
            found = [
                f"{qualified}: {d}" for d in schema_differences(wheel, f"{spec.namespace}::{spec.schema}")
            ]
            method = getattr(probe, spec.method)
            found += [
                f"{qualified} (emulator method {spec.method}): {d}" for d in method_differences(wheel, method)
            ]
            out += found
        return out

    # -- registration ----------------------------------------------------------------------------

    def register(self) -> None:
        problems = self.differences()
        if problems:
            raise ContractMismatch(
                f"torch-npu {self.contract.version} ({self.contract.wheel}) disagrees with the emulator:\n  "
                + "\n  ".join(problems)
            )
        meta = _load_meta(self.contract.meta_module) if self.contract.meta_module is not None else None
        try:
            for qualified, spec in self.specs.items():
                namespace, _, name = qualified.partition("::")
                library = self._libraries.get(namespace)
                if library is None:
                    library = self._libraries[namespace] = _LIBRARY(namespace, "DEF")
                library.define(self.contract.schemas[qualified].partition("::")[2])
                library.impl(name, self._kernel(spec), "CPU")
                function = self.contract.meta_functions.get(qualified)
                if function is not None and meta is not None:
                    self._meta[qualified] = getattr(meta, function)
                    library.impl(name, self._meta[qualified], "Meta")
            for qualified, spec in self.specs.items():
                packet = getattr(getattr(torch.ops, spec.namespace), spec.name)
                self._overloads[qualified] = getattr(packet, spec.overload or "default")
        except Exception:
            self.close()
            raise

    def close(self) -> None:
        """Remove every registration (the namespaces are left as torch found them)."""
        for library in self._libraries.values():
            library._destroy()
        self._libraries.clear()
        self._overloads.clear()

    def overload(self, qualified: str) -> Any | None:
        """The bound ``torch.ops`` overload of ``namespace::name[.overload]`` (None: not bound)."""
        return self._overloads.get(qualified)

    def has_meta(self, qualified: str) -> bool:
        return qualified in self._meta

    # -- the CPU kernel --------------------------------------------------------------------------

    def _kernel(self, spec: OpSpec) -> Callable[..., Any]:
        schema = torch._C.parse_schema(self.contract.schemas[spec.qualified])
        keyword_defaults = {
            a.name: a.default_value for a in schema.arguments if a.kwarg_only and a.has_default_value()
        }

        def kernel(*args: Any, **kwargs: Any) -> Any:
            emulator = current_emulator()
            # the dispatcher passes only the keyword arguments that differ from the defaults:
            # give the emulator the wheel's defaults, not its own
            full = {**keyword_defaults, **kwargs}
            result = getattr(emulator, spec.method)(*args, **full)
            self.calls[spec.qualified] += 1
            if spec.qualified in self._meta:
                self._check_meta(spec, args, kwargs, result)
            return result

        kernel.__name__ = f"emulated_{spec.name}"
        return kernel

    def _check_meta(self, spec: OpSpec, args: tuple[Any, ...], kwargs: dict[str, Any], result: Any) -> None:
        overload = self._overloads[spec.qualified]
        try:
            expected = overload(*_to_meta(args), **_to_meta(kwargs))
        except Exception as exc:
            raise ContractMismatch(
                f"{spec.qualified}: torch-npu {self.contract.version}'s meta function refused a call the "
                f"emulator accepted ({type(exc).__name__}: {exc})"
            ) from exc
        if _signature(expected) != _signature(result):
            raise ContractMismatch(
                f"{spec.qualified}: the emulator returned {_signature(result)}; torch-npu "
                f"{self.contract.version}'s meta function gives {_signature(expected)}"
            )
        self.meta_checks[spec.qualified] += 1

    def describe(self) -> list[str]:
        """What is bound, from which wheel file, and with which Meta kernel."""
        lines = [f"torch-npu {self.contract.version} ({self.contract.wheel}):"]
        for qualified in sorted(self.specs):
            meta = self.contract.meta_functions.get(qualified)
            lines.append(
                f"  {qualified}: schema from {self.contract.sources[qualified]}; "
                + (f"Meta kernel {meta} (wheel)" if meta else "no meta function in the wheel")
            )
        lines += [f"  {q}: not bound (no schema in this contract)" for q in self.unbound]
        lines += [f"  note: {n}" for n in self.contract.notes]
        return lines


def bind(contract: WheelContract) -> WheelBinding:
    """Register ``contract`` and make new emulators use it (one binding at a time)."""
    if emulator_module.contract_binding() is not None:
        raise RuntimeError("a torch-npu contract is already bound in this process")
    binding = WheelBinding(contract)
    binding.register()
    emulator_module.set_contract_binding(binding)
    return binding


def unbind(binding: WheelBinding) -> None:
    """Undo :func:`bind`."""
    if emulator_module.contract_binding() is binding:
        emulator_module.set_contract_binding(None)
    binding.close()


@contextlib.contextmanager
def bound(contract: WheelContract) -> Iterator[WheelBinding]:
    """:func:`bind` for the duration of a ``with`` block."""
    binding = bind(contract)
    try:
        yield binding
    finally:
        unbind(binding)
