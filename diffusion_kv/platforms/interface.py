"""The plugin contract: platforms (the unit of devices) and paged backends (the unit of kernels).

A **platform** (:class:`Platform`, entry-point group ``diffusion_kv.platforms``) detects its
device with a reason, initialises workers, names its ``torch.distributed`` backend and per-rank
device, and lists its paged backends. A **paged backend**
(:class:`~diffusion_kv.core.backend.PagedBackend`) owns the kernels: capabilities as data,
availability, BlockTables class, metadata building, K/V writing, attention and page layout.
Another distribution adds a backend to an existing platform through the entry-point group
``diffusion_kv.backends`` (the class names its ``platform`` and ``priority``).

Selection within a platform is one priority list per KV-cache group (xformers' fmha dispatch,
vLLM's backend priorities): the candidates are tried from the highest priority down, each
answers with *every* reason it cannot serve the requirements (unavailable here, capability,
the platform's own checks), the first with none wins, and when none qualifies one error shows
the requirements once and then every candidate with its reasons.
``DIFFUSION_KV_BACKEND=<platform>:<backend>`` forces one backend of that platform (its reasons
are then an error, never a silent fallback). A platform's capabilities are derived from its
backends, so they cannot disagree.

Vendor imports belong inside methods, never at module import time, so discovery stays cheap
and safe on every machine.

This module imports nothing from discovery (:mod:`~diffusion_kv.platforms.selection`): the
platform discovery constructs is handed its plugin set (:meth:`Platform.use_plugins`: the
backends other distributions add, the installed platform names, where a backend's failure is
recorded); a platform constructed directly reads the default one, which discovery registers
when it is imported (:func:`set_default_plugins`). Calls on backends run guarded
(:mod:`~diffusion_kv.platforms.isolation`).
"""

from __future__ import annotations

import abc
import os
from collections.abc import Callable, Sequence
from typing import ClassVar, Protocol

import torch

from diffusion_kv.core.backend import (
    BackendChoice,
    GroupContext,
    KVPageLayout,
    LayerRunner,
    PagedBackend,
    allocate_pages,
)
from diffusion_kv.core.batch import KVCache, LayerGeometry, PagedBatch
from diffusion_kv.core.capabilities import (
    AttentionMode,
    Availability,
    BlockSizeRule,
    Capabilities,
    MultipleOf,
    Requirements,
    capability_reasons,
)
from diffusion_kv.core.errors import ConfigurationError, UnsupportedRequirementsError, ValidationError
from diffusion_kv.core.host import HostRuntime, check_host
from diffusion_kv.platforms.isolation import BackendCallError, FailureReport, backend_call

__all__ = [
    "ENV_BACKEND",
    "AttentionMode",
    "Availability",
    "BlockSizeRule",
    "Capabilities",
    "GroupContext",
    "HostRuntime",
    "InstalledPlugins",
    "KVCache",
    "KVPageLayout",
    "LayerGeometry",
    "LayerRunner",
    "MultipleOf",
    "PagedBackend",
    "PagedBatch",
    "Platform",
    "Requirements",
    "allocate_pages",
    "capability_reasons",
    "forced_backend",
    "set_default_plugins",
]

ENV_BACKEND = "DIFFUSION_KV_BACKEND"
"""``<platform>:<backend>``: the default of the backend choice (``RunnerConfig.backend``)."""


class InstalledPlugins(FailureReport, Protocol):
    """What discovery hands a platform (:meth:`Platform.use_plugins`): the installed platforms'
    names, the backends other distributions add (entry-point group ``diffusion_kv.backends``),
    and where a failing backend is recorded. ``diffusion_kv.platforms.selection.PluginSet`` is
    the implementation."""

    namespace: str
    """The platforms' entry-point group."""

    @property
    def names(self) -> list[str]:
        """The installed platforms' names."""
        ...

    def backends_for(self, platform: str) -> list[type[PagedBackend]]:
        """The valid entry-point backends serving ``platform`` (one that failed is left out)."""
        ...

    def origin_of(self, backend: type[PagedBackend]) -> str | None:
        """The entry point and distribution that added ``backend``; None when none did."""
        ...


_default_plugins: Callable[[], InstalledPlugins] | None = None


def set_default_plugins(source: Callable[[], InstalledPlugins] | None) -> None:
    """Where a platform that discovery did not construct (``CpuPlatform()`` in a test or a
    script) finds its plugin set: discovery registers its ``discover`` when it is imported
    (``diffusion_kv.platforms`` imports it). None: such a platform has only its built-in
    backends."""
    global _default_plugins
    _default_plugins = source


def default_plugins() -> InstalledPlugins | None:
    """The plugin set a platform constructed directly uses (see :func:`set_default_plugins`)."""
    return _default_plugins() if _default_plugins is not None else None


def forced_backend(platform: str, plugins: InstalledPlugins | None = None) -> str | None:
    """The backend ``DIFFUSION_KV_BACKEND`` forces on ``platform`` (None: not set, or it names
    another installed platform); a malformed value, or one naming a platform that is not
    installed (in ``plugins``, default :func:`default_plugins`), is a :class:`ConfigurationError`."""
    forced = forced_setting()
    if forced is None:
        return None
    name, backend = forced
    if name == platform:
        return backend
    plugins = plugins if plugins is not None else default_plugins()
    if plugins is not None and name not in plugins.names:
        raise forced_platform_missing(name, plugins.namespace, plugins.names)
    return None


def forced_platform_missing(name: str, group: str, installed: Sequence[str]) -> ConfigurationError:
    """The error for ``DIFFUSION_KV_BACKEND`` naming platform ``name``, which is not installed."""
    return ConfigurationError(
        f"{ENV_BACKEND}={os.environ.get(ENV_BACKEND, '').strip()!r} names platform {name!r}, which is not "
        f"installed in group {group!r} (installed: {', '.join(installed) or 'none'}); expected "
        "<platform>:<backend>, e.g. cuda:triton"
    )


def forced_setting() -> tuple[str, str] | None:
    """``DIFFUSION_KV_BACKEND`` as ``(platform, backend)`` (None: not set); a malformed value is a
    :class:`ConfigurationError`."""
    raw = os.environ.get(ENV_BACKEND, "").strip()
    if not raw:
        return None
    name, sep, backend = raw.partition(":")
    if not sep or not name.strip() or not backend.strip():
        raise ConfigurationError(f"{ENV_BACKEND}={raw!r}; expected <platform>:<backend>, e.g. cuda:triton")
    return name.strip(), backend.strip()


def _check_requirements(requirements: object) -> Requirements:
    if not isinstance(requirements, Requirements):
        raise ValidationError(
            f"requirements must be a Requirements record; got {type(requirements).__name__}"
        )
    return requirements


def _check_backends(backends: object) -> tuple[type[PagedBackend], ...]:
    if isinstance(backends, (str, bytes)) or not isinstance(backends, (tuple, list)):
        raise ValidationError(
            f"compatible_with must be a sequence of PagedBackend classes; got {type(backends).__name__}"
        )
    bad = [b for b in backends if not (isinstance(b, type) and issubclass(b, PagedBackend))]
    if bad:
        raise ValidationError(f"compatible_with must hold PagedBackend classes; got {bad!r}")
    return tuple(backends)


def _block_tables_of(backend: type[PagedBackend], report: FailureReport | None) -> type:
    """``backend.block_tables_cls()``, guarded like every call on a plugin's backend."""
    return backend_call(
        backend,
        "block_tables_cls()",
        backend.block_tables_cls,
        lambda r: isinstance(r, type),
        "a class",
        report,
    )


class Platform(abc.ABC):
    """Base class of every platform plugin.

    Subclasses set the class attributes and implement :meth:`is_available`. Instances are
    created with no arguments by the selector; construction must be cheap and must not import
    vendor modules.
    """

    name: ClassVar[str]
    """Platform name; equals the entry-point name it is registered under."""
    description: ClassVar[str] = ""
    device_type: ClassVar[str]
    """The torch device type of its tensors (``cpu``, ``cuda``, ``npu``, a vendor's)."""
    default_block_size: ClassVar[int]
    is_reference: ClassVar[bool] = False
    """True for the pure-torch fallback; auto-selection prefers any available non-reference."""
    distributed_backend: ClassVar[str] = "gloo"
    """The ``torch.distributed`` backend of multi-rank runs (``nccl``, ``hccl``, ...)."""
    backends: ClassVar[tuple[type[PagedBackend], ...]] = ()
    """Built-in paged backends; entry-point backends for this platform join them by priority."""
    _plugins: InstalledPlugins | None = None

    # --- what discovery hands the platform ------------------------------------------------------

    def origin_of(self, backend: type[PagedBackend]) -> str:
        """Where ``backend`` comes from: ``built-in``, the entry point and distribution that
        added it (of this platform's plugin set), or a class given as the backend choice."""
        if backend in self.backends:
            return "built-in"
        plugins = self.plugins
        origin = plugins.origin_of(backend) if plugins is not None else None
        return origin if origin is not None else "a class given as the backend choice"

    def use_plugins(self, plugins: InstalledPlugins) -> None:
        """Hand the platform its plugin set: discovery does it for every platform it constructs
        (``get_platform``, ``discover().instance(name)``). The platform reads its added backends
        and the installed platform names from it, and records a failing backend there."""
        self._plugins = plugins

    @property
    def plugins(self) -> InstalledPlugins | None:
        """The plugin set handed to the platform, else the default one (:func:`default_plugins`:
        discovery's, for a platform constructed directly); None: neither exists."""
        return self._plugins if self._plugins is not None else default_plugins()

    # --- detection and devices ----------------------------------------------------------------

    @classmethod
    @abc.abstractmethod
    def is_available(cls) -> Availability:
        """Whether this platform can run on this machine, with the reason either way."""

    def device(self) -> torch.device:
        """The default device for this platform's tensors."""
        return torch.device(self.device_type)

    def device_for_rank(self, local_rank: int) -> torch.device:
        """The device of local rank ``local_rank`` in a multi-rank run."""
        if self.device_type == "cpu":
            return torch.device("cpu")
        return torch.device(self.device_type, local_rank)

    def init_worker(self, host: HostRuntime | None = None) -> None:
        """Worker initialisation: the ``prepare_worker`` of the backend the platform selects
        (with ``host``, the embedding host's runtime, when there is one). Platforms extend it
        through ``super()`` (fail fast on this machine first)."""
        backend = self.select_backend(Requirements(), host=check_host(host))
        backend.prepare_worker(host)

    # --- backends -------------------------------------------------------------------------------

    def candidate_backends(self) -> tuple[type[PagedBackend], ...]:
        """Every backend of this platform, highest priority first (built-ins and those other
        distributions add through ``diffusion_kv.backends``; ties keep built-ins first)."""
        plugins = self.plugins
        added = plugins.backends_for(self.name) if plugins is not None else []
        merged = [*self.backends, *added]
        return tuple(sorted(merged, key=lambda b: -b.priority))

    @property
    def capabilities(self) -> Capabilities:
        """What the platform's backends cover together (display and coarse checks)."""
        return Capabilities.union([b.capabilities for b in self.candidate_backends()])

    def backend_reasons(self, backend: type[PagedBackend], requirements: Requirements) -> list[str]:
        """Every reason ``backend`` cannot serve ``requirements`` here; extend for checks only
        the platform can make (an emulator). A backend whose ``is_available`` or
        ``not_supported_reasons`` raises (``SystemExit`` included) or answers with the wrong
        type is not served: that is its reason (an entry-point backend is also reported as
        broken and skipped from then on). What the backend needs of an embedding host is
        :meth:`host_reasons`; selection asks both."""
        report = self.plugins
        try:
            found = backend_call(
                backend,
                "is_available()",
                backend.is_available,
                lambda r: isinstance(r, Availability),
                "an Availability",
                report,
            )
            if not found:
                return [f"unavailable: {found.reason}"]
            return list(
                backend_call(
                    backend,
                    "not_supported_reasons()",
                    lambda: backend.not_supported_reasons(requirements),
                    lambda r: isinstance(r, list) and all(type(x) is str for x in r),
                    "a list of strings",
                    report,
                )
            )
        except BackendCallError as exc:
            return [f"broken: its {exc.what} {exc.problem}"]

    def host_reasons(self, backend: type[PagedBackend], host: HostRuntime | None) -> list[str]:
        """Every reason ``backend`` cannot serve with ``host`` (the embedding host's runtime;
        None: standalone): its ``host_reasons``, guarded like every call on a plugin's backend."""
        try:
            return list(
                backend_call(
                    backend,
                    "host_reasons()",
                    lambda: backend.host_reasons(check_host(host)),
                    lambda r: isinstance(r, list) and all(type(x) is str for x in r),
                    "a list of strings",
                    self.plugins,
                )
            )
        except BackendCallError as exc:
            return [f"broken: its {exc.what} {exc.problem}"]

    def not_supported_reasons(self, requirements: Requirements, host: HostRuntime | None = None) -> list[str]:
        """Empty when some backend serves ``requirements`` (with ``host``); else every backend's reasons."""
        candidates = self._candidates(_check_requirements(requirements), host=host)
        if any(not reasons for _, reasons in candidates):
            return []
        return [f"{b.name}: {r}" for b, reasons in candidates for r in reasons] or ["no paged backend"]

    def _forced(self, force: BackendChoice) -> tuple[str | type[PagedBackend], str] | None:
        """The backend to force and who forces it: ``force`` when given (a name or a class),
        else ``DIFFUSION_KV_BACKEND``'s choice for this platform (its default), else None."""
        if force is None:
            name = forced_backend(self.name, self.plugins)
            return (name, ENV_BACKEND) if name is not None else None
        if isinstance(force, str) and force.strip():
            return force.strip(), "the backend choice"
        if isinstance(force, type) and issubclass(force, PagedBackend):
            if not isinstance(getattr(force, "name", None), str):
                raise ValidationError(
                    f"a backend choice must be a concrete backend class with a name; {force.__name__} has none"
                )
            return force, "the backend choice"
        raise ValidationError(
            f"a backend choice is a backend name or a PagedBackend class; got {type(force).__name__} {force!r}"
        )

    def _candidates(
        self,
        requirements: Requirements,
        compatible_with: Sequence[type[PagedBackend]] = (),
        force: BackendChoice = None,
        host: HostRuntime | None = None,
    ) -> list[tuple[type[PagedBackend], list[str]]]:
        requirements = _check_requirements(requirements)
        host = check_host(host)
        compatible_with = _check_backends(compatible_with)
        forced = self._forced(force)
        candidates = self.candidate_backends()
        if forced is not None:
            choice, who = forced
            if isinstance(choice, str):
                named = [b for b in candidates if b.name == choice]
            else:
                named = [b for b in candidates if b is choice] or (
                    [choice] if choice.platform in ("", self.name) else []
                )
            if not named:
                label = choice if isinstance(choice, str) else f"{choice.__name__} ({choice.name!r})"
                raise ConfigurationError(
                    f"{who} forces backend {label!r} on platform {self.name!r}, which has "
                    f"{[b.name for b in candidates]}"
                )
            candidates = tuple(named)
        report = self.plugins
        out = []
        for backend in candidates:
            reasons = self.backend_reasons(backend, requirements) + self.host_reasons(backend, host)
            if not reasons or compatible_with:  # its BlockTables class is what a worker builds next
                try:
                    tables = _block_tables_of(backend, report)
                except BackendCallError as exc:
                    out.append((backend, [*reasons, f"broken: its {exc.what} {exc.problem}"]))
                    continue
            if compatible_with:
                other = compatible_with[0]
                if tables is not _block_tables_of(other, report):
                    reasons.append(
                        f"its BlockTables ({tables.__name__}) differs from the one "
                        f"KV-cache group 0's backend {other.name!r} uses ({_block_tables_of(other, report).__name__})"
                    )
                common = frozenset.intersection(
                    backend.capabilities.slot_mapping_dtypes,
                    *(b.capabilities.slot_mapping_dtypes for b in compatible_with),
                )
                if not common:
                    reasons.append("no slot-mapping dtype in common with the other KV-cache groups' backends")
            out.append((backend, reasons))
        return out

    def select_backend(
        self,
        requirements: Requirements,
        compatible_with: Sequence[type[PagedBackend]] = (),
        force: BackendChoice = None,
        host: HostRuntime | None = None,
    ) -> type[PagedBackend]:
        """The highest-priority backend serving ``requirements`` (and sharing BlockTables and a
        slot dtype with ``compatible_with``, the backends already chosen for other groups) with
        ``host`` (the embedding host's runtime; backends that declare ``needs_host`` are ruled
        out without one). ``force`` (a backend name or class) limits the candidates to that one;
        without it, ``DIFFUSION_KV_BACKEND`` does (the variable is only the default of the
        choice)."""
        candidates = self._candidates(requirements, compatible_with, force, host)
        for backend, reasons in candidates:
            if not reasons:
                return backend
        lines = [
            f"No paged backend of platform {self.name!r} supports the requested requirements:",
            f"  requirements: {requirements.describe()}",
        ]
        forced = self._forced(force)
        if forced is not None:
            lines.append(f"  ({forced[1]} limits the candidates to one)")
        for backend, reasons in candidates:
            lines.append(
                f"  `{self.name}:{backend.name}` (priority {backend.priority}) is not supported because:"
            )
            lines.extend(f"      {reason}" for reason in reasons)
        raise UnsupportedRequirementsError("\n".join(lines))

    def explain(
        self,
        requirements: Requirements | None = None,
        force: BackendChoice = None,
        host: HostRuntime | None = None,
    ) -> list[str]:
        """Every backend in priority order, with whether it would be chosen and why not."""
        req = _check_requirements(requirements) if requirements is not None else Requirements()
        try:
            candidates = self._candidates(req, (), force, host)
        except ConfigurationError as exc:
            return [f"{self.name}: {exc}"]
        chosen = next((b for b, reasons in candidates if not reasons), None)
        lines = [
            f"{self.name}: "
            + (f"selects backend {chosen.name!r}" if chosen else "no backend serves")
            + f" for {req.describe()}"
        ]
        forced = self._forced(force)
        if forced is not None:
            choice = forced[0] if isinstance(forced[0], str) else forced[0].name
            lines.append(f"  {forced[1]} forces {choice!r}")
        for backend, reasons in candidates:
            verdict = (
                "selected" if backend is chosen else ("supported" if not reasons else "; ".join(reasons))
            )
            description = f" — {backend.description}" if backend.description else ""
            origin = self.origin_of(backend)
            where = "" if origin == "built-in" else f" [{origin}]"
            lines.append(f"  [{backend.priority:>3}] {backend.name}{description}{where}: {verdict}")
        return lines
