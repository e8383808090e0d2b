"""The minimal plugin in docs/plugin-authors.md is the tested one, and stays minimal."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from diffusion_kv import Requirements
from diffusion_kv.platforms.selection import validate_platform_class

from .conftest import EXAMPLE

ROOT = Path(__file__).resolve().parents[2]
SOURCE = EXAMPLE / "dkv_toy" / "__init__.py"


def fenced_blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", text, flags=re.DOTALL)


def test_the_docs_show_the_tested_plugin_verbatim() -> None:
    docs = (ROOT / "docs" / "plugin-authors.md").read_text()
    assert SOURCE.read_text() in fenced_blocks(docs, "python")
    assert (EXAMPLE / "pyproject.toml").read_text() in fenced_blocks(docs, "toml")


def test_the_plugin_is_at_most_90_lines_with_its_pyproject() -> None:
    """Every line counts (blank lines, comments and the docstring included)."""
    total = len(SOURCE.read_text().splitlines()) + len((EXAMPLE / "pyproject.toml").read_text().splitlines())
    assert total <= 90, total
    docs = (ROOT / "docs" / "plugin-authors.md").read_text()
    assert f"({total} lines with its\npyproject)" in docs


def test_the_plugin_validates_and_splits_scheduler_blocks() -> None:
    from dkv_toy import ToyBackend, ToyPlatform

    assert validate_platform_class(ToyPlatform, "toy") == []
    toy = ToyPlatform()
    assert toy.select_backend(Requirements(dtype=torch.float16, head_size=128, block_size=128)) is ToyBackend
    assert ToyBackend.capabilities.kernel_block_size_for(128) == 64  # two kernel blocks per scheduler block
    with pytest.raises(Exception, match="block_size=96"):
        toy.select_backend(Requirements(block_size=96))
