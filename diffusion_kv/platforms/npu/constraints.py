"""Ascend operator limits, declared once as data, each with the released file it comes from.

The plugin declares only what the released wheels document for the call it makes
(``npu_fused_infer_attention_score`` with a TND query and PageAttention, and
``npu_scatter_pa_kv_cache`` with ND caches): :data:`DOCUMENTED_LIMITS` lists every limit with
its value and the wheel file that states it, and ``docs/ascend.md`` renders the same table.
``ci/npu_contract_lane.sh`` re-reads the limits from the wheels' own files at CI time and fails
when a declared value and the wheel disagree.

Both npu paged backends (``direct`` and ``vllm-ascend``) declare :data:`CAPABILITIES` and add
:func:`head_count_reasons` (limits ``Capabilities`` has no field for) and
:func:`unverified_notes` (what is outside the documentation, said as such) in their
``not_supported_reasons``.

Beyond the documentation: float16 and head size 64 are *unverified* (torch_npu's TND text lists
neither); they are not declared, and :func:`unverified_notes` says so wherever a caller asks for
them. Hardware runs decide them (docs/ascend.md, "first checks for a hardware run").
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from diffusion_kv.core.attention import AttentionMode
from diffusion_kv.core.capabilities import BASE_MODES, dtype_name
from diffusion_kv.platforms.interface import Capabilities, Requirements

DOCS_FILE = "torch_npu/_op_plugin_docs.py"
"""The file of torch-npu's wheel (2.10.0.post4 and 2.14.0 carry identical text for both ops)."""
VLLM_ASCEND_ATTENTION_FILE = "vllm_ascend/attention/attention_v1.py"
VLLM_ASCEND_BLOCK_TABLE_FILE = "vllm_ascend/worker/v2/block_table.py"

FIA_V1 = "npu_fused_infer_attention_score"
FIA_V2 = "npu_fused_infer_attention_score_v2"
SCATTER = "npu_scatter_pa_kv_cache"


@dataclass(frozen=True)
class DocumentedLimit:
    """One limit the plugin declares, with where the released wheels state it."""

    name: str
    value: str
    source: str
    """The wheel file (and the operator whose documentation block) stating the limit."""
    note: str = ""


DTYPES = frozenset({torch.bfloat16})
"""FIA's TND documentation (v1 and v2 entry points): bfloat16 only."""
UNVERIFIED_DTYPES = frozenset({torch.float16})
"""Listed for FIA in general, but not for the TND layout: unverified, not declared."""

HEAD_SIZES = frozenset({128, 192})
"""Query/key head sizes the TND text lists (v2: 128 or 192; v1: 192). Value head size equals
the query's here (the plugin's caches hold one head size)."""
UNVERIFIED_HEAD_SIZES = frozenset({64})
"""Head sizes an earlier version of this plugin declared although no TND text lists them."""

KERNEL_BLOCK_SIZE = 128
"""PageAttention with multi-token queries takes multiples of 128 in [128, 512]; 128 is the only
kernel block size vllm-ascend's attention backend reports."""

MAX_TOKENS_PER_CALL = 65536
"""``T`` (query tokens of one call) for the TND layout of ``npu_fused_infer_attention_score``
(the v1 entry point the plugin calls; v2 documents 1M)."""
MAX_TOKENS_PER_CALL_V2 = 1 << 20
"""``T`` for the v2 entry point ("1M"); the plugin does not call v2."""

MAX_ROWS_PER_CALL = 4096
"""Entries of the cumulative length lists for the TND layout (stated on the v2 page; the v1
page names no TND row limit)."""

MAX_HEADS = 256
"""Upper bound of both ``num_heads`` and ``num_key_value_heads``."""

MAX_GQA_RATIO = 64
"""``num_heads / num_key_value_heads`` upper bound."""

MAX_KV_HEADS_X_HEAD_SIZE = 65535
"""Bound on ``num_kv_heads * head_size`` for the 3-D ``(blocks, block_size, H*D)`` cache view."""

MASK_SIZE = 2048
"""Side of the compressed causal mask template used with ``sparse_mode=3``."""

DOCUMENTED_LIMITS: tuple[DocumentedLimit, ...] = (
    DocumentedLimit(
        "dtype",
        "bfloat16",
        f"{DOCS_FILE} ({FIA_V1} and {FIA_V2}: TND constraints)",
        "float16 is listed for FIA in general but not for TND: unverified, not declared",
    ),
    DocumentedLimit(
        "head size",
        "128, 192",
        f"{DOCS_FILE} ({FIA_V2}: TND constraints; the {FIA_V1} page lists 192 only)",
        "64 is in no TND text: unverified, not declared",
    ),
    DocumentedLimit(
        "query tokens per call",
        f"<= {MAX_TOKENS_PER_CALL}",
        f"{DOCS_FILE} ({FIA_V1}: TND constraints; {FIA_V2}: 1M)",
    ),
    DocumentedLimit(
        "rows per call",
        f"<= {MAX_ROWS_PER_CALL}",
        f"{DOCS_FILE} ({FIA_V2}: TND constraints)",
    ),
    DocumentedLimit(
        "kernel block size",
        str(KERNEL_BLOCK_SIZE),
        f"{DOCS_FILE} ({FIA_V1}: page attention, 128-512 in steps of 128); "
        f"{VLLM_ASCEND_ATTENTION_FILE} (get_supported_kernel_block_sizes: [128])",
    ),
    DocumentedLimit(
        "heads",
        f"num_heads, num_kv_heads <= {MAX_HEADS}; num_heads divisible by num_kv_heads, ratio <= {MAX_GQA_RATIO}",
        f"{DOCS_FILE} ({FIA_V1}: num_key_value_heads, Q_S > 1 constraints; {FIA_V2}: TND constraints)",
        "the v1 TND text also asks N in {8, 16, 32, 64, 128} with equal query and KV heads (first hardware check)",
    ),
    DocumentedLimit(
        "num_kv_heads * head_size",
        f"<= {MAX_KV_HEADS_X_HEAD_SIZE}",
        f"{DOCS_FILE} ({FIA_V1}: page attention with (blocknum, blocksize, H) caches)",
    ),
    DocumentedLimit(
        "causal / full calls",
        f"sparse_mode=3 with the int8 {MASK_SIZE}x{MASK_SIZE} upper-triangular mask; sparse_mode=0 without mask",
        f"{DOCS_FILE} ({FIA_V1}: TND constraints, sparse_mode)",
        "the TND text asks query length < KV length per row for sparse_mode=3; equal lengths are a first hardware check",
    ),
    DocumentedLimit(
        "slot mapping",
        "int32; every written slot in [0, blocks * block_size - 1], no duplicates",
        f"{DOCS_FILE} ({SCATTER}: slot_mapping range); {VLLM_ASCEND_BLOCK_TABLE_FILE} (int32 slot_mappings)",
        "negative slots are never passed: the plugin drops -1 (padding) slots before the writer",
    ),
)
"""Every declared limit with its source; docs/ascend.md renders this table."""

CAPABILITIES = Capabilities(
    dtypes=DTYPES,
    head_sizes=HEAD_SIZES,
    kernel_block_sizes=(KERNEL_BLOCK_SIZE,),
    slot_mapping_dtypes=frozenset({torch.int32}),
    attention_modes=BASE_MODES,
    supports_gqa=True,
    supports_ulysses=False,
    supports_dcp=False,
    supports_graph_capture=False,
    max_rows_per_call=MAX_ROWS_PER_CALL,
    max_kv_heads_x_head_size=MAX_KV_HEADS_X_HEAD_SIZE,
    max_gqa_ratio=MAX_GQA_RATIO,
)


DIRECT_CAPABILITIES = replace(
    CAPABILITIES,
    attention_modes=BASE_MODES | {AttentionMode.CHUNK_CAUSAL},
    max_window=None,
    max_sink=None,
)
"""The ``direct`` backend's declaration: :data:`CAPABILITIES` plus chunk-causal masks with any
window and sink, served as full-attention FIA rows over whole pages (one row per chunk of
queries, its block table listing only the pages the chunk sees), so the chunk, the window and
the sink must be multiples of the 128-token page (:func:`planned_mask_reasons`)."""


def planned_mask_reasons(requirements: Requirements) -> list[str]:
    """Why the ``direct`` backend cannot serve a chunk, window or sink mask (empty: it can).

    FIA takes no mask but its compressed causal one (``sparse_mode=3``) or none
    (``sparse_mode=0``); a chunk of a chunk-causal mask sees the same keys from every query,
    so it runs as one full row whose block table lists the pages it sees -- exact only when
    every boundary of what it sees falls on a page boundary."""
    modes = requirements.attention_modes
    planned = AttentionMode.CHUNK_CAUSAL in modes or requirements.window is not None or requirements.sink
    if not planned:
        return []
    reasons: list[str] = []
    if AttentionMode.CHUNK_CAUSAL not in modes:
        reasons.append(
            f"window={requirements.window} / sink={requirements.sink} on a causal or full mask (FIA "
            "serves a window and sinks only as whole pages of a chunk-causal mask)"
        )
    off = [
        f"{name}={value}"
        for name in ("chunk", "window", "sink")
        if (value := getattr(requirements, name)) and value % KERNEL_BLOCK_SIZE
    ]
    if off:
        reasons.append(
            f"{', '.join(off)} tokens off the {KERNEL_BLOCK_SIZE}-token page (a chunk runs as one "
            "full-attention FIA row over the whole pages it sees)"
        )
    return reasons


def head_count_reasons(requirements: Requirements) -> list[str]:
    """Limits ``Capabilities`` has no field for: the per-call head counts."""
    reasons: list[str] = []
    if requirements.num_heads is not None and requirements.num_heads > MAX_HEADS:
        reasons.append(f"num_heads={requirements.num_heads} exceeds {MAX_HEADS}")
    if requirements.num_kv_heads is not None and requirements.num_kv_heads > MAX_HEADS:
        reasons.append(f"num_kv_heads={requirements.num_kv_heads} exceeds {MAX_HEADS}")
    return reasons


UNVERIFIED_SUMMARY = (
    "unverified, not declared: dtype float16 and head size 64 (torch_npu's TND documentation of "
    f"{FIA_V1} lists neither; first checks for a hardware run, docs/ascend.md)"
)


def unverified_notes(requirements: Requirements) -> list[str]:
    """For a request outside the documentation that an earlier declaration covered: say that it
    is unverified (it is refused either way, by the capability check)."""
    notes: list[str] = []
    if requirements.dtype in UNVERIFIED_DTYPES:
        assert requirements.dtype is not None
        notes.append(
            f"dtype={dtype_name(requirements.dtype)} is unverified on Ascend: the TND documentation of "
            f"{FIA_V1} lists bfloat16 only"
        )
    if requirements.kv_cache_dtype not in (None, requirements.dtype):
        notes.append(
            f"kv_cache_dtype={dtype_name(requirements.kv_cache_dtype)} is not wired on Ascend: {SCATTER} in "
            f"{DOCS_FILE} lists fp8 cache dtypes and {FIA_V1} takes key/value_antiquant_scale, but neither "
            "path is implemented or hardware-checked by this plugin"
        )
    if requirements.head_size in UNVERIFIED_HEAD_SIZES:
        notes.append(
            f"head_size={requirements.head_size} is unverified on Ascend: the TND documentation of "
            f"{FIA_V1} lists {sorted(HEAD_SIZES)}"
        )
    return notes
