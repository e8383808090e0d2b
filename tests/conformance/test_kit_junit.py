"""The GPU suite judges the kit by its exit status and JUnit XML counts (tests/kit_junit.py):
the counts are read exactly, and a kit run whose output says "0 failed" is not misread."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.kit_junit import JUnitCounts, junit_counts, run_kit


def test_a_kit_run_is_judged_by_its_exit_status_and_junit_counts(tmp_path: Path) -> None:
    run = run_kit("cpu", "sdpa", tmp_path / "kit.xml", "-k", "block_sizes or fp8_kv_cache_saturates")
    assert run.returncode == 0, run.tail
    assert run.counts == JUnitCounts(tests=4, failures=0, errors=0, skipped=1)
    assert run.counts.passed == 3
    # what the old substring check tripped on: the kit's own summary names "failed" on success
    assert "3 passed, 0 failed, 1 skipped" in run.output and " failed" in run.output


def test_a_failing_kit_run_shows_in_its_counts(tmp_path: Path) -> None:
    # a backend name the cpu platform lacks: every case errors in setup, pytest exits non-zero
    run = run_kit("cpu", "no-such-backend", tmp_path / "kit.xml", "-k", "block_sizes")
    assert run.returncode != 0
    assert run.counts.errors + run.counts.failures == run.counts.tests == 3
    assert run.counts.passed == 0


def test_counts_sum_over_every_suite(tmp_path: Path) -> None:
    report = tmp_path / "r.xml"
    report.write_text(
        '<?xml version="1.0"?><testsuites>'
        '<testsuite name="a" tests="5" failures="1" errors="0" skipped="2"/>'
        '<testsuite name="b" tests="4" failures="0" errors="1" skipped="0"/>'
        "</testsuites>"
    )
    assert junit_counts(report) == JUnitCounts(tests=9, failures=1, errors=1, skipped=2)
    assert junit_counts(report).passed == 5
    single = tmp_path / "s.xml"
    single.write_text('<testsuite name="p" tests="2" failures="0" errors="0" skipped="0"/>')
    assert junit_counts(single) == JUnitCounts(tests=2, failures=0, errors=0, skipped=0)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (None, "no JUnit XML report at"),
        ("<testsuites", "does not parse"),
        ("<testsuites></testsuites>", "holds no <testsuite> (root <testsuites>)"),
    ],
)
def test_a_missing_or_broken_report_is_an_error(tmp_path: Path, text: str | None, message: str) -> None:
    report = tmp_path / "r.xml"
    if text is not None:
        report.write_text(text)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        junit_counts(report)
