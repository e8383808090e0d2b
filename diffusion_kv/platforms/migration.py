"""The names the plugin API no longer has, and what replaces each.

A plugin written for the earlier plugin API fails to load with an import (or attribute) error on
one of these names; discovery then reports :func:`older_api_fix` as the fix: the name, its
replacement in one line, and where the whole table is. That table ships with the package, so an
installed copy shows it without the source tree::

    python -m diffusion_kv.platforms.migration

(``docs/migration.md`` in the source explains each replacement at length.) Importing this module
imports nothing but the standard library.
"""

from __future__ import annotations

import sys

MIGRATION_DOC = "docs/migration.md"
MIGRATION_COMMAND = "python -m diffusion_kv.platforms.migration"

_WRITE = (
    "gone: the core calls PagedBackend.write_kv(layer, key, value, kv_cache, slot_mapping) once per layer "
    "and forward, before attention (the default writes into the backend's page_layout)"
)
_BUILD = (
    "PagedBackend.build(batch): called once per batch and KV-cache group with a PagedBatch "
    "(diffusion_kv.core.batch); what it returns reaches forward as metadata"
)
_BACKEND = (
    "subclass PagedBackend (diffusion_kv.core.backend; re-exported by diffusion_kv): one instance per "
    "KV-cache group, __init__(self, group: GroupContext), forward(layer, query, kv_cache, metadata, out)"
)
_HOST = (
    "PagedWorker(platform, config, host=HostRuntime(config=vllm_config, attn_groups=..., "
    "kv_cache_config=...)) with HostRuntime from diffusion_kv.core.host; a backend reads GroupContext.host"
)

REPLACEMENTS: dict[str, str] = {
    "KVWritePolicy": _WRITE,
    "kv_write_policy": _WRITE,
    "MetadataBuilder": _BUILD,
    "metadata_builder": _BUILD,
    "PagedAttentionBackend": _BACKEND,
    "paged_backend": _BACKEND,
    "PartialAttentionBackend": (
        "PagedBackend.forward_partial(layer, query, kv_cache, metadata) with Capabilities(supports_dcp=True)"
    ),
    "REQUIRED_MEMBERS": "diffusion_kv.platforms.selection.PLATFORM_MEMBERS / BACKEND_MEMBERS",
    "REQUIRED_ATTRIBUTES": "diffusion_kv.platforms.selection.PLATFORM_MEMBERS / BACKEND_MEMBERS",
    "kv_cache_shape": (
        "PagedBackend.page_layout (KVPageLayout.COMBINED, SEPARATE or HEAD_FIRST); override "
        "allocate_kv_cache(layer) / bind_kv_cache(layer, cache) only for another layout"
    ),
    "backend_variants": (
        "Platform.backends (backend classes in priority order) and the diffusion_kv.backends entry-point "
        "group for backends shipped separately"
    ),
    "bind_vllm_runtime": _HOST,
    "bound_vllm_runtime": _HOST,
    "unbind_vllm_runtime": _HOST,
    "VllmRuntime": _HOST,
    "diffusion_kv.platforms.npu.runtime": _HOST,
    "NO_RUNTIME_REASON": (
        "diffusion_kv.integrations.vllm_ascend.backend.NO_HOST_REASON (vllm-ascend's wording) or "
        "diffusion_kv.core.host.NO_HOST_REASON"
    ),
    "is_vllm_native": "backend.uses_host_kernels (a class variable every PagedBackend declares)",
    "BlockTables": (
        "import it from diffusion_kv.core.block_tables; a backend names the class its metadata reads with "
        "the classmethod PagedBackend.block_tables_cls() (default: the core's TorchBlockTables) and gets "
        "the worker's instance as GroupContext.block_tables"
    ),
    "CacheLayout": (
        "import it from diffusion_kv.core.layout; a backend gets its group's geometry as GroupContext "
        "(layers, block sizes, num_blocks; the whole layout as GroupContext.layout)"
    ),
    "CommonBatchMetadata": (
        "a backend's build(batch) receives one KV-cache group's PagedBatch (diffusion_kv.core.batch, "
        "re-exported by diffusion_kv.platforms.interface); CommonBatchMetadata, the translator's record "
        "for every group, stays in diffusion_kv.core.batch and is not part of the backend contract"
    ),
}
"""Every removed (or no longer re-exported) name, with what replaces it."""

MOVED_FROM: dict[str, tuple[str, ...]] = {
    name: ("diffusion_kv.platforms.interface", "diffusion_kv.platforms")
    for name in ("BlockTables", "CacheLayout", "CommonBatchMetadata")
}
"""Names that still exist elsewhere and are missing only from these modules (they were imported
from there before): only a failure naming one of these modules is about them."""

REMOVED_NAMES: frozenset[str] = frozenset(REPLACEMENTS)


def _module_of(exc: BaseException) -> str | None:
    """The diffusion-kv module an import or attribute failure is about (None: not ours)."""
    if isinstance(exc, ImportError):
        name = exc.name or ""
        return name if name.startswith("diffusion_kv") else None
    if isinstance(exc, AttributeError):
        text = str(exc)
        if text.startswith("module '") and "diffusion_kv" in text:
            return text.split("'")[1]
        return "diffusion_kv" if "diffusion_kv" in text else None
    return None


def older_api_name(exc: BaseException) -> str | None:
    """The removed diffusion-kv name ``exc`` (an import or attribute failure) is about, if any."""
    module = _module_of(exc)
    if module is None:
        return None
    text = str(exc)
    for name in sorted(REMOVED_NAMES):
        if f"'{name}'" not in text:
            continue
        homes = MOVED_FROM.get(name)
        if homes is None or module in homes:
            return name
    return None


def older_api_fix(exc: BaseException) -> str | None:
    """The fix for a plugin failing on a removed name (None: ``exc`` is about none): one line
    naming the name, its replacement, and where every removed name is listed."""
    name = older_api_name(exc)
    if name is None:
        return None
    what = f"{name!r} is no longer in {_module_of(exc)}" if name in MOVED_FROM else f"{name!r} was removed"
    return (
        f"the plugin was written for an older diffusion-kv API ({what}): {REPLACEMENTS[name]}; every removed "
        f"name and its replacement: `{MIGRATION_COMMAND}` (or {MIGRATION_DOC} in the source)"
    )


def table() -> str:
    """Every removed name and its replacement, one per line."""
    width = max(len(n) for n in REPLACEMENTS)
    return "\n".join(
        f"{name:<{width}}  {fix}" for name, fix in sorted(REPLACEMENTS.items(), key=lambda kv: kv[0].lower())
    )


def main() -> int:
    print("diffusion-kv plugin API: removed names and their replacements (details: " + MIGRATION_DOC + ")")
    print(table())
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())


__all__ = [
    "MIGRATION_COMMAND",
    "MIGRATION_DOC",
    "MOVED_FROM",
    "REMOVED_NAMES",
    "REPLACEMENTS",
    "older_api_fix",
    "older_api_name",
    "table",
]
