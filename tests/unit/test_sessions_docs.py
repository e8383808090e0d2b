"""docs/sessions.md's example runs as written."""

from __future__ import annotations

import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "sessions.md"


def test_the_sessions_guide_example_runs() -> None:
    example = DOC.read_text().split("\n## Example\n", 1)[1]
    blocks = re.findall(r"```python\n(.*?)```", example, flags=re.S)
    assert len(blocks) == 1
    namespace: dict[str, object] = {}
    exec(compile(blocks[0], str(DOC), "exec"), namespace)
    pool, ctx_pool = namespace["pool"], namespace["ctx_pool"]
    assert pool.num_free == pool.num_total == 32  # type: ignore[attr-defined]
    assert ctx_pool.num_free == ctx_pool.num_total == 8  # type: ignore[attr-defined]
    assert namespace["session"].committed_tokens == 48  # type: ignore[attr-defined]
