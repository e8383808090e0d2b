"""Run the conformance kit in a child pytest and judge it by its exit status and the counts of
its JUnit XML report (``--junitxml``), never by words in its terminal output (the kit prints
lines such as ``9 passed, 0 failed, 0 skipped`` that a substring check misreads)."""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class JUnitCounts:
    """Totals over every ``<testsuite>`` of one JUnit XML report."""

    tests: int
    failures: int
    errors: int
    skipped: int

    @property
    def passed(self) -> int:
        return self.tests - self.failures - self.errors - self.skipped


def junit_counts(path: Path) -> JUnitCounts:
    """The report's totals; a missing, unparsable or suite-less report raises ``ValueError``."""
    if not path.is_file():
        raise ValueError(f"no JUnit XML report at {path}")
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError as exc:
        raise ValueError(f"JUnit XML report {path} does not parse: {exc}") from exc
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    if not suites:
        raise ValueError(f"JUnit XML report {path} holds no <testsuite> (root <{root.tag}>)")
    totals = {name: 0 for name in ("tests", "failures", "errors", "skipped")}
    for suite in suites:
        for name in totals:
            totals[name] += int(suite.get(name, "0"))
    return JUnitCounts(**totals)


@dataclass(frozen=True)
class KitRun:
    returncode: int
    counts: JUnitCounts
    output: str

    @property
    def tail(self) -> str:
        return self.output[-5000:]


def run_kit(platform: str, backend: str | None, report: Path, *extra: str, timeout: int = 900) -> KitRun:
    """``pytest --pyargs diffusion_kv.conformance`` for ``platform`` (and ``backend``) in a child
    process writing its JUnit XML to ``report``; ``extra`` are more pytest arguments."""
    args = [
        sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--pyargs", "diffusion_kv.conformance",
        "--dkv-platform", platform, f"--junitxml={report}", *extra,
    ]  # fmt: skip
    if backend is not None:
        args += ["--dkv-backend", backend]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=dict(os.environ))
    output = proc.stdout + proc.stderr
    try:
        counts = junit_counts(report)
    except ValueError as exc:  # the child died before writing its report: say how
        raise ValueError(f"{exc}; the kit exited {proc.returncode}:\n{output[-3000:]}") from exc
    return KitRun(proc.returncode, counts, output)
