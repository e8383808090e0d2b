"""``benchmarks/soak.py``'s text summary: one printer for the one-shot and the session soak, the
two differing only in the fields :class:`SummaryText` names."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

SOAK_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "soak.py"


@pytest.fixture(scope="module")
def soak() -> ModuleType:
    spec = importlib.util.spec_from_file_location("soak_under_test", SOAK_PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    return module


def common_summary(**extra: Any) -> dict[str, Any]:
    return {
        "wall_s": 12.4,
        "mismatches": 0,
        "max_abs_error": 9.26e-07,
        "rss_slope_mib_per_1000": -1.3184,
        "rss_mib_end": 250.84,
        "heap_slope_mib_per_1000": 0.13561,
        "heap_mib_end": 0.125,
        "step_ms_first_tenth": 66.2454,
        "step_ms_last_tenth": 49.8581,
        "step_time_ratio_last_over_first": 0.7526,
        **extra,
    }


def test_the_one_shot_summary(soak: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    result = soak.Soak(
        config={},
        summary=common_summary(
            outcomes={"finished": 336, "cancelled": 14}, checked_rows=1966, host_ms_per_request=11.1034
        ),
        end_state={
            "pool_used_blocks": 16,
            "pool_blocks": 128,
            "prefix_cache": {"evictions": 246},
            "maps": {"a": 0},
        },
        bounds={"missed": ["heap_slope 0.1356 > 0.05"]},
    )
    soak.print_summary(result, argparse.Namespace(requests=300, warmup=50), soak.ONE_SHOT_TEXT)
    assert capsys.readouterr().out == (
        "soak: 300 requests measured after 50 warm-up, 12 s wall\n"
        "  outcomes {'finished': 336, 'cancelled': 14}, 1966 rows checked against dense, 0 mismatches "
        "(max |err| 9.26e-07)\n"
        "  RSS slope -1.318 MiB/1000 (end 250.8 MiB), heap slope 0.1356 MiB/1000 (end 0.12 MiB)\n"
        "  host time per step: first tenth 66.245 ms, last tenth 49.858 ms (ratio 0.753); 11.103 ms per request\n"
        "  end: pool 16/128 used, prefix cache {'evictions': 246}, maps {'a': 0}\n"
        "  MISSED: heap_slope 0.1356 > 0.05\n"
    )


def test_the_session_summary_without_a_heap(soak: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    result = soak.Soak(
        config={},
        summary=common_summary(
            outcomes={"chunks_committed": 470},
            ticks=127,
            checked_chunk_rows=2463,
            host_ms_per_session=25.4612,
            heap_slope_mib_per_1000=None,
            heap_mib_end=0.0,
        ),
        end_state={"pool_used_blocks": 0, "pool_blocks": 64, "maps": {"b": 20}},
        bounds={"missed": []},
    )
    soak.print_summary(result, argparse.Namespace(sessions=100, warmup=20), soak.SESSION_TEXT)
    assert capsys.readouterr().out == (
        "session soak: 100 sessions measured after 20 warm-up, 12 s wall\n"
        "  {'chunks_committed': 470}, 127 ticks; 2463 chunk rows checked against dense, 0 mismatches "
        "(max |err| 9.26e-07)\n"
        "  RSS slope -1.318 MiB/1000 (end 250.8 MiB), heap slope n/a MiB/1000 (end 0.00 MiB)\n"
        "  host time per step: first tenth 66.245 ms, last tenth 49.858 ms (ratio 0.753); 25.461 ms per session\n"
        "  end: pool 0/64 used, maps {'b': 20}\n"
    )
