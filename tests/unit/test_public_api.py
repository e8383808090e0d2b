"""The README's embedding example runs as written, on the public API only."""

from __future__ import annotations

import re
from pathlib import Path

import diffusion_kv

README = Path(__file__).resolve().parents[2] / "README.md"


def test_the_readme_embedding_example_runs() -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)
    (example,) = [b for b in blocks if "PagedWorker(" in b]
    namespace: dict[str, object] = {}
    exec(compile(example, str(README), "exec"), namespace)
    out = namespace["out"]
    assert tuple(out.shape) == (100, 8, 64)  # type: ignore[attr-defined]
    runner = namespace["runner"]
    assert runner.registry.rows == {}  # type: ignore[attr-defined]


def test_every_exported_name_exists() -> None:
    missing = [name for name in diffusion_kv.__all__ if not hasattr(diffusion_kv, name)]
    assert missing == []
    for name in (
        "PagedWorker",
        "RunnerConfig",
        "PagedLayerSpec",
        "RequestAllocation",
        "PhaseRows",
        "PagedRow",
        "AttentionMetadata",
        "PagedBackend",
        "Platform",
        "DiffusionKVAllocator",
    ):
        assert name in diffusion_kv.__all__


def test_renamed_classes_keep_their_old_names_for_a_release() -> None:
    from diffusion_kv.core.runtime import BatchStepper, PagedRuntime

    assert diffusion_kv.RunnerBackend is diffusion_kv.PagedWorker
    assert PagedRuntime is BatchStepper
