"""A tiny diffusion transformer with random weights (no downloads), dense or paged.

The sequence is ``[prefix | target]``: prefix tokens (the condition) attend causally, target
tokens form one bidirectional span over everything (the HunyuanImage-style mask,
``full_attn_spans = [(P, P + T)]``). The timestep embedding is added to target tokens only, so
the prefix's K/V at every layer is the same at every denoise step: that is what paging reuses.

* dense mode recomputes the whole sequence each step with a dense masked attention;
* paged mode computes everything at step 0 (writing every K/V into the pages) and afterwards
  only the target tokens, attending over the cached prefix pages.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, Protocol, TypeVar, cast

import torch
import torch.nn.functional as F
from torch import nn

from diffusion_kv.core.layer_context import AttentionMetadata

AttentionFn = Callable[[str, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""``(layer_name, q [B, L, H, D], k [B, L, Hkv, D], v) -> [B, L, H, D]``."""


@dataclass(frozen=True)
class TinyDiTConfig:
    hidden: int = 256
    heads: int = 4
    kv_heads: int = 4
    layers: int = 4
    mlp_ratio: int = 2
    rope: bool = True
    dtype: torch.dtype = torch.float32
    seed: int = 0

    @property
    def head_size(self) -> int:
        return self.hidden // self.heads

    def __post_init__(self) -> None:
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise ValueError(
                f"hidden={self.hidden} must divide by heads={self.heads}, and heads by kv_heads={self.kv_heads}"
            )
        if self.rope and self.head_size % 2:
            raise ValueError(f"RoPE needs an even head size; got {self.head_size}")


RopeTables = torch.Tensor
"""``[1, L, 1, D/2]`` complex64 rotations ``exp(i * position * inv_freq)``."""


def rope_tables(positions: torch.Tensor, head_size: int) -> RopeTables:
    """The rotations for absolute ``positions [L]``; computed once per model call and shared
    by every layer."""
    inv = 1.0 / (
        10000 ** (torch.arange(0, head_size, 2, device=positions.device, dtype=torch.float32) / head_size)
    )
    angles = positions.to(torch.float32)[:, None] * inv[None, :]  # [L, D/2]
    return torch.polar(torch.ones_like(angles), angles)[None, :, None, :]


def apply_rope(x: torch.Tensor, tables: RopeTables) -> torch.Tensor:
    """Rotary embedding over the last dim of ``x [B, L, N, D]`` (pairs ``(2j, 2j+1)`` rotated by
    ``tables``), in float32: one complex multiply for every head at once."""
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(pairs * tables).flatten(-2).to(x.dtype)


def rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotary embedding over the last dim of ``x [B, L, H, D]`` at absolute ``positions [L]``."""
    return apply_rope(x, rope_tables(positions, x.shape[-1]))


class Block(nn.Module):
    def __init__(self, cfg: TinyDiTConfig, index: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.name = f"blocks.{index}.attn"
        d = cfg.head_size
        self.norm1 = nn.LayerNorm(cfg.hidden)
        self.qkv = nn.Linear(cfg.hidden, (cfg.heads + 2 * cfg.kv_heads) * d)
        self.out = nn.Linear(cfg.hidden, cfg.hidden)
        self.norm2 = nn.LayerNorm(cfg.hidden)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.hidden, cfg.mlp_ratio * cfg.hidden),
            nn.GELU(),
            nn.Linear(cfg.mlp_ratio * cfg.hidden, cfg.hidden),
        )

    def pre(
        self, x: torch.Tensor, tables: RopeTables | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The layer up to attention: ``(q, k, v)`` of ``x [B, L, hidden]`` (views of one buffer).
        Functional calls on the modules' own weights (the modules' call machinery costs host
        time on every layer of every step)."""
        cfg = self.cfg
        B, L, _ = x.shape
        d = cfg.head_size
        H, Hkv = cfg.heads, cfg.kv_heads
        n1 = self.norm1
        h = F.layer_norm(x, n1.normalized_shape, n1.weight, n1.bias, n1.eps)
        qkv = F.linear(h, self.qkv.weight, self.qkv.bias).view(B, L, H + 2 * Hkv, d)
        qk = qkv[:, :, : H + Hkv]
        if tables is not None:  # queries and keys rotated together
            qk = apply_rope(qk, tables)
        return qk[:, :, :H], qk[:, :, H:], qkv[:, :, H + Hkv :]

    def post(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """The layer after attention: the residual stream from ``x`` and the attention output."""
        x = x + F.linear(attn.reshape(x.shape), self.out.weight, self.out.bias)
        n2 = self.norm2
        up, down = cast(nn.Linear, self.mlp[0]), cast(nn.Linear, self.mlp[2])
        h = F.layer_norm(x, n2.normalized_shape, n2.weight, n2.bias, n2.eps)
        return x + F.linear(F.gelu(F.linear(h, up.weight, up.bias)), down.weight, down.bias)

    def forward(self, x: torch.Tensor, tables: RopeTables | None, attention: AttentionFn) -> torch.Tensor:
        q, k, v = self.pre(x, tables)
        return self.post(x, attention(self.name, q, k, v))


class ModelShape(Protocol):
    """The model's fields of a run's configuration (the demo's, the session demo's)."""

    @property
    def hidden(self) -> int: ...
    @property
    def heads(self) -> int: ...
    @property
    def kv_heads(self) -> int: ...
    @property
    def layers(self) -> int: ...
    @property
    def dtype(self) -> torch.dtype: ...
    @property
    def seed(self) -> int: ...


DiT = TypeVar("DiT", bound="DiTBase")


class DiTBase(nn.Module):
    """What the tiny DiTs share: the timestep embedding, ``cfg.layers`` blocks of
    :attr:`block_type`, the final norm and projection, drawn from ``cfg.seed`` in that order (the
    global RNG state is left as it was), and the layers' names."""

    block_type: ClassVar[type[Block]] = Block

    def __init__(self, cfg: TinyDiTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        gen_state = torch.random.get_rng_state()
        torch.manual_seed(cfg.seed)
        self.time_embed = nn.Sequential(
            nn.Linear(16, cfg.hidden), nn.SiLU(), nn.Linear(cfg.hidden, cfg.hidden)
        )
        self.blocks = nn.ModuleList(self.block_type(cfg, i) for i in range(cfg.layers))
        self.final_norm = nn.LayerNorm(cfg.hidden)
        self.final = nn.Linear(cfg.hidden, cfg.hidden)
        torch.random.set_rng_state(gen_state)
        self.to(cfg.dtype)

    @classmethod
    def build(cls: type[DiT], shape: ModelShape, device: torch.device) -> DiT:
        """The model of ``shape``'s fields on ``device``, in eval mode."""
        cfg = TinyDiTConfig(
            hidden=shape.hidden,
            heads=shape.heads,
            kv_heads=shape.kv_heads,
            layers=shape.layers,
            dtype=shape.dtype,
            seed=shape.seed,
        )
        return cls(cfg).to(device).eval()

    @property
    def layer_names(self) -> list[str]:
        return [f"blocks.{i}.attn" for i in range(len(self.blocks))]

    def timestep(self, t: float | torch.Tensor, device: torch.device) -> torch.Tensor:
        """The timestep embedding; ``t`` a float or a 0-d device tensor (a captured step's input)."""
        freqs = torch.exp(-math.log(1000.0) * torch.arange(8, device=device, dtype=torch.float32) / 8)
        feats = torch.cat([torch.sin(t * 1000 * freqs), torch.cos(t * 1000 * freqs)])
        return self.time_embed(feats.to(self.cfg.dtype))  # type: ignore[no-any-return]


class TinyDiT(DiTBase):
    """The prefix-and-target DiT (module docstring): dense and paged steps."""

    def run(
        self, x: torch.Tensor, positions: torch.Tensor, attention: AttentionFn, target_len: int
    ) -> torch.Tensor:
        tables = rope_tables(positions, self.cfg.head_size) if self.cfg.rope else None
        for block in self.blocks:
            x = block(x, tables, attention)
        return self.final(self.final_norm(x[:, -target_len:]))  # type: ignore[no-any-return]

    def run_packed(
        self, x: torch.Tensor, positions: torch.Tensor, attention: AttentionFn, out_index: torch.Tensor
    ) -> torch.Tensor:
        """Tokens of several rows packed along one axis (``x [1, N, hidden]``, each token at its
        own absolute position): the output for the tokens at ``out_index`` (``[n, hidden]``)."""
        tables = rope_tables(positions, self.cfg.head_size) if self.cfg.rope else None
        for block in self.blocks:
            x = block(x, tables, attention)
        return self.final(self.final_norm(x[0].index_select(0, out_index)))  # type: ignore[no-any-return]

    # -- the two modes ------------------------------------------------------------------------

    def dense_step(self, prefix: torch.Tensor, target: torch.Tensor, t: float) -> torch.Tensor:
        """Recompute the whole ``[prefix | target]`` sequence densely.

        The mask (causal prefix, one bidirectional target span) is computed as two SDPA calls
        that the fastest kernels take (prefix queries: causal over the prefix; target queries:
        every key), not as one call with an arbitrary mask, which only slower kernels take: the
        baseline a paged step is compared with is the best dense one.
        """
        P = prefix.shape[1]
        T = target.shape[1]
        S = P + T
        x = torch.cat([prefix, target + self.timestep(t, prefix.device)], dim=1)
        groups = self.cfg.heads // self.cfg.kv_heads

        def attention(_name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            if groups > 1:
                k, v = k.repeat_interleave(groups, dim=2), v.repeat_interleave(groups, dim=2)
            qh, kh, vh = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            tail = F.scaled_dot_product_attention(qh[:, :, P:], kh, vh)
            if P == 0:  # no condition prefix: the target alone, bidirectional
                return tail.transpose(1, 2)
            head = F.scaled_dot_product_attention(qh[:, :, :P], kh[:, :, :P], vh[:, :, :P], is_causal=True)
            return torch.cat([head, tail], dim=2).transpose(1, 2)

        return self.run(x, torch.arange(S, device=prefix.device), attention, T)

    def paged_inputs(
        self, prefix: torch.Tensor, target: torch.Tensor, t: float | torch.Tensor, step: int
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """The paged step's input tokens, their absolute positions and the attention spans."""
        B, P, _ = prefix.shape
        S = P + target.shape[1]
        spans = AttentionMetadata(full_attn_spans=[[(P, S)]] * B)
        x_target = target + self.timestep(t, target.device)
        if step == 0:
            return torch.cat([prefix, x_target], dim=1), torch.arange(S, device=target.device), spans
        return x_target, torch.arange(P, S, device=target.device), spans

    def paged_step(
        self,
        prefix: torch.Tensor,
        target: torch.Tensor,
        t: float | torch.Tensor,
        step: int,
        paged_attention: Callable[
            [str, torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor
        ],
    ) -> torch.Tensor:
        """Step 0: the whole sequence (writes every K/V). Later: target tokens only."""
        T = target.shape[1]
        x, positions, spans = self.paged_inputs(prefix, target, t, step)

        def attention(name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return paged_attention(name, q, k, v, spans)

        return self.run(x, positions, attention, T)
