"""A plugin written for the earlier plugin API is told so, with the migration page as the fix."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from diffusion_kv.platforms import selection
from diffusion_kv.platforms.selection import REMOVED_NAMES, PluginFailure, _import_fix, older_api_name

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
        f"the plugin was written for an older diffusion-kv API ({name!r} was removed); port it with "
        "docs/migration.md, which maps every removed name to its replacement"
    )


def test_other_import_failures_keep_their_fix() -> None:
    assert _import_fix(failure_of("import dkv_not_installed_anywhere"), "install it") == "install it"
    assert (
        _import_fix(failure_of("from diffusion_kv.platforms.interface import Nope"), "install it")
        == "install it"
    )


def test_the_migration_page_maps_every_removed_name() -> None:
    text = (ROOT / selection.MIGRATION_DOC).read_text()
    rows = "\n".join(line for line in text.splitlines() if line.startswith("| `"))
    mapped = set(re.findall(r"`(?:Platform\.)?([A-Za-z_]+)[`(]", rows))
    mapped |= set(re.findall(r"`(diffusion_kv\.[A-Za-z_.]+)`", rows))  # removed modules
    assert mapped >= REMOVED_NAMES, sorted(REMOVED_NAMES - mapped)
