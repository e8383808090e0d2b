"""Plugin discovery (stevedore), load-time validation, detection and selection.

Rules, in order:

* ``DIFFUSION_KV_PLUGINS`` (comma list), when set, limits which *platform* entry points are
  loaded at all. It says nothing about backends: ``DIFFUSION_KV_BACKEND_PLUGINS`` (comma list)
  limits the entry points of the backends group, ``DIFFUSION_KV_BLOCKED_BACKENDS`` (comma list)
  leaves named ones out; neither kind is imported when left out. A backend entry point whose
  platform the platform allowlist leaves out is dropped quietly (it is listed as left out).
* Two entry points claiming one name are a :class:`DuplicatePlatformError` for that name;
  neither is loaded. Other plugins are unaffected. The exception: a built-in name (``cpu``,
  ``cuda``, ``npu``) claimed by another entry point keeps the built-in; the claimant is reported
  and skipped, so no installed distribution can disable a built-in platform.
* A plugin that fails in any way — its import raises anything (``SystemExit`` included), its
  class fails validation or raises while being inspected, its detector raises, its constructor
  raises — is recorded with its entry point, the exception and what to fix. Requesting it
  raises :class:`PluginLoadError`; automatic selection skips it with a
  :class:`PluginLoadWarning` (never silently). ``KeyboardInterrupt`` always propagates.
* Output a plugin prints to stdout while it is imported, detected or constructed is captured
  (machine-readable output stays valid) and reported as a warning on that plugin.
* An explicit name (argument, else ``DIFFUSION_KV_PLATFORM``) wins; an unknown name raises
  :class:`PlatformNotFoundError` listing the installed names.
* Otherwise every loaded plugin's detector runs: exactly one available non-reference
  (accelerator) plugin wins; none selects the reference ``cpu``; several raise
  :class:`AmbiguousPlatformError` naming them and how to choose.
* With requirements, the chosen platform's ``not_supported_reasons`` must be empty, else one
  :class:`UnsupportedRequirementsError` shows the requirements once and every candidate with
  all of its reasons.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import math
import os
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from importlib.metadata import EntryPoint
from typing import Any

import torch
from stevedore import ExtensionManager, NamedExtensionManager

from diffusion_kv.core.backend import KVPageLayout, PagedBackend
from diffusion_kv.core.errors import (
    AmbiguousPlatformError,
    DuplicatePlatformError,
    PlatformError,
    PlatformNotFoundError,
    PlatformUnavailableError,
    PluginLoadError,
    UnsupportedRequirementsError,
    ValidationError,
)
from diffusion_kv.platforms.interface import (
    Availability,
    Capabilities,
    Platform,
    Requirements,
    forced_platform_missing,
    forced_setting,
    set_default_plugins,
)
from diffusion_kv.platforms.isolation import (  # importable from here too (their earlier home)
    BackendCallError,
    PluginFailure,
    backend_call,
    guarded,
    printed_note,
    safe_repr,
)

ENTRY_POINT_GROUP = "diffusion_kv.platforms"
BACKEND_GROUP_SUFFIX = ".backends"
ENV_PLATFORM = "DIFFUSION_KV_PLATFORM"
ENV_PLUGINS = "DIFFUSION_KV_PLUGINS"
ENV_BACKEND_PLUGINS = "DIFFUSION_KV_BACKEND_PLUGINS"
ENV_BLOCKED_BACKENDS = "DIFFUSION_KV_BLOCKED_BACKENDS"
ENV_GROUP = "DIFFUSION_KV_ENTRY_POINT_GROUP"
REFERENCE_PLATFORM = "cpu"
BUILTIN_ENTRY_POINTS = {
    "cpu": "diffusion_kv.platforms.cpu:CpuPlatform",
    "cuda": "diffusion_kv.platforms.cuda:CudaPlatform",
    "npu": "diffusion_kv.platforms.npu:NpuPlatform",
}
"""The built-in platforms: their names cannot be taken over by another entry point."""


def _import_fix(failure: PluginFailure, default: str) -> str:
    """``default``, or, for a plugin importing a removed name, that name's replacement
    (:mod:`diffusion_kv.platforms.migration`)."""
    from diffusion_kv.platforms.migration import older_api_fix  # lazy: only a failing plugin needs it

    return older_api_fix(failure.original) or default


_printed_note = printed_note


class PluginLoadWarning(UserWarning):
    """A plugin could not be loaded; automatic selection went on without it."""


@dataclass(frozen=True)
class PluginRecord:
    """One discovered platform name: its entry point(s) and either a class or an error."""

    name: str
    entry_points: tuple[str, ...]
    distributions: tuple[str, ...]
    platform_cls: type[Platform] | None
    error: PlatformError | None
    notes: tuple[str, ...] = ()
    """Warnings about a plugin that still loaded (e.g. it printed at import)."""

    @property
    def entry_point(self) -> str:
        return " | ".join(self.entry_points)

    @property
    def loaded(self) -> bool:
        return self.platform_cls is not None


@dataclass(frozen=True)
class PlatformStatus:
    """What ``diffusion-kv platforms`` shows for one plugin."""

    name: str
    entry_point: str
    distribution: str
    loaded: bool
    available: bool
    reason: str
    is_reference: bool
    capabilities: dict[str, Any] | None
    default_block_size: int | None
    selected: bool
    error: str | None = None
    notes: tuple[str, ...] = field(default=())
    backends: tuple[dict[str, Any], ...] = field(default=())
    """Each backend in priority order: name, priority, source, available, reason."""
    distributed_backend: str | None = None
    description: str = ""
    """The platform class's ``description`` (empty when it failed to load or has none)."""

    def as_dict(self) -> dict[str, Any]:
        out = dict(self.__dict__)
        out["notes"] = list(self.notes)
        out["backends"] = [dict(b) for b in self.backends]
        return out


def _format_entry_point(ep: EntryPoint) -> str:
    return f"{ep.name} = {ep.value}"


def _distributions_by_entry_point(namespace: str) -> dict[tuple[str, str], str]:
    """``(name, value) -> "dist version"``; stevedore's cached entry points carry no dist."""
    out: dict[tuple[str, str], str] = {}
    for ep in importlib.metadata.entry_points(group=namespace):
        dist = getattr(ep, "dist", None)
        try:
            out[(ep.name, ep.value)] = (
                f"{dist.name} {dist.version}" if dist is not None else "unknown distribution"
            )
        except Exception:  # metadata of a broken install; the entry point is still reportable
            out[(ep.name, ep.value)] = "unknown distribution"
    return out


def _names_from_env(variable: str) -> frozenset[str] | None:
    raw = os.environ.get(variable)
    if raw is None or not raw.strip():
        return None
    return frozenset(part.strip() for part in raw.split(",") if part.strip())


def _name_list(value: Iterable[str], what: str) -> frozenset[str]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise ValidationError(f"{what} must be an iterable of entry-point names; got {value!r}")
    names = tuple(value)
    if any(type(n) is not str or not n.strip() for n in names):
        raise ValidationError(f"{what} must hold non-empty entry-point names; got {list(names)!r}")
    return frozenset(n.strip() for n in names)


PLATFORM_MEMBERS: tuple[str, ...] = ("is_available", "device", "device_for_rank", "backend_reasons")
"""Platform methods whose signatures load-time validation checks against the base class."""
BACKEND_MEMBERS: tuple[str, ...] = (
    "is_available",
    "not_supported_reasons",
    "block_tables_cls",
    "host_reasons",
    "prepare_worker",
    "allocate_kv_cache",
    "build",
    "write_kv",
    "forward",
    "forward_partial",
)
"""PagedBackend methods whose signatures load-time validation checks against the base class."""


def _signature_problems(cls: type, member: str, base: type = Platform) -> list[str]:
    base_attr = inspect.getattr_static(base, member)
    attr = inspect.getattr_static(cls, member, None)
    if attr is None:
        return [f"missing member {member!r}"]
    if isinstance(base_attr, classmethod) and not isinstance(attr, classmethod):
        return [f"{member!r} must be a classmethod (def {member}(cls) -> ...)"]
    if not isinstance(base_attr, classmethod) and isinstance(attr, (classmethod, staticmethod)):
        return [f"{member!r} must be an instance method"]
    try:
        base_sig = inspect.signature(getattr(base, member))
        sig = inspect.signature(getattr(cls, member))
    except (TypeError, ValueError) as exc:
        return [f"{member!r} has no inspectable signature: {exc}"]
    expected = list(base_sig.parameters.values())
    actual = list(sig.parameters.values())
    actual_names = {p.name for p in actual}
    expected_names = {p.name for p in expected}
    problems = [
        f"{member}{sig} lacks parameter {p.name!r}; expected {member}{base_sig}"
        for p in expected
        if p.name not in actual_names
    ]
    problems.extend(
        f"{member}{sig} has extra required parameter {p.name!r}; give it a default "
        f"(expected {member}{base_sig})"
        for p in actual
        if p.name not in expected_names
        and p.default is p.empty
        and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    )
    return problems


def validate_platform_class(obj: object, entry_point_name: str) -> list[str]:
    """Every reason ``obj`` is not a valid platform plugin for ``entry_point_name``; a class
    that raises while being inspected is reported, never propagated."""
    try:
        return _class_problems(obj, entry_point_name)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:
        return [f"inspecting the class raised {type(exc).__name__}: {safe_repr(exc, str)}"]


def _class_problems(obj: object, entry_point_name: str) -> list[str]:
    if not isinstance(obj, type) or not issubclass(obj, Platform):
        return [
            f"the entry point resolved to {safe_repr(obj)}, which is not a subclass of "
            "diffusion_kv.platforms.interface.Platform"
        ]
    problems: list[str] = []
    name = getattr(obj, "name", None)
    if name != entry_point_name:
        problems.append(
            f"class attribute name={name!r} differs from the entry-point name {entry_point_name!r}"
        )
    abstract = sorted(getattr(obj, "__abstractmethods__", ()))
    if abstract:
        problems.append(f"missing member(s) {', '.join(abstract)} (abstract in Platform)")
    for member in PLATFORM_MEMBERS:
        if member not in abstract:
            problems.extend(_signature_problems(obj, member))
    device_type = getattr(obj, "device_type", None)
    if type(device_type) is not str or not device_type:
        problems.append(f"device_type must be a non-empty string; got {device_type!r}")
    if type(getattr(obj, "distributed_backend", None)) is not str:
        problems.append("distributed_backend must be a string (e.g. 'gloo', 'nccl')")
    if type(getattr(obj, "is_reference", False)) is not bool:
        problems.append("is_reference must be a bool")
    backends = getattr(obj, "backends", None)
    if not isinstance(backends, tuple):
        problems.append(f"backends must be a tuple of PagedBackend classes; got {type(backends).__name__}")
        backends = ()
    for backend in backends:
        problems.extend(f"backend {safe_repr(backend)}: {p}" for p in validate_backend_class(backend))
    block = getattr(obj, "default_block_size", None)
    if type(block) is not int or block <= 0:
        problems.append(f"default_block_size must be a positive int; got {block!r}")
    elif backends and not problems and not any(b.capabilities.supports_block_size(block) for b in backends):
        problems.append(f"default_block_size={block} is served by none of its backends' kernel block sizes")
    return problems


def validate_backend_class(obj: object, entry_point_name: str | None = None) -> list[str]:
    """Every reason ``obj`` is not a valid paged backend (named ``entry_point_name`` when it
    comes from an entry point); a class that raises while inspected is reported."""
    try:
        return _backend_problems(obj, entry_point_name)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:
        return [f"inspecting the class raised {type(exc).__name__}: {safe_repr(exc, str)}"]


def _backend_problems(obj: object, entry_point_name: str | None) -> list[str]:
    if not isinstance(obj, type) or not issubclass(obj, PagedBackend):
        return [f"{safe_repr(obj)} is not a subclass of diffusion_kv.core.backend.PagedBackend"]
    problems: list[str] = []
    name = getattr(obj, "name", None)
    if type(name) is not str or not name or ":" in name:
        problems.append(f"name must be a non-empty string without ':'; got {name!r}")
    elif entry_point_name is not None and name != entry_point_name:
        problems.append(
            f"class attribute name={name!r} differs from the entry-point name {entry_point_name!r}"
        )
    if entry_point_name is not None and (type(obj.platform) is not str or not obj.platform):
        problems.append(
            "an entry-point backend must name the platform it serves (class attribute 'platform')"
        )
    if type(getattr(obj, "priority", None)) is not int:
        problems.append(f"priority must be an int; got {getattr(obj, 'priority', None)!r}")
    abstract = sorted(getattr(obj, "__abstractmethods__", ()))
    if abstract:
        problems.append(f"missing member(s) {', '.join(abstract)} (abstract in PagedBackend)")
    for member in BACKEND_MEMBERS:
        if member not in abstract:
            problems.extend(_signature_problems(obj, member, PagedBackend))
    caps = getattr(obj, "capabilities", None)
    if not isinstance(caps, Capabilities):
        problems.append(f"capabilities must be a Capabilities instance; got {type(caps).__name__}")
    else:
        problems.extend(f"capabilities: {p}" for p in caps.problems())
        if caps.supports_dcp and inspect.getattr_static(obj, "forward_partial") is inspect.getattr_static(
            PagedBackend, "forward_partial"
        ):
            problems.append("declares supports_dcp but does not implement forward_partial")
    if not isinstance(getattr(obj, "page_layout", None), KVPageLayout):
        problems.append(f"page_layout must be a KVPageLayout; got {getattr(obj, 'page_layout', None)!r}")
    tolerances = getattr(obj, "tolerances", None)
    if not isinstance(tolerances, Mapping) or not all(
        isinstance(dtype, torch.dtype)
        and isinstance(pair, tuple)
        and len(pair) == 2
        and all(isinstance(x, (int, float)) and not isinstance(x, bool) and 0 <= x < math.inf for x in pair)
        for dtype, pair in tolerances.items()
    ):
        problems.append(
            f"tolerances must map torch dtypes to (atol, rtol) pairs of finite numbers >= 0; got {tolerances!r}"
        )
    for flag in ("needs_host", "uses_host_kernels", "packed_query"):
        if type(getattr(obj, flag, None)) is not bool:
            problems.append(f"{flag} must be a bool; got {getattr(obj, flag, None)!r}")
    layouts = getattr(obj, "host_kv_cache_layouts", None)
    if layouts is not None and not (
        isinstance(layouts, tuple) and layouts and all(type(x) is str and x for x in layouts)
    ):
        problems.append(
            f"host_kv_cache_layouts must be None or a non-empty tuple of layout names; got {layouts!r}"
        )
    return problems


@dataclass(frozen=True)
class BackendRecord:
    """One entry point of the backends group: a valid class, or the error that rules it out."""

    name: str
    entry_point: str
    distribution: str
    backend_cls: type[PagedBackend] | None
    error: PlatformError | None
    notes: tuple[str, ...] = ()
    serves: str | None = None
    """The platform it names (also once it failed: its class is then dropped)."""

    @property
    def platform(self) -> str | None:
        return self.backend_cls.platform if self.backend_cls is not None else self.serves


class PluginSet:
    """The plugins of one entry-point group, loaded once (see :func:`discover`)."""

    def __init__(
        self,
        namespace: str,
        allowlist: frozenset[str] | None,
        backend_allowlist: frozenset[str] | None = None,
        blocked_backends: frozenset[str] = frozenset(),
    ) -> None:
        self.namespace = namespace
        self.allowlist = allowlist
        """Platform entry-point names to load (None: all)."""
        self.backend_allowlist = backend_allowlist
        """Backend entry-point names to load (None: all)."""
        self.blocked_backends = blocked_backends
        """Backend entry-point names never loaded."""
        self.left_out_backends: list[tuple[str, str]] = []
        """``(entry-point name, why)`` of backend entry points the lists above left out."""
        self.misplaced: tuple[str, ...] = ()
        """Names in the platform allowlist that are backend entry points, not platforms."""
        self.records: dict[str, PluginRecord] = {}
        self.shadowed: list[PluginRecord] = []
        """Entry points that claimed a built-in name: reported and skipped."""
        self.not_installed: tuple[str, ...] = ()
        self._instances: dict[str, Platform] = {}
        self._construct_errors: dict[str, PluginLoadError] = {}
        self._notes: dict[str, list[str]] = {}
        self.backend_records: list[BackendRecord] = []
        """Entry points of the backends group (``<platform group>.backends`` convention)."""
        self._load()
        self._load_backends()

    # -- loading -----------------------------------------------------------------------------

    def _load(self) -> None:
        # A manager with no names lists the group without importing anything.
        lister: NamedExtensionManager[Any] = NamedExtensionManager(
            self.namespace, names=[], on_missing_entrypoints_callback=None
        )
        all_eps = lister.list_entry_points()
        dists = _distributions_by_entry_point(self.namespace)

        def _distribution_of(ep: EntryPoint) -> str:
            return dists.get((ep.name, ep.value), "unknown distribution")

        listed: list[EntryPoint] = []
        for ep in all_eps:  # the same entry point seen twice (one distribution on two paths) is one
            if (self.allowlist is None or ep.name in self.allowlist) and all(
                (ep.name, ep.value) != (other.name, other.value) for other in listed
            ):
                listed.append(ep)
        if self.allowlist is not None:
            self.not_installed = tuple(sorted(self.allowlist - {ep.name for ep in all_eps}))
        by_name: dict[str, list[EntryPoint]] = {}
        for ep in listed:
            by_name.setdefault(ep.name, []).append(ep)
        for name, eps in by_name.items():
            builtin = [ep for ep in eps if ep.value == BUILTIN_ENTRY_POINTS.get(name)]
            if len(eps) > 1 and builtin:
                for ep in eps:
                    if ep is builtin[0]:
                        continue
                    self.shadowed.append(
                        PluginRecord(
                            name,
                            (_format_entry_point(ep),),
                            (_distribution_of(ep),),
                            None,
                            PluginLoadError(
                                f"entry point '{_format_entry_point(ep)}' ({_distribution_of(ep)}) claims the "
                                f"built-in platform name {name!r}; it was skipped and the built-in kept. Fix: "
                                "register the plugin under a name of its own, or add a backend to the built-in "
                                "platform instead"
                            ),
                        )
                    )
                eps = [builtin[0]]
            if len(eps) > 1:
                shown = ", ".join(f"'{_format_entry_point(ep)}' ({_distribution_of(ep)})" for ep in eps)
                self.records[name] = PluginRecord(
                    name=name,
                    entry_points=tuple(_format_entry_point(ep) for ep in eps),
                    distributions=tuple(_distribution_of(ep) for ep in eps),
                    platform_cls=None,
                    error=DuplicatePlatformError(
                        f"platform name {name!r} is claimed by {len(eps)} entry points in group "
                        f"{self.namespace!r}: {shown}. Fix: uninstall one of the distributions, or "
                        f"rename one plugin (entry-point name and class attribute 'name')"
                    ),
                )
                continue
            self.records[name] = self._load_one(eps[0], _distribution_of(eps[0]))

    @property
    def backend_namespace(self) -> str:
        base = self.namespace.removesuffix(".platforms")
        return base + BACKEND_GROUP_SUFFIX

    def _load_backends(self) -> None:
        namespace = self.backend_namespace
        lister: NamedExtensionManager[Any] = NamedExtensionManager(
            namespace, names=[], on_missing_entrypoints_callback=None
        )
        dists = _distributions_by_entry_point(namespace)
        seen: list[tuple[str, str]] = []
        entry_points = lister.list_entry_points()
        if self.allowlist is not None:
            self.misplaced = tuple(sorted({ep.name for ep in entry_points} & set(self.not_installed)))
        for ep in entry_points:
            if (ep.name, ep.value) in seen:
                continue
            seen.append((ep.name, ep.value))
            if ep.name in self.blocked_backends:
                self.left_out_backends.append((ep.name, f"named in {ENV_BLOCKED_BACKENDS}"))
                continue
            if self.backend_allowlist is not None and ep.name not in self.backend_allowlist:
                self.left_out_backends.append((ep.name, f"not named in {ENV_BACKEND_PLUGINS}"))
                continue
            text, dist = _format_entry_point(ep), dists.get((ep.name, ep.value), "unknown distribution")
            where = f"paged backend {ep.name!r} (entry point '{text}' in {namespace!r}, {dist})"
            try:
                obj, printed = guarded(ep.load)
            except PluginFailure as failure:
                error = PluginLoadError(
                    f"{where} failed to import: {failure}. Fix: "
                    + _import_fix(
                        failure,
                        f"install what it needs, or leave it out with {ENV_BLOCKED_BACKENDS}={ep.name}",
                    )
                )
                error.__cause__ = failure.original
                self.backend_records.append(BackendRecord(ep.name, text, dist, None, error))
                continue
            notes = tuple(n for n in (_printed_note(printed, "at import"),) if n)
            problems = validate_backend_class(obj, ep.name)
            if not problems and self.allowlist is not None and obj.platform not in self.allowlist:
                self.left_out_backends.append(
                    (ep.name, f"its platform {obj.platform!r} is not named in {ENV_PLUGINS}")
                )
                continue
            if not problems:
                platform = obj.platform
                record = self.records.get(platform)
                builtin = record.platform_cls.backends if record is not None and record.platform_cls else ()
                if record is None:
                    problems.append(f"no installed platform is named {platform!r}")
                elif any(b.name == obj.name for b in builtin) and obj not in builtin:
                    problems.append(
                        f"platform {platform!r} has a built-in backend named {obj.name!r}; the built-in is kept"
                    )
                elif any(
                    r.backend_cls is not None and r.platform == platform and r.name == ep.name
                    for r in self.backend_records
                ):
                    problems.append(
                        f"another entry point already adds a backend {ep.name!r} to platform {platform!r}"
                    )
            if problems:
                error = PluginLoadError(
                    f"{where} was skipped: "
                    + "; ".join(problems)
                    + ". Fix: make the class follow diffusion_kv.core.backend.PagedBackend"
                )
                self.backend_records.append(BackendRecord(ep.name, text, dist, None, error, notes))
            else:
                self.backend_records.append(
                    BackendRecord(ep.name, text, dist, obj, None, notes, obj.platform)
                )

    def backend_failed(self, backend: type[PagedBackend], error: BackendCallError, printed: str = "") -> None:
        """Record that a call on an entry-point backend failed: from now on it is reported (with
        its entry point and the fix) and skipped. Built-in backends have no record: the caller
        only turns their failure into a reason."""
        for index, record in enumerate(self.backend_records):
            if record.backend_cls is not backend:
                continue
            where = (
                f"paged backend {record.name!r} of platform {record.serves!r} (entry point "
                f"'{record.entry_point}' in {self.backend_namespace!r}, {record.distribution})"
            )
            fix = {
                "is_available()": "return Availability(False, reason) instead of raising or exiting",
                "not_supported_reasons()": "return a list of reason strings instead of raising or exiting",
                "block_tables_cls()": "return the BlockTables class without raising or exiting",
            }.get(error.what, "answer without raising or exiting")
            failure = PluginLoadError(
                f"{where} was skipped: its {error.what} {error.problem}. Fix: make {error.what} {fix}, "
                f"or leave the backend out with {ENV_BLOCKED_BACKENDS}={record.name}"
            )
            failure.__cause__ = error.__cause__
            note = _printed_note(printed, f"in its {error.what}")
            notes = record.notes + ((note,) if note else ())
            self.backend_records[index] = BackendRecord(
                record.name, record.entry_point, record.distribution, None, failure, notes, record.serves
            )
            warnings.warn(str(failure), PluginLoadWarning, stacklevel=4)

    def report_failure(self, backend: type[PagedBackend], error: BackendCallError, printed: str) -> None:
        """A call on ``backend`` failed (:func:`~diffusion_kv.platforms.isolation.backend_call`):
        recorded in this set and in every other loaded set that holds the backend."""
        for plugins in {id(p): p for p in (self, *_CACHE.values())}.values():
            plugins.backend_failed(backend, error, printed)

    def report_note(self, backend: type[PagedBackend], note: str | None) -> None:
        """A call on ``backend`` printed to stdout: noted like :meth:`report_failure`."""
        for plugins in {id(p): p for p in (self, *_CACHE.values())}.values():
            plugins.backend_note(backend, note)

    def backend_note(self, backend: type[PagedBackend], note: str | None) -> None:
        if not note:
            return
        for index, record in enumerate(self.backend_records):
            if record.backend_cls is backend and note not in record.notes:
                self.backend_records[index] = BackendRecord(
                    record.name,
                    record.entry_point,
                    record.distribution,
                    record.backend_cls,
                    record.error,
                    (*record.notes, note),
                    record.serves,
                )

    def broken_backends(self) -> list[BackendRecord]:
        """Entry-point backends that failed to load, to validate, or in a later call."""
        return [r for r in self.backend_records if r.error is not None]

    def origin_of(self, backend: type[PagedBackend]) -> str | None:
        """The entry point and distribution that added ``backend`` (None: none of this set)."""
        for record in self.backend_records:
            if record.backend_cls is backend:
                return f"entry point '{record.entry_point}', {record.distribution}"
        return None

    def backends_for(self, platform: str) -> list[type[PagedBackend]]:
        """The valid entry-point backends serving ``platform``."""
        return [
            r.backend_cls
            for r in self.backend_records
            if r.backend_cls is not None and r.platform == platform
        ]

    def _load_one(self, ep: EntryPoint, dist: str) -> PluginRecord:
        text = _format_entry_point(ep)
        where = f"platform plugin {ep.name!r} (entry point '{text}', {dist})"
        try:
            obj, printed = guarded(ep.load)
        except PluginFailure as failure:
            fix = _import_fix(
                failure, f"install what the plugin needs, or leave it out with {ENV_PLUGINS}=<names to load>"
            )
            error = PluginLoadError(f"{where} failed to import: {failure}. Fix: {fix}")
            error.__cause__ = failure.original
            return PluginRecord(ep.name, (text,), (dist,), None, error)
        note = _printed_note(printed, "at import")
        notes = (note,) if note else ()
        problems = validate_platform_class(obj, ep.name)
        if problems:
            error = PluginLoadError(
                f"{where} failed validation: "
                + "; ".join(problems)
                + ". Fix: make the class follow diffusion_kv.platforms.interface.Platform"
            )
            return PluginRecord(ep.name, (text,), (dist,), None, error, notes)
        return PluginRecord(ep.name, (text,), (dist,), obj, None, notes)

    # -- queries -----------------------------------------------------------------------------

    @property
    def names(self) -> list[str]:
        return sorted(self.records)

    def error_of(self, name: str) -> PlatformError | None:
        """Why ``name`` cannot be used (load, validation or construction), or None."""
        record = self.records[name]
        return record.error if record.error is not None else self._construct_errors.get(name)

    def notes_of(self, name: str) -> tuple[str, ...]:
        return self.records[name].notes + tuple(self._notes.get(name, ()))

    def _note(self, name: str, note: str | None) -> None:
        if note and note not in self._notes.setdefault(name, []):
            self._notes[name].append(note)

    def instance(self, name: str) -> Platform:
        """The plugin's one instance; a constructor that raises is recorded as its load error."""
        error = self.error_of(name)
        if error is not None:
            raise error
        record = self.records[name]
        assert record.platform_cls is not None
        if name not in self._instances:
            try:
                platform, printed = guarded(record.platform_cls)
            except PluginFailure as failure:
                err = PluginLoadError(
                    f"platform plugin {name!r} (entry point '{record.entry_point}') failed to construct: "
                    f"{failure}. Fix: make {record.platform_cls.__name__}() succeed with no arguments and "
                    "no vendor work (do that lazily), or leave it out with "
                    f"{ENV_PLUGINS}=<names to load>"
                )
                err.__cause__ = failure.original
                self._construct_errors[name] = err
                self._note(name, _printed_note(failure.printed, "while constructed"))
                raise err from failure.original
            self._note(name, _printed_note(printed, "while constructed"))
            platform.use_plugins(self)  # its added backends, the installed names: handed, not looked up
            self._instances[name] = platform
        return self._instances[name]

    def availability(self, name: str) -> Availability:
        """The detector's answer; whatever it raises (``SystemExit`` included) is the reason."""
        error = self.error_of(name)
        if error is not None:
            return Availability(False, f"not loaded: {error}")
        record = self.records[name]
        assert record.platform_cls is not None
        detector = record.platform_cls.is_available
        try:
            result, printed = guarded(detector)
        except PluginFailure as failure:
            printed = failure.printed
            result = Availability(False, f"detector raised {failure}")
        if not isinstance(result, Availability):
            result = Availability(False, f"detector returned {safe_repr(result)}, not an Availability")
        self._note(name, _printed_note(printed, "in its detector"))
        return result

    def broken(self) -> list[PluginRecord]:
        """Plugins that cannot be used, and entry points skipped for claiming a built-in name."""
        out = [r for r in self.records.values() if r.error is not None]
        out.extend(
            PluginRecord(r.name, r.entry_points, r.distributions, None, self._construct_errors[r.name])
            for r in self.records.values()
            if r.error is None and r.name in self._construct_errors
        )
        return (
            out
            + self.shadowed
            + [
                PluginRecord(r.name, (r.entry_point,), (r.distribution,), None, r.error)
                for r in self.backend_records
                if r.error is not None
            ]
        )


_CACHE: dict[tuple[str, frozenset[str] | None, frozenset[str] | None, frozenset[str]], PluginSet] = {}


def discover(
    namespace: str | None = None,
    allowlist: Iterable[str] | None = None,
    *,
    backend_allowlist: Iterable[str] | None = None,
    blocked_backends: Iterable[str] | None = None,
) -> PluginSet:
    """Load (once) the plugins of ``namespace``.

    ``allowlist`` limits the platform entry points (default ``DIFFUSION_KV_PLUGINS``),
    ``backend_allowlist`` the backend entry points (default ``DIFFUSION_KV_BACKEND_PLUGINS``),
    ``blocked_backends`` leaves backend entry points out (default
    ``DIFFUSION_KV_BLOCKED_BACKENDS``). ``None`` means "the environment's value, else no limit".
    """
    if namespace is not None and (type(namespace) is not str or not namespace):
        raise ValidationError(f"an entry-point group must be a non-empty string or None; got {namespace!r}")
    allow = (
        _name_list(allowlist, "a platform allowlist")
        if allowlist is not None
        else _names_from_env(ENV_PLUGINS)
    )
    backend_allow = (
        _name_list(backend_allowlist, "a backend allowlist")
        if backend_allowlist is not None
        else _names_from_env(ENV_BACKEND_PLUGINS)
    )
    blocked = (
        _name_list(blocked_backends, "a backend block list")
        if blocked_backends is not None
        else _names_from_env(ENV_BLOCKED_BACKENDS) or frozenset()
    )
    ns = namespace or os.environ.get(ENV_GROUP) or ENTRY_POINT_GROUP
    key = (ns, allow, backend_allow, blocked)
    if key not in _CACHE:
        plugins = PluginSet(ns, allow, backend_allow, blocked)
        _CACHE[key] = plugins
        if plugins.misplaced:
            warnings.warn(
                f"{ENV_PLUGINS} limits platforms only; {', '.join(map(repr, plugins.misplaced))} "
                f"name backend entry points (limit those with {ENV_BACKEND_PLUGINS}, or leave them "
                f"out with {ENV_BLOCKED_BACKENDS})",
                PluginLoadWarning,
                stacklevel=2,
            )
    return _CACHE[key]


def added_backends(platform: str) -> list[type[PagedBackend]]:
    """Backends other distributions add to ``platform`` (entry-point group ``*.backends``)."""
    return discover().backends_for(platform)


def backend_origin(platform: Platform, backend: type[PagedBackend], plugins: PluginSet | None = None) -> str:
    """Where ``platform``'s ``backend`` comes from: ``built-in``, the backend entry point and
    its distribution (of ``plugins``; default: the discovered set), or a class given as the
    backend choice."""
    if backend in platform.backends:
        return "built-in"
    origin = (plugins if plugins is not None else discover()).origin_of(backend)
    return origin if origin is not None else "a class given as the backend choice"


def refresh() -> None:
    """Forget loaded plugins and stevedore's in-process entry-point cache.

    Call after installing or removing a plugin distribution in a running process (tests).
    """
    _CACHE.clear()
    ExtensionManager.ENTRY_POINT_CACHE.clear()


def _unknown(name: str, plugins: PluginSet) -> PlatformNotFoundError:
    installed = ", ".join(plugins.names) or "none"
    limited = f" ({ENV_PLUGINS} limits loading to {sorted(plugins.allowlist)})" if plugins.allowlist else ""
    return PlatformNotFoundError(
        f"no platform named {name!r} is installed in group {plugins.namespace!r}; "
        f"installed: {installed}{limited}"
    )


def _unsupported(
    requirements: Requirements, candidates: list[tuple[str, list[str]]]
) -> UnsupportedRequirementsError:
    lines = ["No platform supports the requested requirements:", f"  requirements: {requirements.describe()}"]
    for name, reasons in candidates:
        lines.append(f"  `{name}` is not supported because:")
        lines.extend(f"      {reason}" for reason in reasons)
    return UnsupportedRequirementsError("\n".join(lines))


@dataclass(frozen=True)
class Selection:
    """The outcome of selection: the platform and how it was chosen."""

    platform: Platform
    how: str
    skipped: tuple[str, ...]


def select_platform(
    name: str | None = None,
    requirements: Requirements | None = None,
    *,
    namespace: str | None = None,
    warn: Callable[[str], None] | None = None,
) -> Selection:
    """Apply the selection rules (module docstring) and explain the choice."""
    if name is not None and (type(name) is not str or not name):
        raise ValidationError(f"a platform name must be a non-empty string or None; got {name!r}")
    if requirements is not None and not isinstance(requirements, Requirements):
        raise ValidationError(
            f"requirements must be a Requirements record or None; got {type(requirements).__name__}"
        )
    plugins = discover(namespace)
    forced = forced_setting()
    if forced is not None and forced[0] not in plugins.records:
        raise forced_platform_missing(forced[0], plugins.namespace, plugins.names)
    requested = name if name is not None else (os.environ.get(ENV_PLATFORM) or None)
    skipped = tuple(f"{r.name}: {r.error}" for r in plugins.broken())

    if requested is not None:
        if requested not in plugins.records:
            raise _unknown(requested, plugins)
        platform = plugins.instance(requested)  # raises the recorded load error
        found = plugins.availability(requested)
        if not found:
            raise PlatformUnavailableError(f"platform {requested!r} is not available here: {found.reason}")
        how = f"requested by {'argument' if name is not None else ENV_PLATFORM}"
        if requirements is not None:
            reasons = platform.not_supported_reasons(requirements)
            if reasons:
                raise _unsupported(requirements, [(requested, reasons)])
        return Selection(platform, how, skipped)

    emit = warn or (lambda message: warnings.warn(message, PluginLoadWarning, stacklevel=3))
    for record in plugins.broken():
        emit(str(record.error))
    loaded = [n for n in plugins.names if plugins.error_of(n) is None]
    availability = {n: plugins.availability(n) for n in loaded}
    accelerators = []
    for n in loaded:
        if not availability[n] or plugins.records[n].platform_cls.is_reference:  # type: ignore[union-attr]
            continue
        try:
            plugins.instance(n)
        except PluginLoadError as exc:  # an available plugin that cannot be built is skipped, loudly
            emit(str(exc))
            continue
        accelerators.append(n)
    if len(accelerators) > 1:
        raise AmbiguousPlatformError(
            f"several accelerator platforms are available: {', '.join(accelerators)}. Choose one with "
            f"{ENV_PLATFORM}=<name> or get_platform(name=...), or limit loading with {ENV_PLUGINS}"
        )
    if accelerators:
        chosen = accelerators[0]
        how = f"auto: the only available accelerator platform ({availability[chosen].reason})"
    else:
        if REFERENCE_PLATFORM not in plugins.records:
            raise PlatformNotFoundError(
                f"no accelerator platform is available and the reference platform {REFERENCE_PLATFORM!r} "
                f"is not loaded (installed: {', '.join(plugins.names) or 'none'}"
                + (f"; {ENV_PLUGINS}={','.join(sorted(plugins.allowlist))}" if plugins.allowlist else "")
                + ")"
            )
        chosen = REFERENCE_PLATFORM
        how = "auto: no accelerator platform is available, using the reference platform"
    platform = plugins.instance(chosen)  # raises the reference's own load error, if any
    skipped = tuple(f"{r.name}: {r.error}" for r in plugins.broken())
    if requirements is not None:
        reasons = platform.not_supported_reasons(requirements)
        if reasons:
            candidates = [(chosen, reasons)]
            for other in plugins.names:
                if other == chosen:
                    continue
                error = plugins.error_of(other)
                if error is not None:
                    candidates.append((other, [f"not loaded: {error}"]))
                elif not availability[other]:
                    candidates.append((other, [f"unavailable: {availability[other].reason}"]))
                else:
                    try:
                        other_reasons = plugins.instance(other).not_supported_reasons(requirements)
                    except PluginLoadError as exc:
                        other_reasons = [f"not loaded: {exc}"]
                    candidates.append((other, other_reasons or ["not selected automatically: " + how]))
            raise _unsupported(requirements, candidates)
    return Selection(platform, how, skipped)


def get_platform(
    name: str | None = None,
    requirements: Requirements | None = None,
    *,
    namespace: str | None = None,
) -> Platform:
    """The platform to use: see the module docstring for the rules."""
    return select_platform(name, requirements, namespace=namespace).platform


def available_platforms(*, namespace: str | None = None) -> list[PlatformStatus]:
    """Status of every installed plugin (loaded or not), and which one would be selected."""
    plugins = discover(namespace)
    try:
        selected: str | None = select_platform(namespace=namespace, warn=lambda _m: None).platform.name
    except PlatformError:
        selected = None
    out = []
    for n in plugins.names:
        record = plugins.records[n]
        availability = plugins.availability(n)
        cls = record.platform_cls
        capabilities: dict[str, Any] | None = None
        backends: list[dict[str, Any]] = []
        if plugins.error_of(n) is None:
            try:
                platform = plugins.instance(n)
                capabilities = platform.capabilities.summary()
                builtin = set(type(platform).backends)
                for b in platform.candidate_backends():
                    try:  # a backend that raises is listed with why, and reported as broken
                        found = backend_call(
                            b,
                            "is_available()",
                            b.is_available,
                            lambda r: isinstance(r, Availability),
                            "an Availability",
                            plugins,
                        )
                        if found:  # what selection asks next: a backend raising there is broken too
                            backend_call(
                                b,
                                "not_supported_reasons()",
                                lambda b=b: b.not_supported_reasons(Requirements()),  # type: ignore[misc]
                                lambda r: isinstance(r, list) and all(type(x) is str for x in r),
                                "a list of strings",
                                plugins,
                            )
                            backend_call(
                                b,
                                "block_tables_cls()",
                                b.block_tables_cls,
                                lambda r: isinstance(r, type),
                                "a class",
                                plugins,
                            )
                    except BackendCallError as exc:
                        found = Availability(False, f"broken: its {exc.what} {exc.problem}")
                    backends.append(
                        {
                            "name": b.name,
                            "priority": b.priority,
                            "source": "built-in" if b in builtin else backend_origin(platform, b, plugins),
                            "available": found.available,
                            "reason": found.reason,
                        }
                    )
            except PluginLoadError:
                pass  # recorded as the plugin's error below
        error = plugins.error_of(n)
        out.append(
            PlatformStatus(
                name=n,
                entry_point=record.entry_point,
                distribution=" | ".join(record.distributions),
                loaded=record.loaded,
                available=availability.available,
                reason=availability.reason,
                is_reference=bool(cls.is_reference) if cls else False,
                capabilities=capabilities,
                default_block_size=cls.default_block_size if cls else None,
                selected=(n == selected),
                error=str(error) if error is not None else None,
                notes=plugins.notes_of(n),
                backends=tuple(backends),
                distributed_backend=cls.distributed_backend if cls else None,
                description=str(getattr(cls, "description", "") or "") if cls else "",
            )
        )
    return out


set_default_plugins(discover)  # what a platform constructed directly (not by discovery) reads
