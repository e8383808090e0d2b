"""What a layer attends to, as a value.

* :class:`AttentionMode` — the kinds of masks (what capabilities declare and segments carry);
* :class:`MaskSpec` — one layer's parametrised mask: its kind, chunk size, sliding window and
  sink, answering the three questions the core asks (:meth:`MaskSpec.row_mask`, the dense
  oracle; :meth:`MaskSpec.block_plan`, which kv-blocks a row skips, reads in full or reads
  partially; :meth:`MaskSpec.retention`, which keys a row no longer needs);
* :class:`BlockPlan` — the per-row block classification, built once at prepare.

The modules here import nothing else of the package but :mod:`diffusion_kv.core.errors`, so
every other module (capabilities, piecewise, batch, runner) may import them.
"""

from diffusion_kv.core.attention.mask import (
    MaskSpec,
    Retention,
    dense_piecewise_mask,
    key_bounds,
)
from diffusion_kv.core.attention.mode import AttentionMode
from diffusion_kv.core.attention.plan import BlockKind, BlockPlan, build_block_plan

__all__ = [
    "AttentionMode",
    "BlockKind",
    "BlockPlan",
    "MaskSpec",
    "Retention",
    "build_block_plan",
    "dense_piecewise_mask",
    "key_bounds",
]
