"""Runs the conformance kit inside the project's own suite.

The kit's cases are imported here so that ``pytest`` (the README's test command) runs them on
the platform given by ``--dkv-platform`` (default: automatic selection, ``cpu`` in CI).
"""

from diffusion_kv.conformance.test_paged_attention import *  # noqa: F403
