"""Stand-ins for vLLM's internals, built from the signatures recorded from the released wheels.

``recorded_signatures.json`` is written by ``ci/record_vllm_signatures.py``, which reads every
supported release's wheel with ``ast`` (never importing vLLM). For each release it holds the
parameters of the functions the seam calls, the fields of the records it builds or reads
(``KVCacheTensor``, ``FullAttentionSpec``, ``CommonAttentionMetadata``, ...) and the members of the
classes it subclasses or drives.

:class:`Release` reads one release's facts; :class:`Recorder` is a resolver for
:class:`~diffusion_kv.integrations.vllm.compat.VllmCompat` whose stand-ins have exactly those
signatures and fields: a call that the real function would refuse raises the same ``TypeError``,
a record missing a required field cannot be built, and a symbol the release lacks raises
``ImportError``. Bodies do only what the seam observes, and every call is logged.
"""

from __future__ import annotations

import abc
import ast
import contextlib
import dataclasses
import functools
import inspect
import json
import math
import types
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

DATA_FILE = Path(__file__).with_name("recorded_signatures.json")


@functools.cache
def recorded_data() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DATA_FILE.read_text())
    return data


def release_keys() -> list[str]:
    """Every recorded release, as ``distribution==version``, oldest first."""
    return list(recorded_data()["releases"])


@dataclass(frozen=True)
class RecordedDefault:
    """A default value that is not a literal, kept as its source text."""

    source: str

    def __repr__(self) -> str:
        return self.source


def default_value(source: str) -> Any:
    try:
        return ast.literal_eval(source)
    except (ValueError, SyntaxError):
        return RecordedDefault(source)


def signature_of(parameters: list[dict[str, Any]]) -> inspect.Signature:
    return inspect.Signature(
        [
            inspect.Parameter(
                p["name"],
                getattr(inspect.Parameter, p["kind"]),
                default=default_value(p["default"]) if "default" in p else inspect.Parameter.empty,
            )
            for p in parameters
        ]
    )


def field_options(source: str | None) -> dict[str, Any]:
    """``dataclasses.field`` options for a recorded default (``field(...)`` calls understood)."""
    if source is None:
        return {}
    node = ast.parse(source, mode="eval").body
    if isinstance(node, ast.Call) and ast.unparse(node.func).rsplit(".", 1)[-1] in ("field", "Field"):
        options: dict[str, Any] = {}
        for kw in node.keywords:
            value = ast.unparse(kw.value)
            if kw.arg == "default":
                options.update(plain_default(value))
            elif kw.arg == "default_factory":
                options["default_factory"] = {"list": list, "dict": dict, "set": set}.get(
                    value, lambda value=value: RecordedDefault(f"{value}()")
                )
            elif kw.arg in ("init", "kw_only"):
                options[kw.arg] = ast.literal_eval(value)
        return options
    return plain_default(source)


def plain_default(source: str) -> dict[str, Any]:
    value = default_value(source)
    if isinstance(value, list | dict | set):
        return {"default_factory": lambda value=value: type(value)(value)}
    return {"default": value}


class Release:
    """The recorded facts of one release (``distribution==version``)."""

    def __init__(self, key: str) -> None:
        facts = recorded_data()["releases"][key]
        self.key = key
        self.distribution: str = facts["distribution"]
        self.version: str = facts["version"]
        self.symbols: dict[str, dict[str, Any]] = facts["symbols"]

    def __repr__(self) -> str:
        return f"Release({self.key})"

    @property
    def minor(self) -> int:
        return int(self.version.split(".")[1])

    def has(self, symbol: str) -> bool:
        return "absent" not in self.symbols[symbol]

    def facts(self, symbol: str) -> dict[str, Any]:
        facts = self.symbols[symbol]
        if "absent" in facts:
            raise KeyError(f"vLLM {self.key} has no {symbol}: {facts['absent']}")
        return facts

    def has_method(self, symbol: str, method: str) -> bool:
        return self.has(symbol) and method in self.facts(symbol)["methods"]

    def function(self, symbol: str, method: str | None = None) -> dict[str, Any]:
        facts = self.facts(symbol)
        return facts if method is None else dict(facts["methods"][method])

    def parameters(
        self, symbol: str, method: str | None = None, *, bound: bool = True
    ) -> list[dict[str, Any]]:
        """Parameters of a function, or of a method (without ``self``/``cls`` when ``bound``)."""
        fn = self.function(symbol, method)
        params = list(fn["parameters"])
        if method is not None and bound and "staticmethod" not in fn.get("decorators", []):
            params = params[1:]
        return params

    def signature(self, symbol: str, method: str | None = None, *, bound: bool = True) -> inspect.Signature:
        return signature_of(self.parameters(symbol, method, bound=bound))

    def accepted(self, symbol: str, method: str | None = None) -> set[str] | None:
        """Names a caller may pass by keyword (None: the function takes ``**kwargs``)."""
        params = self.parameters(symbol, method)
        if any(p["kind"] == "VAR_KEYWORD" for p in params):
            return None
        return {p["name"] for p in params if p["kind"] in ("POSITIONAL_OR_KEYWORD", "KEYWORD_ONLY")}

    def required(self, symbol: str, method: str | None = None) -> set[str]:
        return {
            p["name"]
            for p in self.parameters(symbol, method)
            if "default" not in p and p["kind"] not in ("VAR_POSITIONAL", "VAR_KEYWORD")
        }

    def field_names(self, symbol: str) -> list[str]:
        return [f["name"] for f in self.facts(symbol)["fields"]]

    def required_fields(self, symbol: str) -> set[str]:
        return {f["name"] for f in self.facts(symbol)["fields"] if "default" not in f}

    def members(self, symbol: str) -> list[str]:
        return list(self.facts(symbol)["class_attributes"])

    def record_type(self, symbol: str) -> type[Any]:
        """The recorded dataclass as a stand-in dataclass (fields, defaults, ``kw_only``,
        ``frozen``); constructing it checks the arguments as vLLM's would."""
        facts = self.facts(symbol)
        specs: list[tuple[str, Any, Any]] = []
        for f in facts["fields"]:
            options = field_options(f.get("default"))
            options.setdefault("kw_only", bool(f.get("kw_only")))
            specs.append((f["name"], Any, dataclasses.field(**options)))
        frozen = (facts.get("dataclass") or {}).get("frozen") == "True"
        return dataclasses.make_dataclass(symbol, specs, frozen=frozen)


@functools.cache
def release(key: str) -> Release:
    return Release(key)


def recorded_releases() -> list[Release]:
    return [release(key) for key in release_keys()]


# -- the resolver -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Call:
    """One call into a stand-in, as made (``args``/``kwargs``) and as bound (``arguments``)."""

    name: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    arguments: dict[str, Any]


BUILD_ATTN_METADATA_LOCALS: dict[str, Callable[[dict[str, Any], int], Any]] = {
    "block_table": lambda b, i: b["block_tables"][i],
    "slot_mapping": lambda b, i: b["slot_mappings"][i],
    "group_causal": lambda b, i: (
        b["causal"] if isinstance(b["causal"], bool | torch.Tensor) else b["causal"].get(i, True)
    ),
    "group_is_prefilling": lambda b, i: b["is_prefilling"],
    "token_to_req_indices": lambda b, i: None,
}
"""The locals a recorded ``build_attn_metadata`` fills ``CommonAttentionMetadata`` from."""


class Recorder:
    """A resolver for :class:`VllmCompat` returning stand-ins with one release's recorded facts.

    ``calls`` holds ``(name, bound arguments as passed)`` per call; ``raw`` the full
    :class:`Call` records; ``resolved`` the symbol keys asked for.
    """

    def __init__(self, key: str) -> None:
        self.release = release(key)
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.raw: list[Call] = []
        self.resolved: list[str] = []
        self.attn_backend: Any = "Backend"
        """What the ``get_attn_backend`` stand-in returns."""

    def __call__(self, key: str) -> Any:
        self.resolved.append(key)
        if not self.release.has(key):
            raise ImportError(f"cannot import name {key!r} (vLLM {self.release.key})")
        factory = getattr(self, f"make_{key}", None)
        if factory is None:
            raise AttributeError(f"no stand-in for {key!r}")
        return factory()

    # -- helpers ---------------------------------------------------------------------------------

    def log(
        self, name: str, sig: inspect.Signature, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> dict[str, Any]:
        """Bind as vLLM would (``TypeError`` otherwise), log, and return every argument."""
        bound = sig.bind(*args, **kwargs)
        self.calls.append((name, dict(bound.arguments)))
        self.raw.append(Call(name, args, dict(kwargs), dict(bound.arguments)))
        bound.apply_defaults()
        return dict(bound.arguments)

    def function(self, symbol: str, result: Callable[[dict[str, Any]], Any]) -> Callable[..., Any]:
        sig = self.release.signature(symbol)

        def fn(*args: Any, **kwargs: Any) -> Any:
            return result(self.log(symbol, sig, args, kwargs))

        fn.__signature__ = sig  # type: ignore[attr-defined]
        fn.__name__ = symbol
        return fn

    def method(self, symbol: str, method: str, result: Callable[..., Any] | None = None) -> Any:
        """A stand-in method with the recorded signature (``self``/``cls`` included)."""
        facts = self.release.function(symbol, method)
        sig = self.release.signature(symbol, method, bound=False)
        decorators = facts.get("decorators", [])

        def fn(*args: Any, **kwargs: Any) -> Any:
            arguments = self.log(f"{symbol}.{method}", sig, args, kwargs)
            return None if result is None else result(arguments)

        fn.__signature__ = sig  # type: ignore[attr-defined]
        fn.__name__ = method
        if "abstractmethod" in decorators:
            fn = abc.abstractmethod(fn)
        if "staticmethod" in decorators:
            return staticmethod(fn)
        if "classmethod" in decorators:
            return classmethod(fn)
        if "property" in decorators:
            return property(fn)
        return fn

    def stand_in_class(
        self, symbol: str, overrides: Mapping[str, Callable[..., Any] | None] | None = None
    ) -> type[Any]:
        """A class with every recorded public method (``overrides`` give results), its plain
        class attributes, and ABC semantics when the release's class has abstract methods."""
        facts = self.release.facts(symbol)
        results = dict(overrides or {})
        namespace: dict[str, Any] = {name: f"{symbol}.{name}" for name in facts["class_attributes"]}
        for f in facts["fields"]:  # annotated class attributes (of a non-dataclass) with defaults
            if "default" in f and not facts.get("dataclass"):
                namespace[f["name"]] = default_value(f["default"])
        for name in facts["methods"]:
            if name != "__init__":
                namespace[name] = self.method(symbol, name, results.get(name))
        abstract = any("abstractmethod" in m.get("decorators", []) for m in facts["methods"].values())
        if abstract:
            return abc.ABCMeta(symbol, (abc.ABC,), namespace)
        return type(symbol, (), namespace)

    # -- attn_utils ----------------------------------------------------------------------------

    def make_init_kv_cache(self) -> Callable[..., Any]:
        returns_dict = str(self.release.facts("init_kv_cache")["returns"]).startswith("dict")

        def allocate(bound: dict[str, Any]) -> Any:
            caches = {}
            for group in bound["kv_cache_config"].kv_cache_groups:
                for name in group.layer_names:
                    cache = torch.zeros(2, 4)
                    bound["forward_context"][name].kv_cache = cache
                    caches[name] = cache
            if "runner_kv_caches" in bound:
                bound["runner_kv_caches"].extend(caches.values())
            return caches if returns_dict else None

        return self.function("init_kv_cache", allocate)

    def make_get_block_table_width(self) -> Callable[..., Any]:
        def width(bound: dict[str, Any]) -> int:
            blocks, block_size = bound["max_num_blocks"], bound["block_size"]
            kernel = bound.get("kernel_block_size") or block_size
            alignment = bound["token_alignment"]
            if alignment is not None:
                step = alignment // math.gcd(alignment, block_size)
                blocks = -(-blocks // step) * step
            return int(blocks * block_size // kernel)

        return self.function("get_block_table_width", width)

    def make_build_attn_metadata(self) -> Callable[..., Any]:
        """Builds one ``CommonAttentionMetadata`` stand-in per KV-cache group from the keywords
        the release's own ``build_attn_metadata`` passes it, and maps each layer to it."""
        constructs = self.release.facts("build_attn_metadata")["constructs"]["CommonAttentionMetadata"]
        params = {p["name"] for p in self.release.parameters("build_attn_metadata")}
        record = self.release.record_type("CommonAttentionMetadata")

        def build(bound: dict[str, Any]) -> dict[str, Any]:
            out: dict[str, Any] = {}
            for i, group in enumerate(bound["kv_cache_config"].kv_cache_groups):
                values: dict[str, Any] = {}
                for field_name, source in constructs["keywords"].items():
                    if source in params:
                        values[field_name] = bound[source]
                    elif source in BUILD_ATTN_METADATA_LOCALS:
                        values[field_name] = BUILD_ATTN_METADATA_LOCALS[source](bound, i)
                    else:
                        raise AssertionError(
                            f"vLLM {self.release.key} build_attn_metadata fills {field_name} from "
                            f"{source!r}, which the stand-in does not model"
                        )
                metadata = record(**values)
                out.update(dict.fromkeys(group.layer_names, metadata))
            return out

        return self.function("build_attn_metadata", build)

    def make_init_attn_backend(self) -> Callable[..., Any]:
        forms = self.release.facts("init_attn_backend")["return_forms"]
        group_cls = self.make_AttentionGroup()

        def init(bound: dict[str, Any]) -> Any:
            config = bound["kv_cache_config"]
            if hasattr(config, "kv_cache_groups"):
                groups = [[group_cls(list(g.layer_names))] for g in config.kv_cache_groups]
                kernel = [
                    getattr(getattr(g, "kv_cache_spec", None), "block_size", 16)
                    for g in config.kv_cache_groups
                ]
            else:
                groups, kernel = [["group"]], [16]
            values = (groups, "cudagraph support", kernel)
            return values if forms == ["tuple/3"] else groups  # a changed return shows as a TypeError

        return self.function("init_attn_backend", init)

    def make_AttentionGroup(self) -> type[Any]:
        builder = types.SimpleNamespace(reorder_batch_threshold=None)
        cls = self.stand_in_class("AttentionGroup", {"get_metadata_builder": lambda bound: builder})

        def __init__(group: Any, layer_names: list[str]) -> None:
            group.layer_names = layer_names

        cls.__init__ = __init__
        return cls

    # -- BlockTables -----------------------------------------------------------------------------

    def make_BlockTables(self) -> type[Any]:
        recorder = self
        facts = self.release.facts("BlockTables")
        sig = self.release.signature("BlockTables", "__init__")
        attributes = facts["init_attributes"]
        base = self.stand_in_class("BlockTables")

        def __init__(tables: Any, *args: Any, **kwargs: Any) -> None:
            bound = recorder.log("BlockTables", sig, args, kwargs)
            for name in attributes:
                if name in bound:
                    setattr(tables, name, bound[name])
                elif name == "blocks_per_kv_block":
                    tables.blocks_per_kv_block = [
                        bs // kbs
                        for bs, kbs in zip(bound["block_sizes"], bound["kernel_block_sizes"], strict=True)
                    ]
                else:
                    setattr(tables, name, RecordedDefault(f"BlockTables.{name}"))

        base.__init__ = __init__
        return base

    # -- selection -------------------------------------------------------------------------------

    def make_get_attn_backend(self) -> Callable[..., Any]:
        return self.function("get_attn_backend", lambda bound: self.attn_backend)

    def make_set_current_vllm_config(self) -> Callable[..., Any]:
        sig = self.release.signature("set_current_vllm_config")

        @contextlib.contextmanager
        def set_current(*args: Any, **kwargs: Any) -> Iterator[None]:
            self.log("set_current_vllm_config", sig, args, kwargs)
            yield

        return set_current

    def make_AttentionBackendEnum(self) -> Any:
        return types.SimpleNamespace(
            **{m: f"AttentionBackendEnum.{m}" for m in self.release.members("AttentionBackendEnum")}
        )

    def make_AttentionType(self) -> Any:
        return types.SimpleNamespace(**{m: m.lower() for m in self.release.members("AttentionType")})

    def make_AttentionLayerBase(self) -> type[Any]:
        return self.stand_in_class("AttentionLayerBase")

    # -- records ---------------------------------------------------------------------------------

    def make_FullAttentionSpec(self) -> type[Any]:
        return self.release.record_type("FullAttentionSpec")

    def make_KVCacheConfig(self) -> type[Any]:
        return self.release.record_type("KVCacheConfig")

    def make_KVCacheGroupSpec(self) -> type[Any]:
        return self.release.record_type("KVCacheGroupSpec")

    def make_KVCacheTensor(self) -> type[Any]:
        return self.release.record_type("KVCacheTensor")

    # -- backends and impls (what the tier drives) -----------------------------------------------

    def backend_class(
        self, symbol: str, impl_symbol: str, *, name: str, flash_attn_version: int | None
    ) -> type[Any]:
        """A backend stand-in: recorded methods, ``get_impl_cls`` giving an impl stand-in whose
        constructor, ``forward`` and ``do_kv_cache_update`` have the recorded signatures."""
        impl = self.stand_in_class(impl_symbol)
        init_sig = self.release.signature(impl_symbol, "__init__")
        recorder = self

        def impl_init(obj: Any, *args: Any, **kwargs: Any) -> None:
            recorder.log(f"{impl_symbol}.__init__", init_sig, args, kwargs)
            if flash_attn_version is not None:
                obj.vllm_flash_attn_version = flash_attn_version

        impl.__init__ = impl_init
        overrides: dict[str, Callable[..., Any] | None] = {
            "get_impl_cls": lambda bound: impl,
            "get_name": lambda bound: name,
        }
        if self.release.has_method(symbol, "get_kv_cache_shape"):
            overrides["get_kv_cache_shape"] = lambda b: (
                b["num_blocks"],
                b["num_kv_heads"],
                b["block_size"],
                2 * b["head_size"],
            )
        if self.release.has_method(symbol, "get_kv_cache_stride_order"):
            overrides["get_kv_cache_stride_order"] = lambda b: (0, 2, 1, 3)
        if self.release.has_method(symbol, "supported_kv_cache_layouts"):
            forms = self.release.function(symbol, "supported_kv_cache_layouts")["return_forms"]
            layouts = None if forms == ["None"] else (types.SimpleNamespace(name="LBHNC"),)
            overrides["supported_kv_cache_layouts"] = lambda b: layouts
        return self.stand_in_class(symbol, overrides)
