"""A tiny chunk-causal diffusion transformer with random weights (no downloads).

The autoregressive-diffusion shape of CausVid, Self-Forcing or LingBot-World at toy size: a
video is generated chunk by chunk; every chunk's tokens are denoised in a few steps, each step
running every layer's

* self-attention over the session: block-causal by chunk over the sink, a window of earlier
  chunks and the chunk itself (the attention function is the caller's: paged through
  :class:`~diffusion_kv.core.sessions.SessionCache`, a dense rolling cache, or a dense
  recompute);
* cross-attention to a short text context (per CFG branch), whose K/V are computed once per
  session by :func:`cross_attention_context` and read by every step of every chunk;
* an MLP.

The timestep embedding is added to every token of the chunk (the whole chunk sits at one noise
level), and RoPE rotates queries and keys at their absolute positions on the session's timeline,
so a chunk's K/V written at its last denoise step are what later chunks attend to.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from diffusion_kv.models.tiny_dit import Block, DiTBase, RopeTables, TinyDiTConfig, rope_tables

AttentionFn = Callable[[str, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""``(layer_name, q [B, L, H, D], k [B, L, Hkv, D], v) -> [B, L, H, D]``: self-attention."""


@dataclass(frozen=True)
class CrossContext:
    """The cross-attention K/V of one session: per layer ``(k, v)`` ``[B, H, Lt, D]`` (one row
    per CFG branch), computed once when the session begins."""

    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))


class SessionBlock(Block):
    """A :class:`~diffusion_kv.models.tiny_dit.Block` with cross-attention between the
    self-attention and the MLP."""

    def __init__(self, cfg: TinyDiTConfig, index: int) -> None:
        super().__init__(cfg, index)
        d = cfg.head_size
        self.norm_cross = nn.LayerNorm(cfg.hidden)
        self.cross_q = nn.Linear(cfg.hidden, cfg.heads * d)
        self.cross_kv = nn.Linear(cfg.hidden, 2 * cfg.heads * d)
        self.cross_out = nn.Linear(cfg.hidden, cfg.hidden)

    def cross_kv_of(self, text: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``text [B, Lt, hidden]`` -> ``(k, v)`` ``[B, H, Lt, D]``."""
        B, Lt, _ = text.shape
        kv = F.linear(text, self.cross_kv.weight, self.cross_kv.bias).view(B, Lt, 2, self.cfg.heads, -1)
        return kv[:, :, 0].transpose(1, 2).contiguous(), kv[:, :, 1].transpose(1, 2).contiguous()

    def session_forward(
        self,
        x: torch.Tensor,
        tables: RopeTables | None,
        attention: AttentionFn,
        cross: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        q, k, v = self.pre(x, tables)
        x = x + F.linear(attention(self.name, q, k, v).reshape(x.shape), self.out.weight, self.out.bias)
        B, L, _ = x.shape
        nc = self.norm_cross
        h = F.layer_norm(x, nc.normalized_shape, nc.weight, nc.bias, nc.eps)
        cq = (
            F.linear(h, self.cross_q.weight, self.cross_q.bias).view(B, L, self.cfg.heads, -1).transpose(1, 2)
        )
        ca = F.scaled_dot_product_attention(cq, cross[0], cross[1]).transpose(1, 2).reshape(B, L, -1)
        x = x + F.linear(ca, self.cross_out.weight, self.cross_out.bias)
        n2 = self.norm2
        up, down = cast(nn.Linear, self.mlp[0]), cast(nn.Linear, self.mlp[2])
        h = F.layer_norm(x, n2.normalized_shape, n2.weight, n2.bias, n2.eps)
        return x + F.linear(F.gelu(F.linear(h, up.weight, up.bias)), down.weight, down.bias)


class SessionDiT(DiTBase):
    """The chunk-causal DiT (module docstring): :class:`~diffusion_kv.models.tiny_dit.DiTBase`
    with :class:`SessionBlock` layers; weights drawn from ``cfg.seed``."""

    block_type = SessionBlock

    def embed(self, latent: torch.Tensor, t: float) -> torch.Tensor:
        """The model's input for ``latent [B, L, hidden]`` at noise level ``t``."""
        return latent + self.timestep(t, latent.device)

    def run(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        attention: AttentionFn,
        cross: CrossContext,
        out_tokens: int,
    ) -> torch.Tensor:
        """Every layer over the embedded tokens ``x [B, L, hidden]`` at absolute ``positions [L]``;
        the velocity of the last ``out_tokens`` tokens."""
        tables = rope_tables(positions, self.cfg.head_size) if self.cfg.rope else None
        for i, block in enumerate(self.blocks):
            x = cast(SessionBlock, block).session_forward(
                x, tables, attention, (cross.keys[i], cross.values[i])
            )
        return self.final(self.final_norm(x[:, -out_tokens:]))  # type: ignore[no-any-return]


def cross_attention_context(model: SessionDiT, text: torch.Tensor) -> CrossContext:
    """The session's cross-attention K/V for ``text [B, Lt, hidden]`` (one row per CFG branch),
    computed once per session and held as plain dense tensors.

    The one seam for per-session cross-attention context pools: where the core keeps a
    session's context K/V in its own pool, this function is what switches to it."""
    with torch.no_grad():
        pairs = [cast(SessionBlock, b).cross_kv_of(text) for b in model.blocks]
    return CrossContext(tuple(k for k, _ in pairs), tuple(v for _, v in pairs))


__all__ = ["AttentionFn", "CrossContext", "SessionBlock", "SessionDiT", "cross_attention_context"]
