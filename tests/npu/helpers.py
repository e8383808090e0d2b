"""Shared helpers of the npu tests."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from diffusion_kv.core.backend import GroupContext
from diffusion_kv.core.batch import LayerGeometry, PagedBatch
from diffusion_kv.core.block_tables import TorchBlockTables
from diffusion_kv.core.capabilities import AttentionMode
from diffusion_kv.core.host import HostRuntime
from diffusion_kv.core.layout import single_group_layout


def _torch_npu_installed() -> bool:
    try:
        return importlib.util.find_spec("torch_npu") is not None
    except ValueError:  # a module without a spec sits in sys.modules
        return True


BF16 = torch.bfloat16
"""The one dtype the wheels' TND documentation lists (what the plugin declares)."""
HEAD = 128
"""A documented TND head size (128 or 192)."""


without_torch_npu = pytest.mark.skipif(
    _torch_npu_installed(), reason="asserts what happens on a machine without torch_npu"
)
"""For CPU-lane tests whose expectations assume torch_npu is absent."""


def paged_batch(
    query_lens: list[int],
    seq_lens: list[int],
    *,
    mode: AttentionMode = AttentionMode.CAUSAL,
    table_dtype: torch.dtype = torch.int32,
) -> PagedBatch:
    """A one-group batch with the given per-row query and KV lengths (block table of zeros)."""
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    tokens = int(qsl[-1])
    return PagedBatch(
        num_reqs=len(query_lens),
        num_tokens=tokens,
        query_start_loc=qsl,
        query_start_loc_cpu=qsl,
        max_query_len=max(query_lens),
        seq_lens=seq,
        seq_lens_cpu=seq,
        max_seq_len=max(seq_lens),
        positions=torch.zeros(tokens, dtype=torch.long),
        block_table=torch.zeros(len(query_lens), 1, dtype=table_dtype),
        slot_mapping=torch.zeros(tokens, dtype=torch.int32),
        mode=mode,
    )


def common_batch(num_reqs: int) -> PagedBatch:
    """A neutral causal batch of ``num_reqs`` one-token rows over one-token sequences."""
    return paged_batch([1] * num_reqs, [1] * num_reqs)


def group_context(
    layers: tuple[LayerGeometry, ...],
    *,
    block_size: int = 128,
    kernel_block_size: int | None = None,
    cp_size: int = 1,
    slot_mapping_dtype: torch.dtype = torch.int32,
    index: int = 0,
    mode: AttentionMode = AttentionMode.CAUSAL,
    host: HostRuntime | None = None,
) -> GroupContext:
    """The GroupContext the runner would hand a backend for one group of ``layers`` (built by
    hand, so a backend's own checks can be reached past selection)."""
    kernel = kernel_block_size if kernel_block_size is not None else block_size
    first = layers[0]
    layout = single_group_layout(
        [layer.layer_name for layer in layers],
        num_kv_heads=first.num_kv_heads,
        head_size=first.head_size,
        dtype=first.dtype,
        block_size=block_size,
        num_blocks=4,
        max_model_len=4 * block_size,
        max_rows_per_request=1,
        max_num_seqs=8,
        mode=mode,
    )
    tables = TorchBlockTables(
        block_sizes=[block_size],
        max_num_reqs=8,
        max_num_batched_tokens=4 * block_size,
        max_num_blocks_per_group=[4],
        device="cpu",
        kernel_block_sizes=[kernel],
        cp_size=cp_size,
        slot_mapping_dtype=slot_mapping_dtype,
    )
    return GroupContext(
        index=index,
        layers=layers,
        mode=mode,
        block_size=block_size,
        kernel_block_size=kernel,
        num_blocks=4,
        block_tables=tables,
        layout=layout,
        device=torch.device("cpu"),
        platform_name="npu",
        host=host,
    )
