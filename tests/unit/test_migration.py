"""A plugin written for the earlier plugin API is told so: the removed name, its replacement, and
where every removed name is listed (a command an installed copy runs, and the source's page)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from diffusion_kv.platforms import migration
from diffusion_kv.platforms.migration import MOVED_FROM, REMOVED_NAMES, REPLACEMENTS, older_api_name
from diffusion_kv.platforms.selection import PluginFailure, _import_fix

ROOT = Path(__file__).resolve().parents[2]


def failure_of(source: str) -> PluginFailure:
    try:
        exec(source, {})
    except Exception as exc:
        return PluginFailure(exc, "")
    pytest.fail(f"{source!r} did not fail")


@pytest.mark.parametrize(
    ("source", "name"),
    [
        ("from diffusion_kv.platforms.interface import KVWritePolicy", "KVWritePolicy"),
        ("from diffusion_kv.platforms.interface import MetadataBuilder", "MetadataBuilder"),
        ("import diffusion_kv.platforms.interface as i; i.PagedAttentionBackend", "PagedAttentionBackend"),
        ("from diffusion_kv.platforms.npu import NO_RUNTIME_REASON", "NO_RUNTIME_REASON"),
        ("from diffusion_kv.platforms.npu.runtime import VllmRuntime", "diffusion_kv.platforms.npu.runtime"),
        ("from diffusion_kv.integrations.vllm_omni.hooks import is_vllm_native", "is_vllm_native"),
    ],
)
def test_a_removed_name_points_at_the_migration_page(source: str, name: str) -> None:
    failure = failure_of(source)
    assert older_api_name(failure.original) == name
    assert _import_fix(failure, "install it") == (
        f"the plugin was written for an older diffusion-kv API ({name!r} was removed): {REPLACEMENTS[name]}; "
        "every removed name and its replacement: `python -m diffusion_kv.platforms.migration` (or "
        "docs/migration.md in the source)"
    )


@pytest.mark.parametrize(
    ("source", "name", "module"),
    [
        (
            "from diffusion_kv.platforms.interface import BlockTables",
            "BlockTables",
            "diffusion_kv.platforms.interface",
        ),
        (
            "from diffusion_kv.platforms.interface import CacheLayout",
            "CacheLayout",
            "diffusion_kv.platforms.interface",
        ),
        (
            "from diffusion_kv.platforms.interface import CommonBatchMetadata",
            "CommonBatchMetadata",
            "diffusion_kv.platforms.interface",
        ),
        ("import diffusion_kv.platforms as p; p.CacheLayout", "CacheLayout", "diffusion_kv.platforms"),
    ],
)
def test_a_name_the_interface_no_longer_exports_says_where_it_went(
    source: str, name: str, module: str
) -> None:
    fix = _import_fix(failure_of(source), "install it")
    assert fix == (
        f"the plugin was written for an older diffusion-kv API ({name!r} is no longer in {module}): "
        f"{REPLACEMENTS[name]}; every removed name and its replacement: `python -m "
        "diffusion_kv.platforms.migration` (or docs/migration.md in the source)"
    )
    assert "\n" not in fix


def test_a_moved_name_failing_elsewhere_keeps_the_fix() -> None:
    """BlockTables still exists in the core: a failure about it in another module is not about
    the older API."""
    assert MOVED_FROM["BlockTables"] == ("diffusion_kv.platforms.interface", "diffusion_kv.platforms")
    failure = failure_of("from diffusion_kv.core.layout import BlockTables")
    assert older_api_name(failure.original) is None
    assert _import_fix(failure, "install it") == "install it"


def test_the_table_ships_with_the_package() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "diffusion_kv.platforms.migration"], capture_output=True, text=True, check=True
    )
    assert proc.stderr == ""
    lines = proc.stdout.splitlines()
    assert lines[0] == (
        "diffusion-kv plugin API: removed names and their replacements (details: docs/migration.md)"
    )
    assert len(lines) == 1 + len(REPLACEMENTS)
    assert lines[1:] == migration.table().splitlines()
    assert any(line.startswith("BlockTables ") and "diffusion_kv.core.block_tables" in line for line in lines)


def test_other_import_failures_keep_their_fix() -> None:
    assert _import_fix(failure_of("import dkv_not_installed_anywhere"), "install it") == "install it"
    assert (
        _import_fix(failure_of("from diffusion_kv.platforms.interface import Nope"), "install it")
        == "install it"
    )


def test_the_migration_page_maps_every_removed_name() -> None:
    text = (ROOT / migration.MIGRATION_DOC).read_text()
    rows = "\n".join(line for line in text.splitlines() if line.startswith("| `"))
    mapped = set(re.findall(r"`(?:Platform\.)?([A-Za-z_]+)[`(]", rows))
    mapped |= set(re.findall(r"`(diffusion_kv\.[A-Za-z_.]+)`", rows))  # removed modules
    assert mapped >= REMOVED_NAMES, sorted(REMOVED_NAMES - mapped)
