"""The whole conformance kit on the npu plugin, with torch_npu emulated on the CPU.

``dkv_platform`` comes from ``tests/npu/conftest.py`` (the npu plugin under the emulator);
the cases are the kit's own, unchanged.
"""

from diffusion_kv.conformance.test_paged_attention import *  # noqa: F403
