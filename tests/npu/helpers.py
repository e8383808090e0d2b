"""Shared helpers of the npu tests."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from diffusion_kv.core.batch import CommonBatchMetadata


def _torch_npu_installed() -> bool:
    try:
        return importlib.util.find_spec("torch_npu") is not None
    except ValueError:  # a module without a spec sits in sys.modules
        return True


without_torch_npu = pytest.mark.skipif(
    _torch_npu_installed(), reason="asserts what happens on a machine without torch_npu"
)
"""For CPU-lane tests whose expectations assume torch_npu is absent."""


def common_batch(num_reqs: int) -> CommonBatchMetadata:
    """A neutral batch of ``num_reqs`` one-token rows over one-token sequences."""
    qsl = torch.arange(num_reqs + 1, dtype=torch.int32)
    seq = torch.ones(num_reqs, dtype=torch.int32)
    return CommonBatchMetadata(
        num_reqs=num_reqs,
        num_tokens=num_reqs,
        query_start_loc=qsl,
        query_start_loc_cpu=qsl,
        max_query_len=1,
        seq_lens=seq,
        seq_lens_cpu=seq,
        max_seq_len=1,
        positions=torch.zeros(num_reqs, dtype=torch.long),
        block_tables=(torch.zeros(num_reqs, 1, dtype=torch.int32),),
        slot_mappings=torch.zeros(1, num_reqs, dtype=torch.int32),
        causal=True,
    )
