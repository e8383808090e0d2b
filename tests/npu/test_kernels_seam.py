"""The kernel seam: writer selection by what torch_npu offers (the ATB writer only when its
library loaded), exact FIA arguments, lazy imports."""

from __future__ import annotations

import ast
import importlib.abc
import pathlib
import sys
import types
from importlib.machinery import ModuleSpec

import pytest
import torch

from diffusion_kv.core.errors import PlatformUnavailableError
from diffusion_kv.integrations import vllm_ascend
from diffusion_kv.platforms.interface import Availability
from diffusion_kv.platforms.npu import NpuPlatform, kernels
from diffusion_kv.platforms.npu.kernels import (
    AscendKernels,
    accepts_keyword,
    atb_writer_problem,
    compressed_causal_mask,
    loaded_emulator,
    torch_npu_availability,
)
from diffusion_kv.testing import EmulatorProfile, TorchNpuEmulator, emulated_torch_npu

from .helpers import BF16, HEAD, without_torch_npu

F16 = torch.float16
LAZY_WRAPPER = (
    "_npu_reshape_and_cache is only torch_npu's lazy wrapper: its ATB library (libop_plugin_atb.so, "
    "which needs NNAL's libatb.so) did not load"
)
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
    """Without cache_mode and without NNAL: the ATB name exists (a lazy wrapper), so what
    decides is whether its library loaded."""
    emu = TorchNpuEmulator(EmulatorProfile(scatter_cache_mode=False, nnal_installed=False))
    assert hasattr(emu.module, "_npu_reshape_and_cache")
    with pytest.raises(NotImplementedError) as info:
        AscendKernels(emu.module)
    assert str(info.value) == (
        "torch_npu 2.10.0.post4 offers no usable paged K/V writer: npu_scatter_pa_kv_cache is without a "
        f"cache_mode argument and {LAZY_WRAPPER}. Install torch_npu 2.10.0.post4 or newer (its "
        "npu_scatter_pa_kv_cache takes cache_mode='Norm'), or install NNAL for the ATB _npu_reshape_and_cache "
        "(source /usr/local/Ascend/nnal/atb/set_env.sh before starting Python)."
    )
    scatter_only = TorchNpuEmulator(EmulatorProfile(nnal_installed=False))
    assert AscendKernels(scatter_only.module).writer == "npu_scatter_pa_kv_cache"


def test_atb_writer_problem_on_a_real_torch_npu(monkeypatch: pytest.MonkeyPatch) -> None:
    """A real torch_npu (no emulator marker): the dispatcher registration of atb::... decides,
    and the load error torch_npu kept (NNAL_EX) is quoted."""
    nnal = OSError(2, "Please check that the nnal package is installed.")
    atb_ops = types.SimpleNamespace(NNAL_EX=nnal)
    real = types.SimpleNamespace(
        _npu_reshape_and_cache=lambda **kw: None,
        op_plugin=types.SimpleNamespace(atb=types.SimpleNamespace(_atb_ops=atb_ops)),
    )
    monkeypatch.setattr(kernels, "_registered", lambda namespace, name: False)
    assert atb_writer_problem(real) == (
        f"{LAZY_WRAPPER} (FileNotFoundError: [Errno 2] Please check that the nnal package is installed.)"
    )
    atb_ops.NNAL_EX = None
    assert atb_writer_problem(real) == LAZY_WRAPPER
    monkeypatch.setattr(
        kernels, "_registered", lambda namespace, name: (namespace, name) == ("atb", "_npu_reshape_and_cache")
    )
    assert atb_writer_problem(real) is None
    assert atb_writer_problem(types.SimpleNamespace()) == "_npu_reshape_and_cache is missing"


def test_an_oserror_from_the_atb_writer_names_nnal() -> None:
    emu = TorchNpuEmulator(EmulatorProfile(scatter_cache_mode=False))
    seam = AscendKernels(emu.module)
    assert seam.writer == "_npu_reshape_and_cache"

    def no_library(**kwargs: object) -> None:
        raise OSError(2, "libatb.so: cannot open shared object file")

    setattr(emu.module, "_npu_reshape_and_cache", no_library)  # noqa: B010 - the module's attribute
    kc = torch.zeros(1, 128, 1, 8, dtype=F16)
    with pytest.raises(PlatformUnavailableError) as info:
        seam.write_kv(
            torch.ones(1, 1, 8, dtype=F16),
            torch.ones(1, 1, 8, dtype=F16),
            kc,
            kc,
            torch.tensor([0], dtype=torch.int32),
        )
    assert str(info.value) == (
        "npu: the ATB writer _npu_reshape_and_cache could not load its library (FileNotFoundError: [Errno 2] libatb.so: "
        "cannot open shared object file); source /usr/local/Ascend/nnal/atb/set_env.sh before starting Python"
    )


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
    kc = torch.zeros(3, 128, 2, HEAD, dtype=BF16)
    vc = torch.zeros(3, 128, 2, HEAD, dtype=BF16)
    mask = compressed_causal_mask(torch.device("cpu"))
    out = seam.paged_attention(
        torch.zeros(5, 4, HEAD, dtype=BF16),
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
    assert out.shape == (5, 4, HEAD) and out.dtype == BF16
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
    assert call.shapes["key"] == (3, 128, 2 * HEAD)  # (blocks, block_size, kv_heads * head_size)
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
        "slots.py",
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
