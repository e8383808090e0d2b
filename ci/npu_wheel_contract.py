#!/usr/bin/env python3
"""Read a released torch-npu wheel (never installed) and write the emulator's contract for it.

Usage::

    python ci/npu_wheel_contract.py WHEEL OUT_DIR

From the wheel (a zip, read in place) this takes:

* the **schema strings** of the emulated operators (``diffusion_kv.testing.torch_npu_emulator.
  EMULATED_OPS``): ``npu::`` operators from ``torch_npu/lib/libtorch_npu.so``, ``atb::`` operators
  from ``torch_npu/lib/libop_plugin_atb.so``. Where an ATB string cannot be recovered from the
  binary (torch-npu 2.14.0 stores it in pieces), the operator's declaration in
  ``torch_npu/include/third_party/op-plugin/op_plugin/include/AtbOpsInterface.h`` gives names,
  order, types and mutability; such an operator is bound only when it has no optional argument
  (a header has no defaults). Both sources are cross-checked where both exist;
* the **meta functions** registered for those operators in
  ``torch_npu/op_plugin/meta/_meta_registrations.py``, with every helper they reach, written to
  ``OUT_DIR/wheel_meta.py`` (decorators dropped; torch_npu's own imports replaced by inert
  stand-ins, the dtype codes taken from the wheel's own table);
* the **documented limits** in ``torch_npu/_op_plugin_docs.py``: each limit the npu plugin
  declares (``diffusion_kv.platforms.npu.constraints``) and each contract rule the emulator
  enforces is looked up in the operator's documentation block and compared.

``OUT_DIR/contract.json`` is what ``diffusion_kv.testing.npu_contract.load_contract`` reads.
The script prints what it checked and exits non-zero on any disagreement.
"""

from __future__ import annotations

import ast
import builtins
import hashlib
import json
import re
import sys
import zipfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from diffusion_kv.platforms.npu import constraints  # noqa: E402
from diffusion_kv.testing import torch_npu_emulator as emulator  # noqa: E402

LIB = "torch_npu/lib/libtorch_npu.so"
ATB_LIB = "torch_npu/lib/libop_plugin_atb.so"
ATB_HEADER = "torch_npu/include/third_party/op-plugin/op_plugin/include/AtbOpsInterface.h"
META = "torch_npu/op_plugin/meta/_meta_registrations.py"
DOCS = "torch_npu/_op_plugin_docs.py"


class Failure(Exception):
    pass


def log(message: str) -> None:
    print(f"[npu-contract] {message}", flush=True)


# --- schema strings ---------------------------------------------------------------------------------


def strings_at(data: bytes, needle: bytes) -> Iterable[str]:
    """Every NUL-terminated printable string of ``data`` that starts with ``needle``."""
    start = 0
    while True:
        at = data.find(needle, start)
        if at < 0:
            return
        start = at + 1
        if at > 0 and 0x20 <= data[at - 1] < 0x7F and data[at - 1] != ord(" "):
            continue  # inside a longer string (another operator's name ends with this one)
        end = data.find(b"\0", at)
        raw = data[at:end]
        if all(0x20 <= c < 0x7F for c in raw):
            yield raw.decode()


def schema_from_binary(data: bytes, spec: emulator.OpSpec) -> str | None:
    head = spec.name + (f".{spec.overload}" if spec.overload else "") + "("
    found = set()
    for text in strings_at(data, head.encode()):
        if " -> " not in text:
            continue
        try:
            parsed = torch._C.parse_schema(f"{spec.namespace}::{text}")
        except RuntimeError:
            continue  # a C++ signature or a message, not a schema
        if parsed.overload_name == spec.overload:
            found.add(str(parsed))
    if len(found) > 1:
        raise Failure(f"{spec.qualified}: the binary holds {len(found)} different schemas: {sorted(found)}")
    return found.pop() if found else None


CPP_TYPES: dict[str, str] = {
    "const at::Tensor&": "Tensor",
    "at::Tensor&": "Tensor(!)",
    "int64_t": "int",
    "const int64_t": "int",
    "double": "float",
    "const double": "float",
    "bool": "bool",
    "c10::SymIntArrayRef": "SymInt[]",
}


def schema_from_header(header: str, spec: emulator.OpSpec) -> tuple[str | None, str]:
    """``(schema, note)`` from the C++ declaration of ``spec``'s ATB function; schema None with
    the reason when the declaration cannot give a complete schema."""
    match = re.search(rf"TORCH_NPU_API\s+([\w:<>&, ]+?)\s*\b{re.escape(spec.name)}\(([^;]*)\);", header)
    if match is None:
        return None, f"{spec.qualified}: no declaration in {ATB_HEADER}"
    returns, params = match.group(1).strip(), match.group(2)
    if returns != "void":
        return None, f"{spec.qualified}: {ATB_HEADER} returns {returns!r}, which this reader does not map"
    arguments = []
    aliases = iter("abcdefghijklmnopqrstuvwxyz")
    for raw in params.split(","):
        param = " ".join(raw.replace("&", "& ").split())
        ctype, _, name = param.rpartition(" ")
        ctype = ctype.replace(" &", "&").replace("& ", "&").strip()
        if "optional" in ctype:
            return (
                None,
                f"{spec.qualified}: {ATB_HEADER} declares {name} as {ctype} (no default is recorded there)",
            )
        mapped = CPP_TYPES.get(ctype)
        if mapped is None:
            return (
                None,
                f"{spec.qualified}: {ATB_HEADER} declares {name} as {ctype}, which this reader does not map",
            )
        if mapped == "Tensor(!)":
            mapped = f"Tensor({next(aliases)}!)"
        arguments.append(f"{mapped} {name}")
    schema = f"{spec.name}({', '.join(arguments)}) -> ()"
    return str(torch._C.parse_schema(f"{spec.namespace}::{schema}")), ""


def _alias(info: object) -> tuple[bool, list[str]] | None:
    if info is None:
        return None
    return bool(getattr(info, "is_write", False)), sorted(getattr(info, "before_set", ()))


def same_signature(a: str, b: str) -> list[str]:
    """Differences in names, order, types and mutability only (a header has no defaults)."""
    pa, pb = torch._C.parse_schema(a), torch._C.parse_schema(b)
    left = [(x.name, str(x.type), _alias(x.alias_info)) for x in pa.arguments]
    right = [(x.name, str(x.type), _alias(x.alias_info)) for x in pb.arguments]
    return [] if left == right else [f"{left} != {right}"]


# --- meta functions ---------------------------------------------------------------------------------

META_HEADER = '''"""The meta functions of torch-npu {version} ({wheel}), extracted by ci/npu_wheel_contract.py.

Generated at CI time from torch_npu/op_plugin/meta/_meta_registrations.py: the functions the
emulated operators register and the helpers they use; decorators dropped, torch_npu's own
imports replaced by the stand-ins below. Not part of diffusion-kv; never committed.
"""
# ruff: noqa
import math
import os
import warnings
from types import SimpleNamespace
from typing import Dict, List, Optional, Tuple

import torch


class _Codes:
    def __getattr__(self, name):
        return name


ErrCode = _Codes()


def ops_error(code):
    return f" [ERR {{code}}]"


def _unavailable(*args, **kwargs):
    raise RuntimeError("not available outside torch_npu")


get_cann_version = get_soc_version = _unavailable
has_side_effect = _unavailable
torch_npu = SimpleNamespace(**{dtypes!r})
'''

META_PROVIDED = {"math", "os", "warnings", "torch", "torch_npu", "ErrCode", "ops_error", "Dict", "List"}
META_PROVIDED |= {
    "Optional",
    "Tuple",
    "get_cann_version",
    "get_soc_version",
    "has_side_effect",
    "SimpleNamespace",
}


def _top_level_names(tree: ast.Module) -> dict[str, ast.stmt]:
    names: dict[str, ast.stmt] = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            names[node.name] = node
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    names[target.id] = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names[node.target.id] = node
    return names


def _registered_meta(tree: ast.Module) -> dict[str, str]:
    """``op name`` -> function name, for ``@impl(m, "op")`` decorated functions."""
    out: dict[str, str] = {}
    for node in tree.body:
        if not isinstance(node, ast.FunctionDef):
            continue
        for deco in node.decorator_list:
            if (
                isinstance(deco, ast.Call)
                and isinstance(deco.func, ast.Name)
                and deco.func.id == "impl"
                and len(deco.args) == 2
                and isinstance(deco.args[1], ast.Constant)
            ):
                out[str(deco.args[1].value)] = node.name
    return out


def _npu_dtype_codes(names: dict[str, ast.stmt]) -> dict[str, int]:
    """``torch_npu.<dtype>`` codes from the wheel's own table (``TORCH_NPU_DTYPE_TO_STRING_MAP``)."""
    node = names.get("TORCH_NPU_DTYPE_TO_STRING_MAP")
    table = ast.literal_eval(node.value) if isinstance(node, ast.Assign) else {}
    return {text.split(".", 1)[1]: code for code, text in table.items()}


def extract_meta(
    source: str, ops: list[str], version: str, wheel: str
) -> tuple[str, dict[str, str], list[str]]:
    """The meta module source for ``ops`` (bare op names), the op -> function map, and notes."""
    tree = ast.parse(source)
    names = _top_level_names(tree)
    registered = _registered_meta(tree)
    for node in tree.body:  # registration decorators are torch_npu's, not the shape rules
        if isinstance(node, ast.FunctionDef):
            node.decorator_list = []
    wanted = {op: registered[op] for op in ops if op in registered}
    notes = [f"{op}: no meta function in {META}" for op in ops if op not in registered]
    keep: set[str] = set()
    queue = list(wanted.values())
    unresolved: set[str] = set()
    while queue:
        name = queue.pop()
        if name in keep:
            continue
        keep.add(name)
        node = names[name]
        for sub in ast.walk(node):
            if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Load):
                if sub.id in names and sub.id not in keep:
                    queue.append(sub.id)
                elif sub.id not in names and sub.id not in META_PROVIDED and not hasattr(builtins, sub.id):
                    unresolved.add(sub.id)
    local = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    local |= {a.arg for n in ast.walk(tree) if isinstance(n, ast.arguments) for a in (*n.args, *n.kwonlyargs)}
    local |= {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.ClassDef)}
    missing = sorted(unresolved - local)
    if missing:
        raise Failure(f"the wheel's meta functions use names this reader does not provide: {missing}")
    body = []
    for node in tree.body:
        named = isinstance(node, ast.FunctionDef | ast.ClassDef) and node.name in keep
        assigned = isinstance(node, ast.Assign | ast.AnnAssign) and any(names.get(n) is node for n in keep)
        if named or assigned:
            body.append(ast.unparse(node))
    header = META_HEADER.format(version=version, wheel=wheel, dtypes=_npu_dtype_codes(names))
    return header + "\n\n" + "\n\n\n".join(body) + "\n", wanted, notes


# --- documented limits ---------------------------------------------------------------------------------


def doc_block(docs: str, op: str) -> str:
    marker = f'_add_torch_npu_docstr(\n    "{op}",'
    start = docs.find(marker)
    if start < 0:
        raise Failure(f"{DOCS} has no documentation block for {op}")
    end = docs.find("_add_torch_npu_docstr(", start + len(marker))
    return docs[start : end if end > 0 else len(docs)]


@dataclass(frozen=True)
class DocCheck:
    """One documented fact: a pattern in an operator's block and what the plugin expects of it."""

    what: str
    op: str
    pattern: str
    expect: Callable[[tuple[str, ...]], bool]
    expected: str


V1, V2, SCATTER = constraints.FIA_V1, constraints.FIA_V2, constraints.SCATTER


def _dtypes_are_bfloat16() -> bool:
    declared, emulated = set(constraints.DTYPES), set(emulator.TND_DTYPES)
    return declared == emulated == {torch.bfloat16}


DOC_CHECKS: tuple[DocCheck, ...] = (
    DocCheck(
        "TND dtype (v1)",
        V1,
        r"TND场景下query、key、value输入的综合限制:[^\n]*\n(?:[^\n]*\n){0,4}?数据类型仅支持(BFLOAT16)",
        lambda g: _dtypes_are_bfloat16(),
        "declared dtypes {bfloat16}; emulator TND dtypes (bfloat16,)",
    ),
    DocCheck(
        "TND dtype (v2)",
        V2,
        r"TND、TND_NTD、NTD_TND场景下[\s\S]{0,900}?数据类型仅支持(BFLOAT16)",
        lambda g: _dtypes_are_bfloat16(),
        "declared dtypes {bfloat16}",
    ),
    DocCheck(
        "TND head sizes (v2)",
        V2,
        r"TND场景\uff0c要求Q_D、K_D、V_D等于(\d+)\uff0c或者Q_D、K_D等于(\d+)\uff0cV_D等于(\d+)/(\d+)",
        lambda g: (
            {int(g[0]), int(g[1])} == set(constraints.HEAD_SIZES)
            and {(int(g[0]), int(g[0])), (int(g[1]), int(g[2])), (int(g[1]), int(g[3]))}
            == set(emulator.TND_HEAD_SIZES)
        ),
        f"declared head sizes {sorted(constraints.HEAD_SIZES)}; emulator pairs {list(emulator.TND_HEAD_SIZES)}",
    ),
    DocCheck(
        "TND head sizes (v1)",
        V1,
        r"TND场景下query、key、value输入的综合限制:[\s\S]{0,200}?Q_D、K_D等于(\d+), V_D等于(\d+)/(\d+)",
        lambda g: int(g[0]) in constraints.HEAD_SIZES,
        "192 among the declared head sizes (v1 lists no other)",
    ),
    DocCheck(
        "TND tokens per call (v1)",
        V1,
        r"TND场景下query、key、value输入的综合限制:\s*\nT小于等于(\d+);",
        lambda g: int(g[0]) == constraints.MAX_TOKENS_PER_CALL == emulator.TND_MAX_TOKENS["v1"],
        f"MAX_TOKENS_PER_CALL = {constraints.MAX_TOKENS_PER_CALL}",
    ),
    DocCheck(
        "TND tokens per call (v2)",
        V2,
        r"TND、TND_NTD、NTD_TND场景下query、key、value输入的综合限制\uff1a\s*\nT小于等于(\d+)M;",
        lambda g: int(g[0]) << 20 == constraints.MAX_TOKENS_PER_CALL_V2 == emulator.TND_MAX_TOKENS["v2"],
        f"MAX_TOKENS_PER_CALL_V2 = {constraints.MAX_TOKENS_PER_CALL_V2} (1M read as 2**20)",
    ),
    DocCheck(
        "TND sparse modes",
        V1,
        r"TND场景下query、key、value输入的综合限制:[\s\S]{0,300}?sparse模式仅支持sparse=(\d)且不传mask, 或sparse=(\d)且传入mask",
        lambda g: (int(g[0]), int(g[1])) == (0, 3) and {0, 3} <= set(emulator.TND_SPARSE_MODES),
        "full calls sparse_mode=0 without mask, causal calls sparse_mode=3 with the mask",
    ),
    DocCheck(
        "sparse_mode=3 row lengths (open point)",
        V1,
        r"当sparse=3时, 要求每个batch单独的actual_seq_lengths (<) actual_seq_lengths_kv",
        lambda g: g[0] == "<",
        "strict '<' in the text; equal lengths stay a first hardware check (docs/ascend.md)",
    ),
    DocCheck(
        "TND rows per call (v2)",
        V2,
        r"actual_seq_qlen和actual_seq_kvlen的元素个数不大于(\d+)",
        lambda g: int(g[0]) == constraints.MAX_ROWS_PER_CALL == emulator.MAX_BATCHES["v2"],
        f"MAX_ROWS_PER_CALL = {constraints.MAX_ROWS_PER_CALL}",
    ),
    DocCheck(
        "heads",
        V1,
        r"支持N轴小于等于(\d+), 支持D轴小于等于(\d+)",
        lambda g: int(g[0]) == constraints.MAX_HEADS and int(g[1]) == 512,
        f"MAX_HEADS = {constraints.MAX_HEADS}; head size <= 512 in the emulator",
    ),
    DocCheck(
        "GQA ratio",
        V1,
        r"num_heads与num_key_value_heads的比值不能大于(\d+)",
        lambda g: int(g[0]) == constraints.MAX_GQA_RATIO,
        f"MAX_GQA_RATIO = {constraints.MAX_GQA_RATIO}",
    ),
    DocCheck(
        "KV_N*D for (blocks, block_size, H) caches",
        V1,
        r"且KV_N\*D超过(\d+)时",
        lambda g: int(g[0]) == constraints.MAX_KV_HEADS_X_HEAD_SIZE,
        f"MAX_KV_HEADS_X_HEAD_SIZE = {constraints.MAX_KV_HEADS_X_HEAD_SIZE}",
    ),
    DocCheck(
        "page attention block size",
        V1,
        r"block_size最小为(\d+), 最大为(\d+), 且要求是(\d+)的倍数",
        lambda g: (
            int(g[0]) <= constraints.KERNEL_BLOCK_SIZE <= int(g[1])
            and constraints.KERNEL_BLOCK_SIZE % int(g[2]) == 0
        ),
        f"KERNEL_BLOCK_SIZE = {constraints.KERNEL_BLOCK_SIZE}",
    ),
    DocCheck(
        "head size alignment",
        V1,
        r"输入类型全为float16、bfloat16时, D轴需(\d+)对齐",
        lambda g: int(g[0]) == 16 and all(h % 16 == 0 for h in constraints.HEAD_SIZES),
        "16-aligned head sizes (emulator: d % 16)",
    ),
    DocCheck(
        "compressed mask",
        V1,
        r"sparse_mode为2、3、4时\uff0cshape输入支持\((\d+),(\d+)\)",
        lambda g: int(g[0]) == int(g[1]) == constraints.MASK_SIZE,
        f"MASK_SIZE = {constraints.MASK_SIZE}",
    ),
    DocCheck(
        "scatter slot range",
        SCATTER,
        r"slot_mapping的值范围\[(0),num_blocks\*block_size-1\]",
        lambda g: g[0] == "0",
        "slots in [0, blocks*block_size-1]: the plugin drops -1 slots, the emulator refuses them",
    ),
    DocCheck(
        "scatter cache_mode",
        SCATTER,
        r"当传None或'(Norm)'时\uff0c仅支持ND内存排布格式[\s\S]{0,80}?默认值为'(PA_NZ)'",
        lambda g: g == ("Norm", "PA_NZ"),
        "the plugin passes cache_mode='Norm' (the default is 'PA_NZ')",
    ),
)


def check_docs(docs: str) -> list[str]:
    failures = []
    for check in DOC_CHECKS:
        found = re.search(check.pattern, doc_block(docs, check.op))
        if found is None:
            failures.append(f"docs: {check.what}: the text of {check.op} no longer matches {check.pattern!r}")
            continue
        groups = found.groups()
        if check.expect(groups):
            log(f"  docs ok: {check.what}: {check.op} says {groups}; {check.expected}")
        else:
            failures.append(f"docs: {check.what}: {check.op} says {groups}; expected {check.expected}")
    return failures


# --- main -----------------------------------------------------------------------------------------


def version_of(wheel: Path) -> str:
    return wheel.name.split("-")[1]


def build_contract(wheel: Path, out: Path) -> list[str]:
    version = version_of(wheel)
    failures: list[str] = []
    with zipfile.ZipFile(wheel) as archive:
        members = set(archive.namelist())

        def read(name: str) -> bytes:
            if name not in members:
                raise Failure(f"{wheel.name} has no {name}")
            return archive.read(name)

        lib, atb = read(LIB), read(ATB_LIB)
        header = archive.read(ATB_HEADER).decode() if ATB_HEADER in members else ""
        meta_source, docs = read(META).decode(), read(DOCS).decode().replace("\r\n", "\n")
    schemas: dict[str, str] = {}
    sources: dict[str, str] = {}
    notes: list[str] = []
    for spec in emulator.EMULATED_OPS:
        if spec.namespace == "npu":
            schema = schema_from_binary(lib, spec)
            if schema is None:
                failures.append(f"{spec.qualified}: no schema string in {LIB}")
                continue
            schemas[spec.qualified], sources[spec.qualified] = schema, LIB
            continue
        binary = schema_from_binary(atb, spec)
        from_header, why = (
            schema_from_header(header, spec) if header else (None, f"{wheel.name} has no {ATB_HEADER}")
        )
        if binary is not None:
            schemas[spec.qualified], sources[spec.qualified] = binary, ATB_LIB
            if from_header is not None:
                diff = same_signature(binary, from_header)
                failures += [f"{spec.qualified}: {ATB_LIB} and {ATB_HEADER} disagree: {d}" for d in diff]
                if not diff:
                    log(f"  {spec.qualified}: the strings of {ATB_LIB} and {ATB_HEADER} agree")
            else:
                log(f"  {spec.qualified}: not cross-checked with {ATB_HEADER} ({why})")
        elif from_header is not None:
            schemas[spec.qualified], sources[spec.qualified] = from_header, ATB_HEADER
            notes.append(
                f"{spec.qualified}: schema from {ATB_HEADER} (the string in {ATB_LIB} is not recoverable)"
            )
        else:
            notes.append(f"{spec.qualified}: not bound: {why}")
    for qualified in sorted(schemas):
        log(f"  schema {qualified} <- {sources[qualified]}")
    meta_ops = sorted({q.split("::")[1] for q in schemas if q.startswith("npu::") and "." not in q})
    meta_text, meta_functions, meta_notes = extract_meta(meta_source, meta_ops, version, wheel.name)
    for op, function in sorted(meta_functions.items()):
        log(f"  meta npu::{op} <- {META}: {function}")
    notes += meta_notes
    out.mkdir(parents=True, exist_ok=True)
    (out / "wheel_meta.py").write_text(meta_text)
    compile(meta_text, str(out / "wheel_meta.py"), "exec")
    failures += check_docs(docs)
    contract = {
        "version": version,
        "wheel": wheel.name,
        "sha256": hashlib.sha256(wheel.read_bytes()).hexdigest(),
        "schemas": schemas,
        "sources": sources,
        "meta_module": "wheel_meta.py",
        "meta_functions": {f"npu::{op}": fn for op, fn in meta_functions.items()},
        "notes": notes,
    }
    (out / "contract.json").write_text(json.dumps(contract, indent=1, sort_keys=True))
    for note in notes:
        log(f"  note: {note}")
    return failures


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__)
        return 2
    wheel, out = Path(argv[0]), Path(argv[1])
    log(f"reading {wheel.name}")
    try:
        failures = build_contract(wheel, out)
    except Failure as exc:
        failures = [str(exc)]
    if failures:
        for failure in failures:
            log(f"FAIL {failure}")
        return 1
    log(f"contract for torch-npu {version_of(wheel)} written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
