"""Ascend operator limits, declared once as data.

The numbers come from the torch_npu / CANN documentation of the two operators the plugin
calls (``npu_fused_infer_attention_score`` with TND query layout and PageAttention, and
``npu_scatter_pa_kv_cache``) and from vllm-ascend's attention backend. Both npu paged backends
(``direct`` and ``vllm-ascend``) declare :data:`CAPABILITIES` (so selection, ``explain`` and the
conformance kit see them) and add :func:`head_count_reasons`, the few limits that
``Capabilities`` has no field for, in their ``not_supported_reasons``.

Slot mappings are int32 only: both K/V writers (``npu_scatter_pa_kv_cache`` and the ATB
``_npu_reshape_and_cache``) and vllm-ascend's ``AscendBlockTables`` take int32 slots.
"""

from __future__ import annotations

import torch

from diffusion_kv.platforms.interface import AttentionMode, Capabilities, Requirements

KERNEL_BLOCK_SIZE = 128
"""The only kernel block size vllm-ascend's attention backend reports (PageAttention with
multi-token queries needs a multiple of 128 in [128, 512]; 128 is what is exercised)."""

HEAD_SIZES = frozenset({64, 128, 192})
"""Head sizes the FIA documentation lists for the TND layout (64 documented for MHA only;
see docs/ascend.md). 512 exists on hardware but vllm-ascend routes it around FIA."""

MAX_ROWS_PER_CALL = 4096
"""Entries allowed in ``actual_seq_lengths`` for the TND layout."""

MAX_HEADS = 256
"""Upper bound of both ``num_heads`` and ``num_key_value_heads``."""

MAX_GQA_RATIO = 64
"""``num_heads / num_key_value_heads`` upper bound."""

MAX_KV_HEADS_X_HEAD_SIZE = 65535
"""Bound on ``num_kv_heads * head_size`` for the 3-D ``(blocks, block_size, H*D)`` cache view."""

MASK_SIZE = 2048
"""Side of the compressed causal mask template used with ``sparse_mode=3``."""

CAPABILITIES = Capabilities(
    dtypes=frozenset({torch.float16, torch.bfloat16}),
    head_sizes=HEAD_SIZES,
    kernel_block_sizes=(KERNEL_BLOCK_SIZE,),
    slot_mapping_dtypes=frozenset({torch.int32}),
    attention_modes=frozenset(AttentionMode),
    supports_gqa=True,
    supports_ulysses=False,
    supports_dcp=False,
    supports_graph_capture=False,
    max_rows_per_call=MAX_ROWS_PER_CALL,
    max_kv_heads_x_head_size=MAX_KV_HEADS_X_HEAD_SIZE,
    max_gqa_ratio=MAX_GQA_RATIO,
)


def head_count_reasons(requirements: Requirements) -> list[str]:
    """Limits ``Capabilities`` has no field for: the per-call head counts."""
    reasons: list[str] = []
    if requirements.num_heads is not None and requirements.num_heads > MAX_HEADS:
        reasons.append(f"num_heads={requirements.num_heads} exceeds {MAX_HEADS}")
    if requirements.num_kv_heads is not None and requirements.num_kv_heads > MAX_HEADS:
        reasons.append(f"num_kv_heads={requirements.num_kv_heads} exceeds {MAX_HEADS}")
    return reasons
