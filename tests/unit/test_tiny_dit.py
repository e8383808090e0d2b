"""The tiny DiTs' shared construction (:class:`DiTBase`): the weights a seed draws, in which
order, what the prefix-and-target and the session model share, and the builders from a run's
configuration."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from diffusion_kv.models.demo import DemoConfig, build_model
from diffusion_kv.models.session import SessionConfig, build_session_model
from diffusion_kv.models.session_dit import SessionBlock, SessionDiT
from diffusion_kv.models.tiny_dit import Block, DiTBase, TinyDiT, TinyDiTConfig

CFG = TinyDiTConfig(hidden=32, heads=4, kv_heads=2, layers=3, seed=7)


def drawn_in_order(block_type: type[Block], cfg: TinyDiTConfig) -> dict[str, torch.Tensor]:
    """The weights ``cfg.seed`` gives when the modules are drawn in the documented order: the
    timestep embedding, each block, the final norm, the final projection."""
    torch.manual_seed(cfg.seed)
    modules = nn.ModuleDict(
        {
            "time_embed": nn.Sequential(
                nn.Linear(16, cfg.hidden), nn.SiLU(), nn.Linear(cfg.hidden, cfg.hidden)
            ),
            "blocks": nn.ModuleList(block_type(cfg, i) for i in range(cfg.layers)),
            "final_norm": nn.LayerNorm(cfg.hidden),
            "final": nn.Linear(cfg.hidden, cfg.hidden),
        }
    )
    return {k: v.to(cfg.dtype) for k, v in modules.state_dict().items()}


def assert_same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(a) == list(b)
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert torch.equal(a[name], b[name]), name


@pytest.mark.parametrize("model_type", [TinyDiT, SessionDiT])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_seed_draws_the_documented_order_and_leaves_the_global_rng_alone(
    model_type: type[DiTBase], dtype: torch.dtype
) -> None:
    cfg = TinyDiTConfig(hidden=32, heads=4, kv_heads=2, layers=3, seed=7, dtype=dtype)
    torch.manual_seed(123)
    rng = torch.random.get_rng_state()
    model = model_type(cfg)
    assert torch.equal(torch.random.get_rng_state(), rng)
    assert [type(b) for b in model.blocks] == [model_type.block_type] * 3
    assert model.layer_names == ["blocks.0.attn", "blocks.1.attn", "blocks.2.attn"]
    assert_same_state(model.state_dict(), drawn_in_order(model_type.block_type, cfg))


def test_the_session_model_shares_what_it_draws_before_its_first_cross_attention() -> None:
    """Same seed: the timestep embedding and block 0's self-attention and MLP are the same
    tensors in both models (a session block draws its cross-attention after them); the later
    blocks differ, their draws shifted by block 0's cross-attention."""
    assert TinyDiT.block_type is Block and SessionDiT.block_type is SessionBlock
    plain, session = TinyDiT(CFG).state_dict(), SessionDiT(CFG).state_dict()
    shared = [k for k in plain if k.startswith(("time_embed.", "blocks.0."))]
    assert len(shared) == 4 + 12  # two linears; norm1, qkv, out, norm2, two MLP linears
    for name in shared:
        assert torch.equal(plain[name], session[name]), name
    assert not torch.equal(plain["blocks.1.qkv.weight"], session["blocks.1.qkv.weight"])
    cross = {k for k in session if k not in plain}
    assert cross == {
        f"blocks.{i}.{m}.{p}"
        for i in range(3)
        for m in ("norm_cross", "cross_q", "cross_kv", "cross_out")
        for p in ("weight", "bias")
    }


def test_the_session_embedding_is_the_latent_plus_the_timestep_embedding() -> None:
    model = SessionDiT(CFG)
    latent = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = latent + model.timestep(0.25, latent.device)
        assert torch.equal(model.embed(latent, 0.25), expected)
    assert not torch.equal(expected, latent)


def test_the_builders_take_the_run_configs_model_fields() -> None:
    demo = DemoConfig(hidden=32, heads=4, kv_heads=2, layers=3, seed=7)
    session = SessionConfig(hidden=32, heads=4, kv_heads=2, layers=3, seed=7)
    cpu = torch.device("cpu")
    plain, chunked = build_model(demo, cpu), build_session_model(session, cpu)
    assert type(plain) is TinyDiT and type(chunked) is SessionDiT
    assert plain.cfg == chunked.cfg == CFG
    assert not plain.training and not chunked.training
    assert_same_state(plain.state_dict(), TinyDiT(CFG).state_dict())
    assert_same_state(chunked.state_dict(), SessionDiT(CFG).state_dict())
