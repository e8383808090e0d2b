"""DreamZero's AR-diffusion chunks on a GPU: vLLM-Omni's own KV path vs diffusion-kv sessions.

vLLM-Omni 0.30.0's ``CausalWanModel`` (DreamZero's causal Wan transformer, random weights) at a
Wan-1.3B-like attention shape generates AR chunks the way DreamZero's pipeline runs a request
(``_prefill_kv_cache`` then ``diffuse``; both CFG branches, text cross-attention, action/state
tokens in every denoise forward, the first frame alone as the stream's first block, the window of
``max_chunk_size x F + 1`` frames reset when the next block would start past it), on the same
weights and inputs, in one process, the paths taking turns request by request:

* ``vllm_omni``: vLLM-Omni's own AR-diffusion KV (``ARDiffusionKVCache`` + ``ARDiffusionKVState``
  on the device, built as its runner builds them); on CUDA its paged op runs vLLM's FlashAttention
  (``vllm.vllm_flash_attn.flash_attn_varlen_func`` over the block table, ``fa_version`` from vLLM:
  3 on Hopper), on CPU its per-row fp32 loop;
* ``diffusion_kv[PLATFORM:BACKEND]`` for every backend in ``--backend``: the same session on
  diffusion-kv (``diffusion_kv.integrations.vllm_omni.ar_sessions``, the seam the lane's tests use),
  its op kernel registered for the device type (``install_kernel``).

Reported per path: the wall time of each request (CUDA-synchronised), the median over the steady
requests (those after the first window cycle that continue a stream: not the ones starting at
frame 0), the median of the frame-0 requests, and per diffusion-kv path the max abs difference of
its outputs (video latents and actions) from vLLM-Omni's. The observed latents fed back are
vLLM-Omni's (so a difference does not compound across requests). JSON to ``--out`` (and a
summary on stdout).

Reading the agreement (bf16 rounding or a bug): within a request a difference compounds through
16 denoise steps, each scaled by the CFG combination ``uncond + 5 (cond - uncond)`` (a rounding
difference of one forward is amplified up to ~11x per step), so a raw max abs difference of
the latents says little alone. Per request and path the report also gives the latents' max abs
value (``max_abs``), the relative difference ``||x - ref|| / ||ref||`` (``rel_diff``), and the
FIRST denoise forward's video output -- same inputs and the same committed history in both
paths, before anything compounds -- its max abs value and difference (``first_forward_max_abs``,
``first_forward_diff``). bf16 rounding shows as a first-forward difference of a few bf16 ulps of
that output's magnitude (relative ~1e-2 or below) and a ``rel_diff`` of the same order growing
with the steps; a bug (a missing key, another mask or rope offset) shows already in the first
forward as a difference of the output's own magnitude, or a ``rel_diff`` near 1.

On ``--device cuda`` vLLM's FA3 must import (``vllm/vllm_flash_attn/_vllm_fa3_C``): the script
stops with a one-line error naming what is missing otherwise; upstream's cross-attention runs
vLLM-Omni's ``TORCH_SDPA`` diffusion backend (``DIFFUSION_ATTENTION_BACKEND``, set unless given:
its FlashAttention backend calls vLLM's FA2). ``--hunyuan`` then runs
``tests/vllm_omni/hunyuan_image3.py --json`` at HunyuanImage3's attention shapes in a
subprocess and stores its report under ``hunyuan_image3``. Runs with vLLM + vLLM-Omni 0.30.0
importable (the lane's venv on CPU; ``/tmp/site`` on the GPU machine)::

    HF_HUB_OFFLINE=1 PYTHONPATH=$PWD python benchmarks/omni_ar_gpu.py --device cpu --out /tmp/ar.json
    HF_HUB_OFFLINE=1 PYTHONPATH=/tmp/site:$PWD python benchmarks/omni_ar_gpu.py --device cuda \\
        --backend cuda:paged --hunyuan --out $OUT/omni_ar_gpu.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
HUNYUAN_ARGS = (
    "--json", "--device", "cuda", "--dtype", "bf16", "--block-size", "128", "--heads", "32",
    "--kv-heads", "8", "--layers", "4", "--hidden", "4096", "--prompt-len", "1024",
    "--image-tokens", "4096", "--steps", "6", "--dense-attention-backend", "TORCH_SDPA",
)  # fmt: skip
"""``tests/vllm_omni/hunyuan_image3.py`` at the shape ``docs/vllm-omni.md`` records for the GPU."""


@dataclasses.dataclass(frozen=True)
class Shape:
    """DreamZero's transformer and stream geometry (``CausalWanModel`` arguments)."""

    layers: int
    dim: int
    heads: int
    ffn_dim: int
    freq_dim: int
    latent_h: int  # latent pixels; patch 2x2 -> latent_h * latent_w / 4 tokens per frame
    latent_w: int
    frames_per_block: int
    max_chunk_size: int  # window = max_chunk_size * F + 1 frames (DreamZero's local_attn_size)
    text_tokens: int
    text_dim: int
    channels: int
    actions: int
    states: int
    action_dim: int
    state_dim: int
    hidden_size: int  # the action/state MLPs' hidden width

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads

    @property
    def tokens_per_frame(self) -> int:
        return (self.latent_h // 2) * (self.latent_w // 2)

    @property
    def window_frames(self) -> int:
        return self.max_chunk_size * self.frames_per_block + 1


GPU_SHAPE = Shape(
    layers=4,
    dim=1536,  # Wan2.1-1.3B: hidden 1536, 12 heads x 128, FFN 8960
    heads=12,
    ffn_dim=8960,
    freq_dim=256,
    latent_h=44,  # a 352 x 640 frame: 880 tokens per latent frame (a multiple of 16)
    latent_w=80,
    frames_per_block=2,
    max_chunk_size=4,  # window 9 frames: the first frame + 4 blocks of 2, then the pipeline resets
    text_tokens=512,  # CausalWanModel's text_len
    text_dim=4096,  # umT5
    channels=16,
    actions=32,  # num_action_per_block, num_state_per_block (CausalWanModel's defaults)
    states=1,
    action_dim=32,
    state_dim=64,
    hidden_size=1024,
)
CPU_SHAPE = Shape(
    layers=2,
    dim=32,
    heads=2,
    ffn_dim=64,
    freq_dim=32,
    latent_h=8,  # 16 tokens per frame: cpu:sdpa's pages are multiples of 16
    latent_w=8,
    frames_per_block=2,
    max_chunk_size=2,
    text_tokens=6,
    text_dim=16,
    channels=4,
    actions=4,
    states=1,
    action_dim=6,
    state_dim=8,
    hidden_size=32,
)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class SetupError(RuntimeError):
    """What this machine lacks for a path (one line)."""


# -- environment -----------------------------------------------------------------------------------


def check_fa3(head_size: int) -> dict[str, Any]:
    """vLLM's FA3 for vLLM-Omni's CUDA AR-diffusion op: importable and supported here, and the
    version vLLM-Omni resolves for ``head_size`` (pinned to 3 when FA3 works but vLLM's choice
    says otherwise, e.g. FA2 as a fallback the bundle does not carry). :class:`SetupError` naming
    what is missing."""
    fa3 = "vLLM's FA3 (vllm/vllm_flash_attn/_vllm_fa3_C)"
    try:
        from vllm.vllm_flash_attn import flash_attn_interface as fai
    except Exception as exc:  # the package refuses to import without FA2 or FA3
        import importlib.util

        spec = importlib.util.find_spec("vllm")
        where = Path(next(iter(spec.submodule_search_locations or ()), "?")) if spec else Path("?")
        found = sorted(p.name for p in (where / "vllm_flash_attn").glob("_vllm_fa3_C*"))
        state = f"{found[0]} is present" if found else f"no _vllm_fa3_C* in {where / 'vllm_flash_attn'}"
        raise SetupError(
            f"{fa3} is not importable: {state} ({type(exc).__name__}: {_one_line(exc)})"
        ) from exc
    if not fai.FA3_AVAILABLE:
        raise SetupError(f"{fa3} is not importable: {_one_line(fai.FA3_UNAVAILABLE_REASON)}")
    reason = fai.fa_version_unsupported_reason(3)
    if reason:
        raise SetupError(f"{fa3} imports but is not supported here: {_one_line(reason)}")
    paged = _paged_module()
    resolved = int(paged._resolve_fa_version(head_size))
    if resolved != 3:
        paged._FA_VERSION_BY_HEAD_SIZE[head_size] = 3  # the FA2 it would fall back to is not carried
    return {"fa3_available": True, "fa2_available": bool(fai.FA2_AVAILABLE), "resolved": resolved, "used": 3}


def _one_line(what: object) -> str:
    return " ".join(str(what).split())


def _paged_module() -> Any:
    import importlib

    return importlib.import_module("vllm_omni.experimental.ar_diffusion.kv_cache.paged_attention")


@contextmanager
def environment(device: torch.device, dtype: torch.dtype) -> Iterator[Any]:
    """vLLM / vLLM-Omni configs and one rank's parallel groups (the model's parallel layers need
    them), as the lane's harness sets them up, for ``device``."""
    from tests.vllm_omni import ar_models, engine

    ar_models._standins()
    from vllm.config import set_current_vllm_config
    from vllm_omni.diffusion.config import set_current_diffusion_config
    from vllm_omni.diffusion.forward_context import set_forward_context
    from vllm_omni.diffusion.vllm_config import create_diffusion_vllm_config

    od = engine.od_config(dtype=dtype, paged=False, max_model_len=4096, rows_per_request=1, model_type="ar")
    vllm_config = create_diffusion_vllm_config(device, od)
    with engine.single_rank_parallel_state():
        engine._ensure_parallel_state(vllm_config, od)
        with (
            set_current_diffusion_config(od),
            set_current_vllm_config(vllm_config),
            set_forward_context(vllm_config=vllm_config, omni_diffusion_config=od),
        ):
            yield od


# -- model and inputs ------------------------------------------------------------------------------


def build_model(shape: Shape, device: torch.device, dtype: torch.dtype, seed: int = 0) -> torch.nn.Module:
    """``CausalWanModel`` (t2v) with seeded random weights (unit-variance activations), on
    ``device`` in ``dtype``, its linear layers finished as vLLM-Omni's loader finishes them."""
    from vllm_omni.diffusion.models.dreamzero.causal_wan_model import CausalWanModel

    model: torch.nn.Module = CausalWanModel(
        model_type="t2v",
        patch_size=(1, 2, 2),
        frame_seqlen=shape.tokens_per_frame,
        text_len=shape.text_tokens,
        in_dim=shape.channels,
        dim=shape.dim,
        ffn_dim=shape.ffn_dim,
        freq_dim=shape.freq_dim,
        text_dim=shape.text_dim,
        out_dim=shape.channels,
        num_heads=shape.heads,
        num_layers=shape.layers,
        num_frame_per_block=shape.frames_per_block,
        hidden_size=shape.hidden_size,
        action_dim=shape.action_dim,
        max_state_dim=shape.state_dim,
        num_action_per_block=shape.actions,
        num_state_per_block=shape.states,
        max_chunk_size=shape.max_chunk_size,
    ).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            values = torch.randn(param.shape, generator=gen)
            if param.dim() >= 2:
                values = values / math.sqrt(math.prod(param.shape[1:]))
            elif "norm" in name:
                values = 1.0 + 0.1 * values
            else:
                values = 0.05 * values
            param.copy_(values)
    model.to(device=device, dtype=dtype)
    from tests.vllm_omni import ar_models

    ar_models._finish_linear_layers(model)  # the loader's post-load step (on CPU: vLLM's GEMM repack)
    return model


@dataclasses.dataclass
class Inputs:
    """One stream's inputs, fixed per seed (drawn on the CPU, then moved)."""

    shape: Shape
    seed: int
    device: torch.device
    dtype: torch.dtype

    def _draw(self, salt: int, *size: int, scale: float = 1.0) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed * 100_003 + salt)
        return (torch.randn(*size, generator=gen) * scale).to(self.device, self.dtype)

    def latents(self, index: int, frames: int | None = None) -> torch.Tensor:
        s = self.shape
        f = s.frames_per_block if frames is None else frames
        return self._draw(1000 + index, 1, s.channels, f, s.latent_h, s.latent_w)

    def context(self, negative: bool) -> torch.Tensor:
        return self._draw(7 + int(negative), 1, self.shape.text_tokens, self.shape.text_dim)

    def action(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.shape
        return self._draw(5000 + index, 1, s.actions, s.action_dim), self._draw(
            9000 + index, 1, s.states, s.state_dim
        )


# -- the two KV paths ------------------------------------------------------------------------------


def host_state(shape: Shape, device: torch.device, dtype: torch.dtype, session_id: str = "s0") -> Any:
    """vLLM-Omni's own AR-diffusion KV for one DreamZero session, built as its runner builds it
    (pages of one latent frame, window ``window_frames``, no sink, scratch for the action/state
    tokens, the text cross-attention pool), on ``device``."""
    from vllm_omni.experimental.ar_diffusion.capability import ARDiffusionKVBranchSpec
    from vllm_omni.experimental.ar_diffusion.kv_cache.config import ARDiffusionKVConfig
    from vllm_omni.experimental.ar_diffusion.kv_cache.manager import ARDiffusionKVCache
    from vllm_omni.experimental.ar_diffusion.kv_cache.state import ARDiffusionKVState

    branches = ("positive", "negative")
    frame_bytes = 2 * shape.tokens_per_frame * shape.dim * shape.layers * dtype.itemsize
    blocks = len(branches) * (shape.window_frames + 2 * shape.frames_per_block + 4)
    cross = 2 * len(branches) * shape.text_tokens * shape.dim * shape.layers * dtype.itemsize
    cache = ARDiffusionKVCache(
        ARDiffusionKVConfig(
            enable=True, chunk_size=shape.tokens_per_frame, window_chunks=shape.window_frames, sink_chunks=0
        ),
        num_layers=shape.layers,
        num_kv_heads=shape.heads,
        head_size=shape.head_dim,
        dtype=dtype,
        block_size=shape.tokens_per_frame,
        max_model_len=1 << 24,
        available_bytes=4 * (blocks * frame_bytes + cross) + (64 << 20),
        kv_branches=tuple(ARDiffusionKVBranchSpec(name, i) for i, name in enumerate(branches)),
        session_capacity=1,
        cross_attention_lengths={"text": shape.text_tokens},
        device=device,
        frames_per_block=shape.frames_per_block,
        max_scratch_tokens_per_branch=shape.actions + shape.states,
    )
    adapters = {b: cache.begin_request(f"ar::{session_id}::{b}") for b in branches}
    return ARDiffusionKVState(cache, session_id, adapters, num_layers=shape.layers)


def dkv_state(
    shape: Shape, device: torch.device, dtype: torch.dtype, backend: str, session_id: str = "s0"
) -> tuple[Any, list[str]]:
    """The same session on diffusion-kv (``ar_sessions``): the first frame as the session's
    first-block prefix, blocks of ``frames_per_block`` frames as its chunks; the backend
    ``PLATFORM:NAME`` (the platform must be the device's). Returns the state and the backends
    the worker chose."""
    from diffusion_kv.integrations.vllm_omni import ar_sessions

    name = check_backend(backend, device)
    ar_sessions.install_kernel(device.type)
    geometry = ar_sessions.ARGeometry(
        num_layers=shape.layers,
        num_kv_heads=shape.heads,
        head_size=shape.head_dim,
        tokens_per_frame=shape.tokens_per_frame,
        frames_per_block=shape.frames_per_block,
        window_frames=shape.window_frames,
        sink_frames=0,
        dtype=dtype,
        first_block_frames=1,
    )
    cache = ar_sessions.DiffusionKVARCache(
        geometry,
        kv_branches=("positive", "negative"),
        cross_attention_lengths={"text": shape.text_tokens},
        max_frames=4 * shape.window_frames + 8,
        backend=name,
        device=device,
    )
    return cache.state(session_id), [b.name for b in cache.worker.backends]


def check_backend(backend: str, device: torch.device) -> str:
    """The backend's name; :class:`SetupError` unless it is ``DEVICE_TYPE:NAME`` for ``device``."""
    plat, _, name = backend.partition(":")
    if plat != device.type or not name:
        raise SetupError(
            f"--backend {backend!r}: on device {device.type} a backend is named {device.type}:NAME"
        )
    return name


# -- one request, as DreamZero's pipeline runs it -----------------------------------------------------


def _forward(
    model: torch.nn.Module,
    state: Any,
    inputs: Inputs,
    x: torch.Tensor,
    t: float,
    negative: bool,
    frame: int,
    commit: bool,
    action: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    branch = "negative" if negative else "positive"
    frames = x.shape[2]
    seq_len = frames * inputs.shape.tokens_per_frame
    dev = inputs.device
    extra: dict[str, Any] = {}
    if action is not None:
        extra = {
            "action": action[0],
            "timestep_action": torch.full((1, inputs.shape.actions), t, device=dev),
            "state": action[1],
        }
    out, action_out, _ = model(
        x=x,
        timestep=torch.full((1, frames), t, device=dev),
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


def request(
    model: torch.nn.Module,
    state: Any,
    inputs: Inputs,
    index: int,
    start_frame: int,
    observed: torch.Tensor | None,
    steps: tuple[float, ...],
    guidance: float = 5.0,
    trace: list[torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """One request (``_prefill_kv_cache`` then ``diffuse``), both CFG branches: at frame 0 the
    first frame alone is committed as the first AR block and the new block starts at frame 1;
    later the previous block's observed latents are committed at ``start_frame - F``; then one
    denoise forward per step and branch over the new block with its action and state tokens.
    Returns the block's latents, its actions and the next start frame; ``trace`` (a list)
    receives the first denoise forward's video output (positive branch), before any error can
    compound through the denoise loop."""
    f = inputs.shape.frames_per_block
    if start_frame == 0:
        from tests.vllm_omni import ar_models

        ar_models.dreamzero_populate_cross(model, state, inputs)
        first = inputs.latents(50_000 + index, frames=1)
        for negative in (False, True):
            _forward(model, state, inputs, first, 0.0, negative, 0, True)
        start_frame = 1
    else:
        assert observed is not None
        for negative in (False, True):
            _forward(model, state, inputs, observed, 0.0, negative, start_frame - f, True)
    latents = inputs.latents(index)
    act, robot_state = inputs.action(index)
    for t in steps:
        cond, cond_a = _forward(
            model, state, inputs, latents, t, False, start_frame, False, (act, robot_state)
        )
        uncond, uncond_a = _forward(
            model, state, inputs, latents, t, True, start_frame, False, (act, robot_state)
        )
        assert cond_a is not None and uncond_a is not None
        if trace is not None and not trace:
            trace.append(cond.detach().clone())
        latents = latents - (t / 1000.0) * (uncond + guidance * (cond - uncond))
        act = act - (t / 1000.0) * (uncond_a + guidance * (cond_a - uncond_a))
    return latents, act, start_frame + f


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


OP = "vllm_omni::ar_diffusion_paged_write_attn"
"""vLLM-Omni's AR-diffusion attention op (the self-attention's KV write, host bookkeeping and
attention), which both paths run inside: ``--op-time`` reports the time spent in it."""


def _op_time(fn: Callable[[], Any]) -> tuple[Any, float]:
    """``fn()`` under the torch profiler (CPU activity): its result and the milliseconds spent
    inside :data:`OP`."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        result = fn()
    return result, sum(e.cpu_time_total for e in prof.key_averages() if e.key == OP) / 1e3


def run_stream(
    model: torch.nn.Module,
    states: dict[str, Any],
    inputs: Inputs,
    requests: int,
    steps: tuple[float, ...],
    op_time: bool = False,
) -> dict[str, Any]:
    """Every path request by request, taking turns, on the same inputs; the pipeline's window
    reset (text K/V kept) when the next block would start at or past the window. Per request:
    its start frame, each path's wall time and each diffusion-kv path's max abs difference of
    latents and actions from vLLM-Omni's. A path that raises is recorded (``errors``, one line)
    and left out of the later requests; the others go on. ``op_time``: each request runs under
    the torch profiler and its time inside :data:`OP` is recorded too (``op_ms``; the wall
    times then include the profiler's cost, alike for every path)."""
    window = inputs.shape.window_frames
    frame, observed = 0, None
    rows: list[dict[str, Any]] = []
    errors: dict[str, str] = {}
    for index in range(requests):
        live = {name: state for name, state in states.items() if name not in errors}
        if not live:
            break
        if frame >= window:  # DreamZero's "inference" reset: history dropped, the text K/V kept
            for state in live.values():
                state.reset(keep_cross_attention=("text",))
            frame, observed = 0, None
        row: dict[str, Any] = {
            "index": index,
            "start_frame": frame,
            "ms": {},
            "max_abs_diff": {},
            "max_abs": {},
            "rel_diff": {},
            "first_forward_max_abs": {},
            "first_forward_diff": {},
        }
        if op_time:
            row["op_ms"] = {}
        outputs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        firsts: dict[str, torch.Tensor] = {}
        next_frame = frame + inputs.shape.frames_per_block + (1 if frame == 0 else 0)
        for name, state in live.items():
            try:
                _sync(inputs.device)
                t0 = time.perf_counter()
                first: list[torch.Tensor] = []

                run = functools.partial(
                    request, model, state, inputs, index, frame, observed, steps, trace=first
                )
                if op_time:
                    (latents, act, next_frame), row["op_ms"][name] = _op_time(run)
                else:
                    latents, act, next_frame = run()
                _sync(inputs.device)
            except Exception as exc:
                errors[name] = f"request {index}: {type(exc).__name__}: {_one_line(exc)}"[:2000]
                continue
            row["ms"][name] = (time.perf_counter() - t0) * 1e3
            outputs[name] = (latents, act)
            row["max_abs"][name] = latents.float().abs().max().item()
            if first:
                firsts[name] = first[0]
                row["first_forward_max_abs"][name] = first[0].float().abs().max().item()
        if "vllm_omni" in outputs:
            ref_latents, ref_act = outputs["vllm_omni"]
            for name, (latents, act) in outputs.items():
                if name != "vllm_omni":
                    row["max_abs_diff"][name] = max(
                        (latents.float() - ref_latents.float()).abs().max().item(),
                        (act.float() - ref_act.float()).abs().max().item(),
                    )
                    row["rel_diff"][name] = _relative(latents, ref_latents)
                    if name in firsts and "vllm_omni" in firsts:
                        row["first_forward_diff"][name] = (
                            (firsts[name].float() - firsts["vllm_omni"].float()).abs().max().item()
                        )
        rows.append(row)
        frame = next_frame
        observed = (
            outputs["vllm_omni"][0] if "vllm_omni" in outputs else next(iter(outputs.values()), (None,))[0]
        )
    return {"requests": rows, "errors": errors}


def _relative(x: torch.Tensor, ref: torch.Tensor) -> float:
    """``||x - ref|| / ||ref||`` (Frobenius, float32)."""
    den = ref.float().norm().item()
    return (x.float() - ref.float()).norm().item() / den if den else float("nan")


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def summarise(rows: list[dict[str, Any]], names: list[str]) -> dict[str, Any]:
    """Medians over the steady requests (after the first window cycle, not starting at frame 0)
    and over the frame-0 requests; ratios against vLLM-Omni's; max differences."""
    first_reset = next((i for i, r in enumerate(rows) if i > 0 and r["start_frame"] == 0), len(rows))
    steady = [r for r in rows[first_reset:] if r["start_frame"] != 0]
    if not steady:  # too few requests for a full cycle: every continuing request
        steady = [r for r in rows if r["start_frame"] != 0]
    fresh = [r for r in rows[1:] if r["start_frame"] == 0] or rows[:1]
    out: dict[str, Any] = {
        "steady_requests": [r["index"] for r in steady],
        "frame0_requests": [r["index"] for r in fresh],
    }
    for name in names:
        timed = [r["ms"][name] for r in steady if name in r["ms"]]
        out[name] = {
            "steady_ms_median": _median(timed),
            "steady_ms_min": min(timed) if timed else float("nan"),
            "frame0_ms_median": _median([r["ms"][name] for r in fresh if name in r["ms"]]),
        }
        ops = [r["op_ms"][name] for r in steady if name in r.get("op_ms", {})]
        if ops:
            out[name]["steady_op_ms_median"] = _median(ops)
            out[name]["steady_op_ms_min"] = min(ops)
    host = out["vllm_omni"]["steady_ms_median"] if "vllm_omni" in out else float("nan")
    host_op = out.get("vllm_omni", {}).get("steady_op_ms_median", float("nan"))
    for name in names:
        if name != "vllm_omni":
            diffs = [r["max_abs_diff"][name] for r in rows if name in r["max_abs_diff"]]
            out[name]["steady_ratio_vs_vllm_omni"] = out[name]["steady_ms_median"] / host
            if "steady_op_ms_median" in out[name]:
                out[name]["steady_op_ratio_vs_vllm_omni"] = out[name]["steady_op_ms_median"] / host_op
            out[name]["max_abs_diff"] = max(diffs) if diffs else float("nan")
            for key in ("rel_diff", "first_forward_diff"):
                seen = [r[key][name] for r in rows if name in r.get(key, {})]
                out[name][f"max_{key}"] = max(seen) if seen else float("nan")
    for name in names:
        seen = [r["max_abs"][name] for r in rows if name in r.get("max_abs", {})]
        out[name]["max_abs"] = max(seen) if seen else float("nan")
        seen = [r["first_forward_max_abs"][name] for r in rows if name in r.get("first_forward_max_abs", {})]
        out[name]["first_forward_max_abs"] = max(seen) if seen else float("nan")
    return out


# -- HunyuanImage3 ---------------------------------------------------------------------------------


def hunyuan(timeout: float) -> dict[str, Any]:
    """``tests/vllm_omni/hunyuan_image3.py --json`` at the docs' GPU shape, in a subprocess."""
    cmd = [sys.executable, str(ROOT / "tests" / "vllm_omni" / "hunyuan_image3.py"), *HUNYUAN_ARGS]
    env = dict(os.environ)
    env.pop("DIFFUSION_ATTENTION_BACKEND", None)  # the script sets its dense mode's own
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH", ""), str(ROOT)) if p)
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"command": " ".join(cmd[1:]), "error": f"timed out after {timeout:.0f} s"}
    result: dict[str, Any] = {"command": " ".join(cmd[1:]), "returncode": done.returncode}
    try:
        result["report"] = json.loads(done.stdout)
    except json.JSONDecodeError:
        result["error"] = (done.stderr.strip().splitlines() or ["no output"])[-1]
    return result


# -- main ------------------------------------------------------------------------------------------


def _shape(args: argparse.Namespace, device: torch.device) -> Shape:
    base = GPU_SHAPE if device.type == "cuda" else CPU_SHAPE
    fields = {f.name for f in dataclasses.fields(Shape)}
    given = {k: v for k, v in vars(args).items() if k in fields and v is not None}
    shape = dataclasses.replace(base, **given)
    if shape.dim % shape.heads:
        raise SetupError(f"--dim {shape.dim} is not a multiple of --heads {shape.heads}")
    if shape.latent_h % 2 or shape.latent_w % 2:
        raise SetupError(f"latent {shape.latent_h} x {shape.latent_w}: both must be even (patch 2x2)")
    return shape


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument(
        "--dtype", choices=sorted(DTYPES), default=None, help="default: bf16 on cuda, fp32 on cpu"
    )
    parser.add_argument(
        "--backend", default=None, help="comma-separated PLATFORM:NAME (default cuda:paged / cpu:sdpa)"
    )
    parser.add_argument("--requests", type=int, default=12, help="AR requests (chunks) per path")
    parser.add_argument("--steps", type=int, default=None, help="denoise steps per request (default 16 / 2)")
    for field in dataclasses.fields(Shape):
        parser.add_argument(f"--{field.name.replace('_', '-')}", dest=field.name, type=int, default=None)
    parser.add_argument(
        "--op-time",
        action="store_true",
        help="also time each request's host time inside vLLM-Omni's AR attention op (torch profiler; cpu only)",
    )
    parser.add_argument("--hunyuan", action="store_true", help="also run HunyuanImage3 (cuda only)")
    parser.add_argument("--hunyuan-timeout", type=float, default=150.0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    backends = [
        b.strip()
        for b in (args.backend or f"{device.type}:{'paged' if device.type == 'cuda' else 'sdpa'}").split(",")
        if b.strip()
    ]
    steps_n = args.steps if args.steps is not None else (16 if device.type == "cuda" else 2)
    steps = tuple(1000.0 * (1 - i / steps_n) for i in range(steps_n))
    if device.type == "cpu":
        torch.set_num_threads(1)
    if args.hunyuan and device.type != "cuda":
        raise SystemExit("omni_ar_gpu: --hunyuan runs on --device cuda")
    if args.op_time and device.type != "cpu":
        raise SystemExit(
            "omni_ar_gpu: --op-time times host work on --device cpu (on a GPU the op's time is kernels')"
        )
    try:
        for backend in backends:
            check_backend(backend, device)
        shape = _shape(args, device)
        report = measure(shape, device, dtype, backends, args.requests, steps, args.op_time)
    except SetupError as exc:
        raise SystemExit(f"omni_ar_gpu: {exc}") from None
    except Exception as exc:  # recorded; the HunyuanImage3 run still goes ahead
        traceback.print_exc()
        report = {"errors": {"dreamzero": f"{type(exc).__name__}: {_one_line(exc)}"[:2000]}, "summary": {}}
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    _print(report)
    if args.hunyuan:
        report["hunyuan_image3"] = hunyuan(args.hunyuan_timeout)
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=1))
        print(json.dumps({"hunyuan_image3": report["hunyuan_image3"]}, indent=1))
    if report["errors"]:
        raise SystemExit("omni_ar_gpu: " + "; ".join(f"{k}: {v}" for k, v in report["errors"].items()))
    return report


def measure(
    shape: Shape,
    device: torch.device,
    dtype: torch.dtype,
    backends: list[str],
    requests: int,
    steps: tuple[float, ...],
    op_time: bool = False,
) -> dict[str, Any]:
    """Build the model and every path on ``device``, run the stream, summarise."""
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SetupError(f"--device cuda: torch {torch.__version__} sees no CUDA device")
        device = torch.device("cuda", torch.cuda.current_device())
        os.environ.setdefault("DIFFUSION_ATTENTION_BACKEND", "TORCH_SDPA")
    report: dict[str, Any] = {
        "what": "DreamZero AR requests (commit forward + denoise forwards, 2 CFG branches, action/state tokens)",
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else (platform.processor() or platform.machine()),
        "torch": torch.__version__,
        "dtype": str(dtype),
        "shape": {
            **dataclasses.asdict(shape),
            "head_dim": shape.head_dim,
            "tokens_per_frame": shape.tokens_per_frame,
            "window_frames": shape.window_frames,
            "chunk_tokens": shape.frames_per_block * shape.tokens_per_frame,
            "max_visible_video_keys": shape.window_frames * shape.tokens_per_frame,
        },
        "steps": len(steps),
        "forwards_per_request": 2 * (1 + len(steps)),
    }
    with environment(device, dtype) as _od, torch.no_grad():
        import vllm
        import vllm_omni

        report["vllm"], report["vllm_omni"] = vllm.__version__, getattr(vllm_omni, "__version__", "?")
        if device.type == "cuda":
            report["flash_attention"] = check_fa3(shape.head_dim)
            report["diffusion_attention_backend"] = os.environ["DIFFUSION_ATTENTION_BACKEND"]
        model = build_model(shape, device, dtype)
        inputs = Inputs(shape, seed=1, device=device, dtype=dtype)
        states: dict[str, Any] = {"vllm_omni": host_state(shape, device, dtype)}
        chosen: dict[str, list[str]] = {}
        for backend in backends:
            name = f"diffusion_kv[{backend}]"
            states[name], chosen[name] = dkv_state(shape, device, dtype, backend)
        report["backends"] = chosen
        stream = run_stream(model, states, inputs, requests, steps, op_time)
        for state in states.values():
            with contextlib.suppress(Exception):  # a path that failed may hold a half-done forward
                state.close()
    report.update(stream)
    report["summary"] = summarise(stream["requests"], list(states))
    return report


def _print(report: dict[str, Any]) -> None:
    summary = report["summary"]
    if "device" in report:
        print(f"{report['device']}, {report['dtype']}, shape {report['shape']}")
    for name, error in report["errors"].items():
        print(f"{name:28s} FAILED: {error}")
    for name, r in summary.items():
        if not isinstance(r, dict):
            continue
        line = f"{name:28s} steady {r['steady_ms_median']:9.2f} ms/request (min {r['steady_ms_min']:9.2f})  frame-0 {r['frame0_ms_median']:9.2f}"
        if "max_abs_diff" in r:
            line += (
                f"  x{r['steady_ratio_vs_vllm_omni']:.3f}  max|diff| {r['max_abs_diff']:.3g}"
                f"  rel {r['max_rel_diff']:.3g}  first forward |diff| {r['max_first_forward_diff']:.3g}"
            )
        if "steady_op_ms_median" in r:
            line += f"  op {r['steady_op_ms_median']:8.2f} ms/request (min {r['steady_op_ms_min']:8.2f})"
            if "steady_op_ratio_vs_vllm_omni" in r:
                line += f" x{r['steady_op_ratio_vs_vllm_omni']:.3f}"
        line += f"  max|latents| {r['max_abs']:.3g}  max|first forward| {r['first_forward_max_abs']:.3g}"
        print(line)


if __name__ == "__main__":
    main()
