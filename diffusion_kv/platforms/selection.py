"""Plugin discovery (stevedore), load-time validation, detection and selection.

Rules, in order:

* ``DIFFUSION_KV_PLUGINS`` (comma list), when set, limits which entry points are loaded at all.
* Two entry points claiming one name are a :class:`DuplicatePlatformError` for that name;
  neither is loaded. Other plugins are unaffected.
* A plugin that fails to import or fails validation is recorded with its entry point, the
  exception and what to fix. Requesting it raises :class:`PluginLoadError`; automatic selection
  skips it with a :class:`PluginLoadWarning` (never silently).
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
import os
import warnings
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from importlib.metadata import EntryPoint
from typing import Any

from stevedore import ExtensionManager, NamedExtensionManager

from diffusion_kv.core.errors import (
    AmbiguousPlatformError,
    DuplicatePlatformError,
    PlatformError,
    PlatformNotFoundError,
    PlatformUnavailableError,
    PluginLoadError,
    UnsupportedRequirementsError,
)
from diffusion_kv.platforms.interface import (
    REQUIRED_MEMBERS,
    Availability,
    Capabilities,
    KVWritePolicy,
    Platform,
    Requirements,
)

ENTRY_POINT_GROUP = "diffusion_kv.platforms"
ENV_PLATFORM = "DIFFUSION_KV_PLATFORM"
ENV_PLUGINS = "DIFFUSION_KV_PLUGINS"
ENV_GROUP = "DIFFUSION_KV_ENTRY_POINT_GROUP"
REFERENCE_PLATFORM = "cpu"


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
    kv_write_policy: str | None
    default_block_size: int | None
    selected: bool
    error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


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


def _allowlist_from_env() -> frozenset[str] | None:
    raw = os.environ.get(ENV_PLUGINS)
    if raw is None or not raw.strip():
        return None
    return frozenset(part.strip() for part in raw.split(",") if part.strip())


def _signature_problems(cls: type, member: str) -> list[str]:
    base_attr = inspect.getattr_static(Platform, member)
    attr = inspect.getattr_static(cls, member, None)
    if attr is None:
        return [f"missing member {member!r}"]
    if isinstance(base_attr, classmethod) and not isinstance(attr, classmethod):
        return [f"{member!r} must be a classmethod (def {member}(cls) -> ...)"]
    if not isinstance(base_attr, classmethod) and isinstance(attr, (classmethod, staticmethod)):
        return [f"{member!r} must be an instance method"]
    try:
        base_sig = inspect.signature(getattr(Platform, member))
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
    """Every reason ``obj`` is not a valid platform plugin for ``entry_point_name``."""
    if not isinstance(obj, type) or not issubclass(obj, Platform):
        return [
            f"the entry point resolved to {obj!r}, which is not a subclass of "
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
    for member in REQUIRED_MEMBERS:
        if member in abstract:
            continue
        problems.extend(_signature_problems(obj, member))
    caps = getattr(obj, "capabilities", None)
    if not isinstance(caps, Capabilities):
        problems.append(f"capabilities must be a Capabilities instance; got {type(caps).__name__}")
    else:
        problems.extend(f"capabilities: {p}" for p in caps.problems())
    policy = getattr(obj, "kv_write_policy", None)
    if not isinstance(policy, KVWritePolicy):
        problems.append(f"kv_write_policy must be a KVWritePolicy; got {policy!r}")
    block = getattr(obj, "default_block_size", None)
    if type(block) is not int or block <= 0:
        problems.append(f"default_block_size must be a positive int; got {block!r}")
    elif isinstance(caps, Capabilities) and not caps.problems() and not caps.supports_block_size(block):
        problems.append(
            f"default_block_size={block} is not among its kernel_block_sizes "
            f"({', '.join(str(r) for r in caps.kernel_block_sizes)})"
        )
    if type(getattr(obj, "is_reference", False)) is not bool:
        problems.append("is_reference must be a bool")
    return problems


class PluginSet:
    """The plugins of one entry-point group, loaded once (see :func:`discover`)."""

    def __init__(self, namespace: str, allowlist: frozenset[str] | None) -> None:
        self.namespace = namespace
        self.allowlist = allowlist
        self.records: dict[str, PluginRecord] = {}
        self.not_installed: tuple[str, ...] = ()
        self._instances: dict[str, Platform] = {}
        self._load()

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

        listed = [ep for ep in all_eps if self.allowlist is None or ep.name in self.allowlist]
        counts = Counter(ep.name for ep in listed)
        if self.allowlist is not None:
            self.not_installed = tuple(sorted(self.allowlist - {ep.name for ep in all_eps}))
        for name, count in counts.items():
            if count > 1:
                eps = [ep for ep in listed if ep.name == name]
                shown = ", ".join(f"'{_format_entry_point(ep)}' ({_distribution_of(ep)})" for ep in eps)
                self.records[name] = PluginRecord(
                    name=name,
                    entry_points=tuple(_format_entry_point(ep) for ep in eps),
                    distributions=tuple(_distribution_of(ep) for ep in eps),
                    platform_cls=None,
                    error=DuplicatePlatformError(
                        f"platform name {name!r} is claimed by {count} entry points in group "
                        f"{self.namespace!r}: {shown}. Fix: uninstall one of the distributions, or "
                        f"rename one plugin (entry-point name and class attribute 'name')"
                    ),
                )
        unique = [ep for ep in listed if counts[ep.name] == 1]
        failures: dict[str, BaseException] = {}

        def on_failure(_mgr: object, ep: EntryPoint, exc: BaseException) -> None:
            failures[ep.name] = exc

        manager: NamedExtensionManager[Any] = NamedExtensionManager(
            self.namespace,
            names=[ep.name for ep in unique],
            on_load_failure_callback=on_failure,
            on_missing_entrypoints_callback=None,
        )
        loaded = {ext.name: ext.plugin for ext in manager.extensions}
        for ep in unique:
            text = _format_entry_point(ep)
            dist = _distribution_of(ep)
            error: PlatformError | None = None
            cls: type[Platform] | None = None
            if ep.name in failures:
                exc = failures[ep.name]
                error = PluginLoadError(
                    f"platform plugin {ep.name!r} (entry point '{text}', {dist}) failed to import: "
                    f"{type(exc).__name__}: {exc}. Fix: install what the plugin needs, or leave it out "
                    f"with {ENV_PLUGINS}=<names to load>"
                )
                error.__cause__ = exc
            elif ep.name in loaded:
                obj = loaded[ep.name]
                problems = validate_platform_class(obj, ep.name)
                if problems:
                    error = PluginLoadError(
                        f"platform plugin {ep.name!r} (entry point '{text}', {dist}) failed validation: "
                        + "; ".join(problems)
                        + ". Fix: make the class follow diffusion_kv.platforms.interface.Platform"
                    )
                else:
                    cls = obj
            else:  # pragma: no cover - stevedore skipped it without reporting a failure
                error = PluginLoadError(f"platform plugin {ep.name!r} ('{text}') was not loaded by stevedore")
            self.records[ep.name] = PluginRecord(ep.name, (text,), (dist,), cls, error)

    # -- queries -----------------------------------------------------------------------------

    @property
    def names(self) -> list[str]:
        return sorted(self.records)

    def instance(self, name: str) -> Platform:
        record = self.records[name]
        if record.error is not None:
            raise record.error
        assert record.platform_cls is not None
        if name not in self._instances:
            self._instances[name] = record.platform_cls()
        return self._instances[name]

    def availability(self, name: str) -> Availability:
        record = self.records[name]
        if record.error is not None:
            return Availability(False, f"not loaded: {record.error}")
        assert record.platform_cls is not None
        try:
            result = record.platform_cls.is_available()
        except Exception as exc:  # reported, never swallowed: it becomes the reason
            return Availability(False, f"detector raised {type(exc).__name__}: {exc}")
        if not isinstance(result, Availability):
            return Availability(False, f"detector returned {result!r}, not an Availability")
        return result

    def broken(self) -> list[PluginRecord]:
        return [r for r in self.records.values() if r.error is not None]


_CACHE: dict[tuple[str, frozenset[str] | None], PluginSet] = {}


def discover(namespace: str | None = None, allowlist: Iterable[str] | None = None) -> PluginSet:
    """Load (once) the plugins of ``namespace`` limited by ``allowlist`` or the env allowlist."""
    ns = namespace or os.environ.get(ENV_GROUP) or ENTRY_POINT_GROUP
    allow = frozenset(allowlist) if allowlist is not None else _allowlist_from_env()
    key = (ns, allow)
    if key not in _CACHE:
        _CACHE[key] = PluginSet(ns, allow)
    return _CACHE[key]


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
    plugins = discover(namespace)
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
    loaded = [n for n in plugins.names if plugins.records[n].loaded]
    availability = {n: plugins.availability(n) for n in loaded}
    accelerators = [
        n
        for n in loaded
        if availability[n] and not plugins.records[n].platform_cls.is_reference  # type: ignore[union-attr]
    ]
    if len(accelerators) > 1:
        raise AmbiguousPlatformError(
            f"several accelerator platforms are available: {', '.join(accelerators)}. Choose one with "
            f"{ENV_PLATFORM}=<name> or get_platform(name=...), or limit loading with {ENV_PLUGINS}"
        )
    if accelerators:
        chosen = accelerators[0]
        how = f"auto: the only available accelerator platform ({availability[chosen].reason})"
    else:
        if REFERENCE_PLATFORM not in plugins.records or not plugins.records[REFERENCE_PLATFORM].loaded:
            if REFERENCE_PLATFORM in plugins.records:
                raise plugins.records[REFERENCE_PLATFORM].error  # type: ignore[misc]
            raise PlatformNotFoundError(
                f"no accelerator platform is available and the reference platform {REFERENCE_PLATFORM!r} "
                f"is not loaded (installed: {', '.join(plugins.names) or 'none'}"
                + (f"; {ENV_PLUGINS}={','.join(sorted(plugins.allowlist))}" if plugins.allowlist else "")
                + ")"
            )
        chosen = REFERENCE_PLATFORM
        how = "auto: no accelerator platform is available, using the reference platform"
    platform = plugins.instance(chosen)
    if requirements is not None:
        reasons = platform.not_supported_reasons(requirements)
        if reasons:
            candidates = [(chosen, reasons)]
            for other in plugins.names:
                if other == chosen:
                    continue
                record = plugins.records[other]
                if record.error is not None:
                    candidates.append((other, [f"not loaded: {record.error}"]))
                elif not availability[other]:
                    candidates.append((other, [f"unavailable: {availability[other].reason}"]))
                else:
                    other_reasons = plugins.instance(other).not_supported_reasons(requirements)
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
        out.append(
            PlatformStatus(
                name=n,
                entry_point=record.entry_point,
                distribution=" | ".join(record.distributions),
                loaded=record.loaded,
                available=availability.available,
                reason=availability.reason,
                is_reference=bool(cls.is_reference) if cls else False,
                capabilities=cls.capabilities.summary() if cls else None,
                kv_write_policy=cls.kv_write_policy.value if cls else None,
                default_block_size=cls.default_block_size if cls else None,
                selected=(n == selected),
                error=str(record.error) if record.error is not None else None,
            )
        )
    return out
