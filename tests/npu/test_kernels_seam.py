"""The kernel seam: writer selection by what torch_npu offers, exact FIA arguments, lazy imports."""

from __future__ import annotations

import ast
import importlib.abc
import pathlib
import sys
from importlib.machinery import ModuleSpec

import pytest
import torch

from diffusion_kv.integrations import vllm_ascend
from diffusion_kv.platforms.interface import Availability
from diffusion_kv.platforms.npu import NpuPlatform, kernels
from diffusion_kv.platforms.npu.kernels import (
    AscendKernels,
    accepts_keyword,
    compressed_causal_mask,
    loaded_emulator,
    torch_npu_availability,
)
from diffusion_kv.testing import EmulatorProfile, TorchNpuEmulator, emulated_torch_npu

from .helpers import without_torch_npu

F16 = torch.float16
PLUGIN_DIR = pathlib.Path(kernels.__file__).parent
VLLM_ASCEND_DIR = pathlib.Path(vllm_ascend.__file__).parent


@pytest.mark.parametrize(
    ("profile", "writer"),
    [
        (EmulatorProfile(), "npu_scatter_pa_kv_cache"),
        (EmulatorProfile(scatter_cache_mode=False), "_npu_reshape_and_cache"),
        (EmulatorProfile(scatter_pa_kv_cache=False), "_npu_reshape_and_cache"),
    ],
    ids=["scatter-with-cache-mode", "scatter-without-cache-mode", "no-scatter"],
)
def test_writer_is_chosen_by_what_torch_npu_offers(profile: EmulatorProfile, writer: str) -> None:
    emu = TorchNpuEmulator(profile)
    seam = AscendKernels(emu.module)
    assert seam.writer == writer and seam.emulated
    kc = torch.zeros(1, 128, 1, 8, dtype=F16)
    vc = torch.zeros(1, 128, 1, 8, dtype=F16)
    key = torch.ones(2, 1, 8, dtype=F16)
    seam.write_kv(key, key * 3, kc, vc, torch.tensor([5, 7], dtype=torch.int32))
    assert emu.ops() == [writer]
    assert kc[0, [5, 7], 0, 0].tolist() == [1.0, 1.0] and vc[0, [5, 7], 0, 0].tolist() == [3.0, 3.0]
    if writer == "npu_scatter_pa_kv_cache":
        assert emu.calls[0].args == {"cache_mode": "Norm"}


def test_no_usable_writer_is_reported_with_the_fix() -> None:
    emu = TorchNpuEmulator(EmulatorProfile(scatter_cache_mode=False, reshape_and_cache=False))
    with pytest.raises(NotImplementedError) as info:
        AscendKernels(emu.module)
    message = str(info.value)
    assert "torch_npu 2.10.0.post4 offers no usable paged K/V writer" in message
    assert "npu_scatter_pa_kv_cache is without a cache_mode argument" in message
    assert "_npu_reshape_and_cache is missing" in message


def test_missing_fia_is_reported() -> None:
    emu = TorchNpuEmulator(EmulatorProfile(fused_infer_attention=False))
    with pytest.raises(NotImplementedError, match="has no npu_fused_infer_attention_score"):
        AscendKernels(emu.module)


def test_writer_inputs_are_made_contiguous() -> None:
    emu = TorchNpuEmulator()
    seam = AscendKernels(emu.module)
    kc = torch.zeros(1, 128, 2, 8, dtype=F16)
    vc = torch.zeros(1, 128, 2, 8, dtype=F16)
    packed = torch.arange(2 * 3 * 8, dtype=F16).reshape(2, 3, 8)
    key = packed[:, :2]  # a strided view, as the core may pass it
    assert not key.is_contiguous()
    seam.write_kv(key, key, kc, vc, torch.tensor([0, 1], dtype=torch.int32))
    assert torch.equal(kc[0, :2], key)
    assert emu.calls[0].shapes["key"] == (2, 2, 8)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_attention_arguments(causal: bool) -> None:
    emu = TorchNpuEmulator()
    seam = AscendKernels(emu.module)
    kc = torch.zeros(3, 128, 2, 64, dtype=F16)
    vc = torch.zeros(3, 128, 2, 64, dtype=F16)
    mask = compressed_causal_mask(torch.device("cpu"))
    out = seam.paged_attention(
        torch.zeros(5, 4, 64, dtype=F16),
        kc,
        vc,
        block_table=torch.tensor([[2], [0]], dtype=torch.int32),
        actual_seq_lengths=(2, 5),
        actual_seq_lengths_kv=(7, 3),
        num_heads=4,
        num_kv_heads=2,
        scale=0.125,
        causal=causal,
        causal_mask=mask,
    )
    assert out.shape == (5, 4, 64) and out.dtype == F16
    (call,) = emu.calls
    assert call.op == "npu_fused_infer_attention_score"
    assert call.args == {
        "input_layout": "TND",
        "sparse_mode": 3 if causal else 0,
        "block_size": 128,
        "num_heads": 4,
        "num_key_value_heads": 2,
        "scale": 0.125,
        "actual_seq_lengths": [2, 5],
        "actual_seq_lengths_kv": [7, 3],
    }
    assert call.shapes["key"] == (3, 128, 128)  # (blocks, block_size, kv_heads * head_size)
    assert call.dtypes["block_table"] == torch.int32
    if causal:
        assert call.shapes["atten_mask"] == (2048, 2048) and call.dtypes["atten_mask"] == torch.int8
    else:
        assert "atten_mask" not in call.shapes


def test_causal_call_without_mask_is_refused_before_the_op() -> None:
    emu = TorchNpuEmulator()
    seam = AscendKernels(emu.module)
    kc = torch.zeros(1, 128, 1, 8, dtype=F16)
    with pytest.raises(ValueError, match="needs the compressed causal mask"):
        seam.paged_attention(
            torch.zeros(1, 1, 8, dtype=F16),
            kc,
            kc,
            block_table=torch.tensor([[0]], dtype=torch.int32),
            actual_seq_lengths=(1,),
            actual_seq_lengths_kv=(1,),
            num_heads=1,
            num_kv_heads=1,
            scale=1.0,
            causal=True,
            causal_mask=None,
        )
    assert emu.calls == []


def test_compressed_mask_is_the_triu_template_cached_per_device() -> None:
    mask = compressed_causal_mask(torch.device("cpu"))
    assert mask.shape == (2048, 2048) and mask.dtype == torch.int8
    assert mask[0, :3].tolist() == [0, 1, 1] and mask[2, :4].tolist() == [0, 0, 0, 1]
    assert int(mask.sum()) == 2048 * 2047 // 2
    assert compressed_causal_mask(torch.device("cpu")) is mask


def test_accepts_keyword_reads_schemas_and_signatures() -> None:
    emu = TorchNpuEmulator()
    assert accepts_keyword(emu.module.npu_scatter_pa_kv_cache, "cache_mode")
    assert not accepts_keyword(emu.module._npu_reshape_and_cache, "cache_mode")

    def plain(key: object, *, cache_mode: str = "PA_NZ") -> None: ...

    assert accepts_keyword(plain, "cache_mode") and not accepts_keyword(plain, "slot_indices")
    assert not accepts_keyword(object(), "cache_mode")


@without_torch_npu
def test_load_takes_the_installed_emulator() -> None:
    assert loaded_emulator() is None
    with pytest.raises(ModuleNotFoundError):
        AscendKernels.load()
    with emulated_torch_npu() as emu:
        assert loaded_emulator() is emu.module
        assert AscendKernels.load().module is emu.module
    assert loaded_emulator() is None


class _BrokenTorchNpu(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``torch_npu`` and fails to load it, as torch_npu does without the CANN libraries."""

    def find_spec(self, name: str, path: object = None, target: object = None) -> ModuleSpec | None:
        return ModuleSpec(name, self) if name == "torch_npu" else None

    def create_module(self, spec: ModuleSpec) -> None:
        return None

    def exec_module(self, module: object) -> None:
        raise ImportError("libascendcl.so: cannot open shared object file")


@without_torch_npu
def test_torch_npu_availability_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    assert torch_npu_availability() == Availability(False, "torch_npu is not installed")
    with emulated_torch_npu():
        assert torch_npu_availability() == Availability(True, "torch_npu emulator (CPU)")
    monkeypatch.setattr(sys, "meta_path", [_BrokenTorchNpu(), *sys.meta_path])
    assert torch_npu_availability() == Availability(
        False, "torch_npu failed to import: ImportError: libascendcl.so: cannot open shared object file"
    )
    assert NpuPlatform.is_available() == torch_npu_availability()
    assert "torch_npu" not in sys.modules


def _module_level_imports(path: pathlib.Path) -> list[str]:
    names: list[str] = []
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
    return names


def test_plugin_never_imports_vendor_modules_at_module_level() -> None:
    vendor = {"torch_npu", "vllm", "vllm_ascend", "acl"}
    paths = sorted(PLUGIN_DIR.glob("*.py")) + sorted(VLLM_ASCEND_DIR.glob("*.py"))
    offenders = [
        f"{path.parent.name}/{path.name}: {n}"
        for path in paths
        for n in _module_level_imports(path)
        if n.split(".")[0] in vendor
    ]
    assert [p.name for p in sorted(PLUGIN_DIR.glob("*.py"))] == [
        "__init__.py",
        "compat.py",
        "constraints.py",
        "direct.py",
        "kernels.py",
        "runtime.py",
    ]
    assert [p.name for p in sorted(VLLM_ASCEND_DIR.glob("*.py"))] == ["__init__.py", "backend.py"]
    assert offenders == []


def test_platform_never_imports_integrations_at_module_level() -> None:
    offenders = [
        f"{path.name}: {n}"
        for path in sorted(PLUGIN_DIR.glob("*.py"))
        for n in _module_level_imports(path)
        if n.startswith("diffusion_kv.integrations")
    ]
    assert offenders == []
