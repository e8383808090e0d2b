"""Test support for diffusion-kv and for plugin authors' own suites.

:mod:`diffusion_kv.testing.torch_npu_emulator` is a pure-PyTorch emulator of the torch_npu
operators the npu plugin calls; :func:`emulated_torch_npu` installs it as ``torch_npu``.
:mod:`diffusion_kv.testing.npu_contract` binds it to a released torch-npu wheel's own schemas
and meta functions (what ``ci/npu_contract_lane.sh`` does).
"""

from diffusion_kv.testing.torch_npu_emulator import (
    EmulatedCall,
    EmulatedNpuError,
    EmulatorProfile,
    TorchNpuEmulator,
    emulated_torch_npu,
)

__all__ = [
    "EmulatedCall",
    "EmulatedNpuError",
    "EmulatorProfile",
    "TorchNpuEmulator",
    "emulated_torch_npu",
]
