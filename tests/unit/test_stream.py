"""The stream demo: mixed requests served together agree with their own dense runs."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest
import torch

from diffusion_kv.core.allocator import FreeListPool
from diffusion_kv.core.errors import DiffusionKVError
from diffusion_kv.models.stream import StreamConfig, format_stream, make_requests, run_stream
from diffusion_kv.platforms.cpu import CpuPlatform

SMALL = dict(
    requests=6, prefix_len=24, target_len=8, steps=3, hidden=32, heads=2, kv_heads=2, layers=1, block_size=8
)


def test_workload_mixes_every_shape() -> None:
    reqs = make_requests(StreamConfig(**SMALL))  # type: ignore[arg-type]
    assert [(r.prefix_len, r.target_len, r.steps, r.cfg_rows) for r in reqs] == [
        (24, 8, 3, 2),
        (12, 4, 3, 2),
        (0, 8, 3, 1),
        (24, 4, 5, 1),
        (12, 8, 5, 2),
        (0, 4, 5, 2),
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_stream_agrees_with_dense_per_request(dtype: torch.dtype) -> None:
    result = run_stream(CpuPlatform(), StreamConfig(dtype=dtype, **SMALL))  # type: ignore[arg-type]
    assert result.agree, result.requests
    reqs = make_requests(StreamConfig(**SMALL))  # type: ignore[arg-type]
    assert result.sequential["ticks"] == sum(r.steps for r in reqs) == 24
    assert result.stream["ticks"] < result.sequential["ticks"]
    assert result.stream["max_running"] > 1 and result.sequential["max_running"] == 1
    blocks = [r.cfg_rows * -(-r.seq_len // 8) for r in reqs]
    assert result.pool_blocks == max(max(blocks), -(-6 * sum(blocks) // 10))
    assert result.stream["peak_blocks"] <= result.pool_blocks
    assert result.target_token_steps == sum(r.cfg_rows * r.target_len * r.steps for r in reqs)
    assert result.stream["graph_captures"] == 0  # CPU: no graphs
    assert result.backends == ("cpu:reference",)  # sdpa needs blocks of 16n
    first = format_stream(result).splitlines()[0]
    assert first.startswith(
        f"platform: cpu (device cpu, {result.dtype}), paged backend cpu:reference, block size 8"
    )


def test_cli_stream_json() -> None:
    proc = subprocess.run(
        [
            sys.executable, "-m", "diffusion_kv.cli", "demo", "--stream", "4", "--prefix", "24", "--target", "8",
            "--steps", "3", "--hidden", "32", "--heads", "2", "--layers", "1", "--json",
        ],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    payload = json.loads(proc.stdout)
    assert payload["agree"] is True and len(payload["requests"]) == 4
    assert payload["stream"]["requests_per_s"] > 0 and payload["speedup"] > 0


def test_cli_stream_usage_errors() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "diffusion_kv.cli", "demo", "--stream", "2", "--inject-fault"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert proc.returncode == 2 and "--inject-fault applies to the single-request demo only" in proc.stderr
    proc = subprocess.run(
        [sys.executable, "-m", "diffusion_kv.cli", "demo", "--stream", "2", "--pool-fraction", "1.5"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert proc.returncode == 2 and "(0, 1]" in proc.stderr


def test_shared_prefixes_hit_and_agree_with_uncached() -> None:
    """Six requests (prefix 24 + target 8, two CFG rows, block 8) drawing their prefixes from two:
    the first request of each prefix misses and publishes, the other four hit the three blocks
    before the target span on both rows; the outputs equal the uncached stream's bit for bit."""
    result = run_stream(CpuPlatform(), StreamConfig(shared_prefixes=2, **SMALL))  # type: ignore[arg-type]
    pc = result.prefix_cache
    assert pc is not None and result.agree
    assert (pc["hit_tokens"], pc["blocks_saved"], pc["published_blocks"], pc["evictions"]) == (192, 24, 12, 0)
    assert (pc["prefill_tokens"], pc["prefill_tokens_uncached"]) == (2 * 2 * 32 + 4 * 2 * 8, 6 * 2 * 32)
    assert pc["peak_blocks_held"] < pc["peak_blocks_held_uncached"]
    assert pc["max_abs_diff_vs_uncached"] == 0.0 and pc["agrees"] is True
    assert all(r["cfg_rows"] == 2 and r["prefix_len"] == 24 for r in result.requests)


def test_prefix_caching_without_sharing_never_hits() -> None:
    result = run_stream(CpuPlatform(), StreamConfig(prefix_caching=True, **SMALL))  # type: ignore[arg-type]
    pc = result.prefix_cache
    assert pc is not None and result.agree
    assert (pc["hit_tokens"], pc["blocks_saved"]) == (0, 0)
    assert pc["prefill_tokens"] == pc["prefill_tokens_uncached"]
    assert pc["max_abs_diff_vs_uncached"] == 0.0


def test_cache_cap_limits_what_is_published() -> None:
    """A cap of two blocks: the first request publishes two blocks of its cond row and nothing of
    its uncond row; the five others hit those two blocks only (5 x 16 tokens)."""
    cfg = StreamConfig(shared_prefixes=1, max_cached_blocks=2, **SMALL)  # type: ignore[arg-type]
    pc = run_stream(CpuPlatform(), cfg).prefix_cache
    assert pc is not None
    assert (pc["published_blocks"], pc["hit_tokens"], pc["agrees"]) == (2, 80, True)


def test_cli_shared_prefixes_json_and_usage() -> None:
    proc = subprocess.run(
        [
            sys.executable, "-m", "diffusion_kv.cli", "demo", "--stream", "4", "--shared-prefixes", "1",
            "--prefix", "24", "--target", "8", "--steps", "3", "--hidden", "32", "--heads", "2", "--layers", "1",
            "--block-size", "8", "--json",
        ],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    pc = json.loads(proc.stdout)["prefix_cache"]
    assert (pc["shared_prefixes"], pc["hit_tokens"], pc["agrees"]) == (1, 3 * 2 * 24, True)
    for args, message in (
        (["--stream", "2", "--shared-prefixes", "3"], "--shared-prefixes 3 is more than the 2 requests"),
        (["--shared-prefixes", "2"], "--shared-prefixes applies to --stream only"),
    ):
        proc = subprocess.run(
            [sys.executable, "-m", "diffusion_kv.cli", "demo", *args],
            capture_output=True,
            text=True,
            check=False,
        )
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr


def test_a_run_that_leaves_the_pool_short_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """After every run the pool is full again (free + cached == total, nothing held, no worker
    rows); a run that lost a block says so instead of reporting."""
    freed = FreeListPool.free

    def lose_the_first_block(self: FreeListPool, block_ids: Any) -> None:
        ids = list(block_ids)
        freed(self, ids[1:] if len(ids) > 1 else ids)

    monkeypatch.setattr(FreeListPool, "free", lose_the_first_block)
    with pytest.raises(
        DiffusionKVError,
        match=r"^the warmup run left the block pool short: 10 free \+ 0 cached \(0 idle\) of 15; still reserved: \[\]; worker rows installed: \[\]$",
    ):
        run_stream(CpuPlatform(), StreamConfig(**SMALL))  # type: ignore[arg-type]


def test_default_buckets_double_then_grow_by_a_quarter_octave() -> None:
    from diffusion_kv.core.errors import ValidationError
    from diffusion_kv.models.buckets import default_buckets

    assert default_buckets(35840) == (
        256, 512, 1024, 2048, 2560, 3072, 3584, 4096, 5120, 6144, 7168, 8192,
        10240, 12288, 14336, 16384, 20480, 24576, 28672, 32768, 40960,
    )  # fmt: skip
    assert default_buckets(35840, per_octave=1) == (256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)
    assert default_buckets(100) == (256,)
    assert default_buckets(4096) == (256, 512, 1024, 2048, 2560, 3072, 3584, 4096)
    assert default_buckets(5000, smallest=3000) == (3000, 3512, 4024, 4536, 5560)
    assert default_buckets(900, smallest=100, fine_from=400, per_octave=2) == (100, 200, 400, 528, 784, 1040)
    # every step of the stream bench's full workload is padded by under a quarter of its bucket
    sizes = default_buckets(35840)
    for tokens in (1024, 3072, 4096, 5120, 6144, 7168, 7680, 8704, 10240, 10752, 11264, 12800):
        bucket = min(s for s in sizes if s >= tokens)
        assert bucket - tokens < bucket / 4, tokens
    for bad in (dict(max_tokens=0), dict(max_tokens=8, smallest=0), dict(max_tokens=8, per_octave=0)):
        with pytest.raises(ValidationError, match="must be a positive integer"):
            default_buckets(**bad)  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="fine_from"):
        default_buckets(8, fine_from=-1)
    with pytest.raises(ValidationError, match="per_octave"):
        default_buckets(8, per_octave=True)
