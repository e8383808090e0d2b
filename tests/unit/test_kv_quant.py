"""fp8_e4m3 KV pages: the cache dtype as a capability, scales, quantisation, the cpu reference."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from diffusion_kv.core.capabilities import Capabilities, Requirements, capability_reasons
from diffusion_kv.core.errors import UnsupportedRequirementsError, ValidationError
from diffusion_kv.core.kv_quant import (
    FP8_E4M3,
    FP8_MAX,
    KVScales,
    dequantize,
    fake_quantize,
    parse_kv_cache_dtype,
    quantize,
    resolve_cache_dtype,
)
from diffusion_kv.core.runner import PagedLayerSpec, PagedWorker, RunnerConfig
from diffusion_kv.platforms.cpu import CpuPlatform
from diffusion_kv.platforms.cpu.backend import CpuReferenceBackend


def runner(kv_cache_dtype: object = "fp8_e4m3", **spec: object) -> PagedWorker:
    r = PagedWorker(
        CpuPlatform(),
        RunnerConfig(
            max_model_len=64, max_rows_per_request=1, max_num_seqs=2, max_num_batched_tokens=128,
            kv_cache_dtype=kv_cache_dtype,  # type: ignore[arg-type]
        ),
    )  # fmt: skip
    r.register_kv_cache_layers({"l0": PagedLayerSpec(4, 2, 16, torch.float32, **spec)})  # type: ignore[arg-type]
    return r


def test_names_parse_and_refuse() -> None:
    assert parse_kv_cache_dtype("auto") is None
    assert parse_kv_cache_dtype("fp8") == parse_kv_cache_dtype("fp8_e4m3") == FP8_E4M3
    assert parse_kv_cache_dtype(torch.bfloat16) == torch.bfloat16
    for bad in ("int8", torch.float32, 8, None):
        with pytest.raises(
            ValidationError, match="kv_cache_dtype must be one of auto, bfloat16, float16, fp8_e4m3"
        ):
            parse_kv_cache_dtype(bad)
    assert resolve_cache_dtype(torch.bfloat16, torch.bfloat16, "x") is None
    assert resolve_cache_dtype(torch.float32, FP8_E4M3, "x") == FP8_E4M3
    with pytest.raises(
        ValidationError, match="x: kv_cache_dtype float16 differs from the layer dtype bfloat16"
    ):
        resolve_cache_dtype(torch.bfloat16, torch.float16, "x")


def test_quantize_rounds_clamps_and_counts() -> None:
    scale = torch.tensor([0.5, 2.0])
    x = torch.tensor([[[0.5, 300.0, -1000.0]], [[1.0, 1000.0, 3.0]]]).reshape(1, 2, 3)
    counter = torch.zeros((), dtype=torch.int64)
    q = quantize(x, scale, counter)
    assert q.dtype == FP8_E4M3
    # head 0: 1.0, 600 -> 448 (clamped), -2000 -> -448; head 1: 0.5, 500 -> 448, 1.5
    assert q.float().tolist() == [[[1.0, 448.0, -448.0], [0.5, 448.0, 1.5]]]
    assert int(counter) == 3
    assert dequantize(q, scale, torch.float32).tolist() == [[[0.5, 224.0, -224.0], [1.0, 896.0, 3.0]]]
    y = torch.randn(64, 2, 32)
    assert torch.equal(fake_quantize(y, scale), dequantize(quantize(y, scale), scale, y.dtype))
    rel = ((fake_quantize(y, torch.ones(2)) - y).abs() / y.abs().clamp_min(2**-6)).max()
    assert rel <= 2**-4  # round to nearest with 3 mantissa bits


def test_scales_are_checked_set_in_place_and_count() -> None:
    sc = KVScales(2, torch.device("cpu"), 0.5, [1.0, 2.0], "l0")
    assert sc.k_scale.tolist() == [0.5, 0.5] and sc.v_scale.tolist() == [1.0, 2.0]
    k_ptr = sc.k_scale.data_ptr()
    sc.set([0.25, 0.125], 3.0)
    assert sc.k_scale.data_ptr() == k_ptr and sc.k_scale.tolist() == [0.25, 0.125]
    for bad in (0.0, -1.0, [1.0], [1.0, float("nan")], "1", True):
        with pytest.raises(ValidationError, match="layer 'l0' k_scale must be a finite positive number or 2"):
            sc.set(bad, 1.0)
    assert sc.k_scale.tolist() == [0.25, 0.125]  # nothing changed by a refused set
    assert KVScales.from_amax(torch.tensor([448.0, 4.48])) == pytest.approx([1.0, 0.01])
    assert sc.saturations() == (0, 0)


def test_capability_and_requirement() -> None:
    caps = CpuReferenceBackend.capabilities
    assert capability_reasons(caps, Requirements(dtype=torch.float32, kv_cache_dtype=FP8_E4M3)) == []
    plain = Capabilities(dtypes=frozenset({torch.float32}), head_sizes=None, kernel_block_sizes=(16,))
    assert capability_reasons(plain, Requirements(dtype=torch.float32, kv_cache_dtype=FP8_E4M3)) == [
        "kv_cache_dtype=fp8_e4m3 (pages hold the compute dtype only)"
    ]
    assert capability_reasons(plain, Requirements(dtype=torch.float32, kv_cache_dtype=torch.float32)) == []
    assert plain.summary()["kv_cache_dtypes"] == ["auto"] and caps.summary()["kv_cache_dtypes"] == [
        "auto",
        "fp8_e4m3",
    ]
    bad = Capabilities(
        dtypes=frozenset({torch.float32}), head_sizes=None, kernel_block_sizes=(16,), kv_cache_dtypes={1}
    )  # type: ignore[arg-type]
    assert any("kv_cache_dtypes must be a frozenset of torch.dtype" in p for p in bad.problems())


def test_runner_sizes_pages_by_the_cache_dtype_and_picks_a_declaring_backend() -> None:
    r = runner(k_scale=[0.1, 0.2])
    layout = r.initialize_kv_cache(num_blocks=4, block_size=16)
    assert type(r.backends[0]).name == "reference"  # cpu:sdpa does not declare fp8: skipped, not served
    assert layout.groups[0].spec.bytes_per_token() == 2 * 2 * 16 * 1
    assert r.kv_bytes_per_block() == 16 * 2 * 2 * 16
    assert r.kv_caches["l0"].dtype == FP8_E4M3
    sc = r.layers["l0"].kv_scales
    assert (
        sc is not None
        and sc.k_scale.tolist() == pytest.approx([0.1, 0.2])
        and sc.v_scale.tolist() == [1.0, 1.0]
    )
    plain = runner("auto")
    plain.initialize_kv_cache(num_blocks=4, block_size=16)
    assert plain.kv_bytes_per_block() == 4 * r.kv_bytes_per_block() and plain.layers["l0"].kv_scales is None


def test_runner_refuses_bad_cache_settings() -> None:
    with pytest.raises(ValidationError, match="kv_cache_dtype must be one of"):
        runner("int4")
    with pytest.raises(
        ValidationError, match="layer 'l0': kv_cache_dtype bfloat16 differs from the layer dtype float32"
    ):
        runner("bfloat16")
    with pytest.raises(ValidationError, match="layer 'l0' v_scale must be a finite positive number or 2"):
        runner(v_scale=[1.0, 2.0, 3.0])


def test_a_forced_backend_without_fp8_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DIFFUSION_KV_BACKEND", "cpu:sdpa")
    with pytest.raises(UnsupportedRequirementsError, match="kv_cache_dtype=fp8_e4m3"):
        runner()


def test_cli_demo_fp8_json_and_usage() -> None:
    proc = subprocess.run(
        [
            sys.executable, "-m", "diffusion_kv.cli", "demo", "--kv-cache-dtype", "fp8_e4m3", "--prefix", "64",
            "--target", "16", "--steps", "3", "--hidden", "64", "--heads", "2", "--layers", "2", "--json",
        ],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["kv_cache_dtype"] == "fp8_e4m3" and out["agree"] is True and out["cosine_similarity"] >= 0.999
    assert out["kv_bytes_per_token"] == {"float32": 2 * 2 * 32 * 4 * 2, "fp8_e4m3": 2 * 2 * 32 * 2}
    assert out["kv_bytes_paged"] == out["blocks_used"] * 16 * 2 * 2 * 32 * 2  # one byte per element
    proc = subprocess.run(
        [sys.executable, "-m", "diffusion_kv.cli", "demo", "--kv-cache-dtype", "float16"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "--kv-cache-dtype: kv_cache_dtype float16 differs from the layer dtype float32" in proc.stderr
    assert FP8_MAX == 448.0


def test_cli_demo_fp8_catches_a_corrupted_block() -> None:
    proc = subprocess.run(
        [
            sys.executable, "-m", "diffusion_kv.cli", "demo", "--kv-cache-dtype", "fp8_e4m3", "--inject-fault",
            "--prefix", "64", "--target", "16", "--steps", "3", "--hidden", "64", "--heads", "2", "--layers", "1",
        ],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout
    assert "DISAGREE" in proc.stdout
    assert "final-latent cosine similarity" in proc.stderr and "below the fp8_e4m3 bound 0.999" in proc.stderr


def test_one_reading_of_unquantised() -> None:
    from diffusion_kv.core.kv_quant import FP8_E4M3, is_unquantised, resolve_cache_dtype

    bf16 = torch.bfloat16
    for same in (None, "auto", "AUTO", bf16, "bfloat16", "bf16"):
        assert is_unquantised(same, bf16) is True, same
    for quant in ("fp8", "fp8_e4m3", FP8_E4M3):
        assert is_unquantised(quant, bf16) is False, quant
    assert is_unquantised(torch.float32, torch.float32) is True  # a compute dtype no name lists
    assert is_unquantised("float16", bf16) is False  # another 16-bit dtype is not the layer's
    assert is_unquantised("bfloat16") is False  # without a compute dtype only None/auto are
    assert is_unquantised("fp8_e5m2", bf16) is False  # refused by the parser: not unquantised
    assert resolve_cache_dtype(bf16, bf16, "layer") is None
    assert resolve_cache_dtype(bf16, FP8_E4M3, "layer") is FP8_E4M3


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), True, "1", [1.0, 2.0, 3.0]])
def test_a_malformed_scale_on_16_bit_pages_is_refused_too(bad: object) -> None:
    from diffusion_kv.core.runner import PagedLayerSpec, PagedWorker, RunnerConfig
    from diffusion_kv.platforms.cpu import CpuPlatform

    worker = PagedWorker(CpuPlatform(), RunnerConfig(64, 1, 1, 64, device="cpu"))
    with pytest.raises(
        ValidationError, match=r"layer 'l0' k_scale must be a finite positive number or 2 of them"
    ):
        worker.register_kv_cache_layers({"l0": PagedLayerSpec(2, 2, 8, torch.float32, k_scale=bad)})  # type: ignore[arg-type]
    assert worker.layers == {}


def test_gather_sdpa_way_reads_e4m3_pages_through_dequantised_copies() -> None:
    """The shared gather + SDPA way's e4m3 hooks (what a plugin without a fused kernel gets):
    the pages named by block, each row cut to its keys, and a strided view, come back in the
    query dtype as exactly ``dequantize`` of the same bytes."""
    from diffusion_kv.platforms.torch_sdpa import TorchSdpaBackend

    g = torch.Generator().manual_seed(3)
    both = (torch.randn(6, 2, 4, 2, 8, generator=g) * 30).to(torch.float8_e4m3fn)
    cache = both[:, 0]  # [6 blocks, page 4, 2 heads, 8]: one half of a combined cache
    scale = torch.tensor([0.5, 3.0])
    index = torch.tensor([5, 0, 2, 4])
    got = TorchSdpaBackend._gather_dequantized(cache, index, 2, 7, scale, torch.float16)
    want = torch.stack(
        [
            (torch.cat([cache[b] for b in index[r * 2 : r * 2 + 2]])[:7].float() * scale[:, None]).half()
            for r in (0, 1)
        ]
    )
    assert got.dtype == torch.float16 and got.shape == (2, 7, 2, 8) and torch.equal(got, want)
    view = cache[1:4, 1:3]
    got_view = TorchSdpaBackend._dequantized(view, scale, torch.bfloat16)
    assert torch.equal(got_view, (view.float() * scale[:, None]).bfloat16())
