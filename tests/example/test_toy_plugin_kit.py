"""The whole conformance kit against the documented minimal plugin (fixtures in conftest.py)."""

from diffusion_kv.conformance.test_paged_attention import *  # noqa: F403
