"""Every invalid argument value is a usage error: exit 2, one line, found before any work."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from diffusion_kv import bench as bench_pkg
from diffusion_kv.cli import SECTION_NAMES, main
from diffusion_kv.models import demo as demo_mod


@pytest.fixture
def no_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any demo or bench run counts as work started: it fails the test."""

    def refuse(*_a: object, **_k: object) -> None:
        raise AssertionError("work started before the arguments were checked")

    monkeypatch.setattr(demo_mod, "run_demo", refuse)
    monkeypatch.setattr(bench_pkg, "run_bench", refuse)


USAGE = {
    "--block-size 0": (["demo", "--block-size", "0"], "argument --block-size: must be >= 1, got 0"),
    "--kv-heads 0": (["demo", "--kv-heads", "0"], "argument --kv-heads: must be >= 1, got 0"),
    "--steps -1": (["demo", "--steps", "-1"], "argument --steps: must be >= 1, got -1"),
    "--prefix x": (["demo", "--prefix", "x"], "argument --prefix: expected an integer, got 'x'"),
    "--prefix 1.5": (["demo", "--prefix", "1.5"], "argument --prefix: expected an integer, got '1.5'"),
    "--seed -3": (["demo", "--seed", "-3"], "argument --seed: must be >= 0, got -3"),
    "--cfg 3": (["demo", "--cfg", "3"], "argument --cfg: invalid choice: 3"),
    "--dtype int8": (["demo", "--dtype", "int8"], "argument --dtype: invalid choice: 'int8'"),
    "--heads 3 --hidden 256": (
        ["demo", "--heads", "3", "--hidden", "256"],
        "--hidden 256 must be a multiple of --heads 3",
    ),
    "odd head size": (
        ["demo", "--heads", "4", "--hidden", "36"],
        "head size --hidden/--heads = 9 must be even",
    ),
    "--kv-heads 3": (["demo", "--kv-heads", "3"], "--heads 4 must be a multiple of --kv-heads 3"),
    "too long": (["demo", "--prefix", "4000", "--target", "200"], "exceeds --max-model-len 4096"),
    "--ulysses 3": (["demo", "--ulysses", "3"], "must be divisible by --ulysses 3"),
    "--cfg-parallel --cfg 1": (["demo", "--cfg-parallel", "--cfg", "1"], "--cfg-parallel needs --cfg 2"),
    "--ulysses without torchrun": (["demo", "--ulysses", "2"], "run under torchrun (WORLD_SIZE is not set)"),
    "--dcp 0": (["demo", "--dcp", "0"], "argument --dcp: must be >= 1, got 0"),
    "--dcp with --ulysses": (["demo", "--dcp", "2", "--ulysses", "2"], "the demo runs --dcp on its own"),
    "--dcp-interleave alone": (["demo", "--dcp-interleave", "2"], "--dcp-interleave needs --dcp N > 1"),
    "--dcp-interleave 3": (
        ["demo", "--dcp", "2", "--dcp-interleave", "3", "--block-size", "16"],
        "--dcp-interleave 3 must divide the block size 16",
    ),
    "--dcp without torchrun": (["demo", "--dcp", "2"], "run under torchrun (WORLD_SIZE is not set)"),
    "--stream --dcp": (["demo", "--stream", "2", "--dcp", "2"], "drop --ulysses/--cfg-parallel/--dcp"),
    "unknown platform": (["demo", "--platform", "nosuch"], "argument --platform: no platform named 'nosuch'"),
    "unknown backend (demo)": (
        ["demo", "--platform", "cpu", "--backend", "nosuch"],
        "argument --backend: platform 'cpu' has no backend 'nosuch' (backends: ",
    ),
    "unknown backend (bench)": (
        ["bench", "--platform", "cpu", "--backend", "nosuch"],
        "argument --backend: platform 'cpu' has no backend 'nosuch' (backends: ",
    ),
    "unknown backend (conformance)": (
        ["conformance", "--platform", "cpu", "--backend", "nosuch"],
        "argument --backend: platform 'cpu' has no backend 'nosuch' (backends: ",
    ),
    "--backend against --dkv-backend": (
        ["conformance", "--platform", "cpu", "--backend", "sdpa", "--", "--dkv-backend", "reference"],
        "--backend sdpa and -- --dkv-backend reference name different backends",
    ),
    "unknown option": (["demo", "--frobnicate"], "unrecognized arguments: --frobnicate"),
    "no command": ([], "the following arguments are required: command"),
    "--max-cached-blocks without caching": (
        ["demo", "--stream", "2", "--no-prefix-caching", "--max-cached-blocks", "3"],
        "--max-cached-blocks 3 caps the prefix cache, which is off here (add --prefix-caching or "
        "--shared-prefixes K)",
    ),
    "--max-cached-blocks on the mixed stream": (
        ["demo", "--stream", "2", "--max-cached-blocks", "0"],
        "--max-cached-blocks 0 caps the prefix cache, which is off here",
    ),
    "--kv-cache-dtype fp9": (
        ["demo", "--kv-cache-dtype", "fp9"],
        "argument --kv-cache-dtype: invalid choice: 'fp9'",
    ),
    "--shared-prefixes without --stream": (
        ["demo", "--shared-prefixes", "2"],
        "--shared-prefixes applies to --stream only",
    ),
    "bench sections": (
        ["bench", "--sections", ""],
        "argument --sections: expected a comma list without empty items",
    ),
    "bench regimes": (
        ["bench", "--regimes", "A,C"],
        "argument --regimes: unknown value(s) C; choose from A, B",
    ),
    "bench blocks": (["bench", "--block-sizes", "16,0"], "argument --block-sizes: must be >= 1, got 0"),
    "bench repeated": (["bench", "--cfg", "1,1"], "argument --cfg: lists a value twice"),
    "bench min-ms": (["bench", "--min-ms", "nan"], "argument --min-ms: must be a finite number > 0, got nan"),
    "bench output dir": (
        ["bench", "--output", "/nonexistent-dir/x.json"],
        "argument --output: cannot write '/nonexistent-dir/x.json'",
    ),
    "bench unknown platform": (
        ["bench", "--platform", "nosuch"],
        "argument --platform: no platform named 'nosuch'",
    ),
}


@pytest.mark.parametrize("case", sorted(USAGE))
def test_usage_errors(case: str, no_work: None, capsys: pytest.CaptureFixture[str]) -> None:
    argv, fact = USAGE[case]
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("diffusion-kv: error: ") and err.endswith("\n") and err.count("\n") == 1, err
    assert fact in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "case", ["--block-size 0", "--heads 3 --hidden 256", "unknown platform", "bench output dir"]
)
def test_usage_errors_as_json(case: str, no_work: None, capsys: pytest.CaptureFixture[str]) -> None:
    argv, fact = USAGE[case]
    assert main([*argv, "--json"]) == 2
    out, err = capsys.readouterr()
    payload = json.loads(out)  # exactly one JSON document
    assert payload["error"]["kind"] == "usage" and payload["error"]["exit_code"] == 2
    assert fact in payload["error"]["message"] and fact in err


@pytest.mark.parametrize(
    ("extra", "fact"),
    [
        (["--dtype", "float32"], "dtype=float32 (supported: ['float16'])"),
        (["--dtype", "float16", "--hidden", "512", "--heads", "4"], "head_size=128 (supported: [64])"),
        (
            ["--dtype", "float16", "--block-size", "24"],
            "block_size=24 (kernel blocks: 16; none equals or divides it)",
        ),
        (["--dtype", "float16", "--kv-heads", "2"], "grouped-query attention (num_heads=4, num_kv_heads=2)"),
    ],
)
def test_what_the_platform_cannot_serve_is_a_usage_error(
    extra: list[str],
    fact: str,
    test_group: str,
    monkeypatch: pytest.MonkeyPatch,
    no_work: None,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("DKV_TEST_LIMITED", "1")
    assert main(["demo", "--platform", "limited", *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("diffusion-kv: error: platform 'limited' cannot serve this demo: ") and fact in err
    assert main(["bench", "--platform", "limited", "--dtype", "bf16", "--block-sizes", "16,128,24"]) == 2
    err = capsys.readouterr().err
    assert "--dtype bf16 (supported: ['float16']); --block-sizes 24 (supported: 16)" in err


def test_unavailable_platform_is_a_run_error(no_work: None, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--platform", "npu", "--json"]) == 1
    out, err = capsys.readouterr()
    assert json.loads(out)["error"]["kind"] == "error" and "platform 'npu' is not available here" in err


def test_output_is_checked_before_the_run_and_left_alone(tmp_path: Path, no_work: None) -> None:
    target = tmp_path / "missing" / "report.json"
    assert main(["bench", "--output", str(target)]) == 2
    assert not target.parent.exists()
    directory = tmp_path / "adir"
    directory.mkdir()
    assert main(["bench", "--output", str(directory)]) == 2
    writable = tmp_path / "r.json"
    with pytest.raises(AssertionError, match="work started"):  # a writable path passes the check
        main(["bench", "--output", str(writable), "--debug"])
    assert not writable.exists()  # the probe leaves nothing behind


def test_internal_errors_are_one_line_unless_debug(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def explode(*_a: object, **_k: object) -> None:
        raise ZeroDivisionError("boom")

    monkeypatch.setattr(demo_mod, "run_demo", explode)
    assert main(["demo", "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert (
        err
        == "diffusion-kv: error: internal error: ZeroDivisionError: boom (run with --debug for the traceback)\n"
    )
    with pytest.raises(ZeroDivisionError):
        main(["demo", "--no-progress", "--debug"])


def test_interrupt_exits_130(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    def interrupt(*_a: object, **_k: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(demo_mod, "run_demo", interrupt)
    assert main(["demo", "--no-progress"]) == 130
    assert capsys.readouterr().err == "diffusion-kv: interrupted\n"


def test_section_names_match_the_bench() -> None:
    assert tuple(bench_pkg.SECTIONS) == SECTION_NAMES


# --- exit codes the README's table promised and the commands did not keep ------------------------


def test_the_benchs_default_dtype_the_platform_cannot_serve_is_a_usage_error(
    test_group: str, monkeypatch: pytest.MonkeyPatch, no_work: None, capsys: pytest.CaptureFixture[str]
) -> None:
    """It was found by run_bench after the command started (exit 1)."""
    monkeypatch.setenv("DKV_TEST_LIMITED", "1")
    assert main(["bench", "--platform", "limited", "--block-sizes", "16", "--json"]) == 2
    out, err = capsys.readouterr()
    fact = (
        "platform 'limited' cannot serve the default dtype float32 (supported: ['float16']; choose --dtype)"
    )
    assert err == f"diffusion-kv: error: {fact}\n"
    assert json.loads(out)["error"] == {"kind": "usage", "message": fact, "exit_code": 2}


@pytest.mark.parametrize(
    ("env", "argv", "fact"),
    [
        (
            {"WORLD_SIZE": "2"},
            ["demo", "--ulysses", "2"],
            "--ulysses N, --cfg-parallel and --dcp N run under torchrun (RANK, MASTER_ADDR, MASTER_PORT not set); "
            "launch with torchrun --nproc-per-node N",
        ),
        (
            {"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"},
            ["demo", "--ulysses", "2", "--cfg-parallel"],
            "--ulysses 2 x 2 (--cfg-parallel) needs a world of 4 ranks; torchrun started WORLD_SIZE=2 "
            "(use torchrun --nproc-per-node 4)",
        ),
        (
            {"WORLD_SIZE": "4", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"},
            ["demo", "--dcp", "2"],
            "--dcp 2 needs a world of 2 ranks; torchrun started WORLD_SIZE=4 (use torchrun --nproc-per-node 2)",
        ),
    ],
)
def test_a_launch_that_does_not_match_the_split_is_a_usage_error(
    env: dict[str, str],
    argv: list[str],
    fact: str,
    monkeypatch: pytest.MonkeyPatch,
    no_work: None,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Found before any process group is touched (it was a run error, exit 1)."""
    from diffusion_kv.core import parallel

    def refuse(*_a: object, **_k: object) -> None:
        raise AssertionError("a process group was initialised before the launch was checked")

    monkeypatch.setattr(parallel, "init_distributed_from_env", refuse)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    for name in {"RANK", "MASTER_ADDR", "MASTER_PORT"} - set(env):
        monkeypatch.delenv(name, raising=False)
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == f"diffusion-kv: error: {fact}\n"


@pytest.mark.parametrize(
    ("pytest_code", "interrupted", "exit_code", "fact"),
    [
        (
            4,
            False,
            2,
            "diffusion-kv: error: pytest refused the arguments ['--bogus'] (its message is above)\n",
        ),
        (2, True, 130, "diffusion-kv: interrupted\n"),
        (2, False, 1, ""),  # pytest's code 2 without Ctrl-C: a collection error, a run error
        (1, False, 1, ""),
        (0, False, 0, ""),
    ],
)
def test_conformance_maps_pytests_outcome_to_the_exit_codes(
    pytest_code: int,
    interrupted: bool,
    exit_code: int,
    fact: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    def fake_main(args: list[str], plugins: list[object]) -> int:
        assert args[-1] == "--bogus"
        if interrupted:
            for plugin in plugins:
                plugin.pytest_keyboard_interrupt()  # type: ignore[attr-defined]
        return pytest_code

    monkeypatch.setattr(pytest, "main", fake_main)
    assert main(["conformance", "--platform", "cpu", "--", "--bogus"]) == exit_code
    assert capsys.readouterr().err == fact


def test_conformance_with_arguments_pytest_refuses_exits_2() -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "diffusion_kv.cli",
            "conformance",
            "--platform",
            "cpu",
            "--",
            "--no-such-option",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "unrecognized arguments: --no-such-option" in proc.stderr
    assert proc.stderr.endswith(
        "diffusion-kv: error: pytest refused the arguments ['--no-such-option'] (its message is above)\n"
    )


@pytest.mark.parametrize(
    ("value", "fact"),
    [
        ("nope", "DIFFUSION_KV_BACKEND='nope'; expected <platform>:<backend>, e.g. cuda:triton"),
        (
            "bogus:x",
            "DIFFUSION_KV_BACKEND='bogus:x' names platform 'bogus', which is not installed in group "
            "'diffusion_kv.platforms' (installed: ",
        ),
    ],
)
@pytest.mark.parametrize("argv", [["platforms"], ["platforms", "--explain"]])
def test_an_unusable_backend_variable_is_one_line_for_platforms(
    value: str,
    fact: str,
    argv: list[str],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Not the table, and no hint about the other variables: the variable's own one line."""
    monkeypatch.setenv("DIFFUSION_KV_BACKEND", value)
    assert main(argv) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith(f"diffusion-kv: error: {fact}") and err.count("\n") == 1, err
    assert "DIFFUSION_KV_PLATFORM" not in err and "DIFFUSION_KV_PLUGINS" not in err


def test_backend_flag_picks_the_backend_that_serves_the_demo(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["demo", "--platform", "cpu", "--backend", "reference", "--prefix", "32", "--target", "16"]
    args += ["--hidden", "32", "--heads", "2", "--layers", "1", "--steps", "2", "--json"]
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out)["backends"] == ["cpu:reference"]
