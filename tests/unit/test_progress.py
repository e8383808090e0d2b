"""The one progress display: silent unless both stdout and its stream are terminals."""

from __future__ import annotations

import io
import subprocess
import sys
from types import SimpleNamespace

import pytest

from diffusion_kv.progress import ProgressDisplay, bench_progress, demo_progress, stream_progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def tty_stdout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "stdout", Terminal())


def test_silent_without_a_terminal_or_when_disabled(
    tty_stdout: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    for display, stream in (
        (lambda s: ProgressDisplay(enabled=False, stream=s), Terminal()),  # --no-progress
        (lambda s: ProgressDisplay(stream=s), io.StringIO()),  # its stream is not a terminal
    ):
        d = display(stream)
        assert not d.enabled
        demo_progress(d)("paged", 1, 2)
        bench_progress(d)("attention 1/2")
        d.say("hello")
        assert stream.getvalue() == ""
    monkeypatch.setattr(sys, "stdout", io.StringIO())  # stdout piped: silent even on a terminal
    quiet = Terminal()
    d = ProgressDisplay(stream=quiet)
    d.say("hello")
    assert not d.enabled and quiet.getvalue() == ""


def test_bars_and_messages_on_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "stdout", Terminal())
    out = Terminal()
    d = ProgressDisplay(stream=out)
    assert d.enabled
    show = demo_progress(d)
    for i in (1, 2, 3):
        show("dense", i, 3)
    bench_progress(d)("e2e")
    report = SimpleNamespace(tick=4, rows=6, tokens=300, blocks_in_use=7, blocks_total=9)
    stream_progress(d)("stream", report, 2, 4)
    d.close()
    text = out.getvalue()
    assert "dense" in text and "3/3" in text and "[bench] e2e" in text
    assert "2/4" in text and "step=5" in text and "blocks=7/9" in text


def test_cli_prints_no_progress_when_piped() -> None:
    proc = subprocess.run(
        [
            sys.executable, "-m", "diffusion_kv.cli", "demo", "--prefix", "32", "--target", "8", "--steps", "2",
            "--hidden", "32", "--heads", "2", "--layers", "1",
        ],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == "" and "AGREE" in proc.stdout
