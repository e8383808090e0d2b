"""A tiny DiT run through vLLM-Omni's own worker code, dense or paged (the lane's harness).

Everything that runs is vLLM-Omni's (0.30.0) or vLLM's, except the model itself and the
scheduler's two calls this file makes in the engine's place:

* the model: :class:`TinyPipeline` (random weights; a prefix of fixed tokens and a target span
  denoised ``steps`` times, HunyuanImage-style mask: causal prefix, one bidirectional target
  span) built from vLLM-Omni's ``Attention`` layers with ``paged_kv_cache_role`` set, as a paged
  DiT declares them; in paged mode, steps after the first feed only the target tokens (the
  prefix is read from the pages), which is what paging is for;
* the engine's steps around the worker (:func:`run`): ``create_diffusion_vllm_config``'s two
  steps (which call the platform's ``configure_diffusion_vllm_config``; a ``Shape.block_size``
  is put on the cache config between them), the worker's
  ``init_diffusion_worker_vllm_config``, vLLM-Omni's ``DiffusionModelRunner`` with this model
  as its pipeline (``load_model`` is skipped: it would load weights from disk; the platform hook
  it calls, ``init_diffusion_model_runner_runtime``, is called here), then in paged mode
  ``runner.get_kv_cache_spec()``, vLLM-Omni's control plane ``build_native_kv_cache_configs``
  and ``resolve_kv_cache_block_sizes``, ``runner.set_kv_cache_config``, the scheduler's
  ``DiffusionKVCacheManager.reserve_request``, ``runner.execute_model(req,
  diffusion_kv_metadata=...)`` (install -> activate -> forward with ``paged_kv_runtime`` in the
  forward context -> removal) and ``free_request``.

One test shim: :func:`recording_hooks` wraps the platform's diffusion-KV hook methods to record
their names in call order (they still run), so the tests can check the sequence vLLM-Omni's
code drives.

Runs in a process whose ``vllm_omni`` is the one under test (installed, or the patched copy).
"""

from __future__ import annotations

import atexit
import dataclasses
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from vllm.config import set_current_vllm_config
from vllm_omni.diffusion.attention.backends.abstract import AttentionMetadata
from vllm_omni.diffusion.attention.layer import Attention
from vllm_omni.diffusion.config import set_current_diffusion_config
from vllm_omni.diffusion.data import DiffusionOutput, OmniDiffusionConfig, TransformerConfig
from vllm_omni.diffusion.diffusion_kv.initialization import build_native_kv_cache_configs
from vllm_omni.diffusion.diffusion_kv.manager import DiffusionKVCacheManager
from vllm_omni.diffusion.diffusion_kv.request import DiffusionKVRequest
from vllm_omni.diffusion.forward_context import get_forward_context, set_forward_context_denoise_step_idx
from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.diffusion.vllm_config import configure_diffusion_vllm_config, create_base_diffusion_vllm_config
from vllm_omni.diffusion.worker.diffusion_model_runner import DiffusionModelRunner
from vllm_omni.inputs.data import OmniDiffusionSamplingParams
from vllm_omni.platforms import current_omni_platform

MODEL_DIR = tempfile.mkdtemp(prefix="tiny-dit-")
"""An empty local model folder: vLLM-Omni resolves a model id through the Hub when
``HF_HUB_OFFLINE`` is set, a local path as it is (nothing is loaded from it)."""
atexit.register(shutil.rmtree, MODEL_DIR, True)


@dataclass(frozen=True)
class Shape:
    prefix: int = 96
    target: int = 64
    hidden: int = 128
    heads: int = 4
    kv_heads: int = 2
    layers: int = 2
    steps: int = 3
    cfg: int = 2
    max_model_len: int = 512
    dtype: torch.dtype = torch.float16
    seed: int = 0
    block_size: int | None = None
    """The KV-cache block size configured before the platform's hook (None: vLLM's default,
    128 from vLLM's CPU platform)."""

    @property
    def head_size(self) -> int:
        return self.hidden // self.heads


class TinyBlock(nn.Module):
    def __init__(self, index: int, shape: Shape) -> None:
        super().__init__()
        d = shape.head_size
        self.shape = shape
        self.qkv = nn.Linear(shape.hidden, (shape.heads + 2 * shape.kv_heads) * d)
        self.out = nn.Linear(shape.heads * d, shape.hidden)
        self.attn = Attention(
            num_heads=shape.heads,
            head_size=d,
            causal=True,
            softmax_scale=d**-0.5,
            num_kv_heads=shape.kv_heads,
            prefix=f"transformer.blocks.{index}.attn",
            paged_kv_cache_role="self",
        )

    def forward(self, x: torch.Tensor, metadata: Any) -> torch.Tensor:
        s, d = self.shape, self.shape.head_size
        b, n, _ = x.shape
        q, k, v = self.qkv(x).split([s.heads * d, s.kv_heads * d, s.kv_heads * d], dim=-1)
        o = self.attn(
            q.reshape(b, n, s.heads, d),
            k.reshape(b, n, s.kv_heads, d),
            v.reshape(b, n, s.kv_heads, d),
            metadata,
        )
        return x + self.out(o.reshape(b, n, s.heads * d))


class TinyDiT(nn.Module):
    def __init__(self, shape: Shape) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(TinyBlock(i, shape) for i in range(shape.layers))

    def forward(self, x: torch.Tensor, metadata: Any) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, metadata)
        return x


class TinyPipeline(nn.Module):
    """Denoises the target span ``steps`` times; returns the final target latents."""

    def __init__(self, shape: Shape) -> None:
        super().__init__()
        self.shape = shape
        self.transformer = TinyDiT(shape)
        gen = torch.Generator().manual_seed(shape.seed + 1)
        self.prefix_tokens = torch.randn(shape.cfg, shape.prefix, shape.hidden, generator=gen).to(shape.dtype)
        self.latents = torch.randn(shape.cfg, shape.target, shape.hidden, generator=gen).to(shape.dtype)
        self.target_inputs: list[int] = []
        """Tokens fed to the transformer at each step of the last forward."""
        self.runtime: Any = None
        """The forward context's ``paged_kv_runtime`` during the last forward."""

    def forward(self, batch: Any) -> DiffusionOutput:
        s = self.shape
        runtime = self.runtime = get_forward_context().paged_kv_runtime
        metadata = AttentionMetadata(full_attn_spans=[[(s.prefix, s.prefix + s.target)]] * s.cfg)
        latents = self.latents.clone()
        self.target_inputs = []
        for step in range(s.steps):
            set_forward_context_denoise_step_idx(step)  # the runtime activates prefill/denoise rows
            if runtime is not None and step > 0:
                x = latents  # the prefix is in the pages
            else:
                x = torch.cat([self.prefix_tokens, latents], dim=1)
            self.target_inputs.append(x.shape[1])
            out = self.transformer(x, metadata)[:, -s.target :]
            latents = latents - 0.25 * out
        return DiffusionOutput(output=latents)


KV_HOOKS = (
    "configure_diffusion_vllm_config",
    "init_diffusion_worker_vllm_config",
    "init_diffusion_model_runner_runtime",
    "get_diffusion_kv_block_tables_cls",
    "get_diffusion_paged_kv_attn_backend",
    "build_diffusion_kv_attn_metadata",
    "requires_diffusion_paged_kv_prewrite",
)


@contextmanager
def recording_hooks(calls: list[str]) -> Iterator[None]:
    """Record every call vLLM-Omni makes to its platform's diffusion-KV hooks (the platform's
    methods still run; only their names are appended to ``calls``)."""
    cls = type(current_omni_platform)
    saved = {name: cls.__dict__.get(name) for name in KV_HOOKS}
    for name in KV_HOOKS:
        bound = getattr(cls, name)

        def spy(_cls: Any, *args: Any, _name: str = name, _bound: Any = bound, **kwargs: Any) -> Any:
            calls.append(_name)
            return _bound(*args, **kwargs)

        setattr(cls, name, classmethod(spy))
    try:
        yield
    finally:
        for name, original in saved.items():
            if original is None:
                delattr(cls, name)
            else:
                setattr(cls, name, original)


def compress(calls: list[str]) -> list[str]:
    """``calls`` with runs of the same hook collapsed to one entry."""
    return [c for i, c in enumerate(calls) if i == 0 or calls[i - 1] != c]


@dataclass
class RunResult:
    output: torch.Tensor
    tokens_per_step: list[int]
    hooks: dict[str, Any]


def od_config(shape: Shape, paged: bool) -> OmniDiffusionConfig:
    kwargs: dict[str, Any] = {}
    if paged:
        kwargs = {"diffusion_kv_mode": "paged_scheduler", "diffusion_kv_max_rows_per_request": shape.cfg}
    return OmniDiffusionConfig(
        model=MODEL_DIR,
        dtype=shape.dtype,
        max_num_seqs=1,
        max_model_len=shape.max_model_len,
        enforce_eager=True,
        # vLLM's init_kv_cache reads hf_config.model_type (a real model's transformer config has one)
        tf_model_config=TransformerConfig.from_dict({"model_type": "tiny_dit"}),
        **kwargs,
    )


def request(shape: Shape, request_id: str) -> OmniDiffusionRequest:
    return OmniDiffusionRequest(
        prompt="tiny", sampling_params=OmniDiffusionSamplingParams(), request_id=request_id
    )


def diffusion_vllm_config(device: torch.device, od: OmniDiffusionConfig, block_size: int | None) -> Any:
    """vLLM-Omni's ``create_diffusion_vllm_config`` (its two steps: the base config, then
    ``configure_diffusion_vllm_config``, which calls the platform hook in paged mode), with
    ``block_size`` put on the cache config between them where given."""
    vllm_config = create_base_diffusion_vllm_config(device, od)
    if block_size is not None:
        vllm_config.cache_config.block_size = block_size
    return configure_diffusion_vllm_config(vllm_config, od)


def run(shape: Shape, *, paged: bool, requests: int = 1) -> RunResult:
    """The tiny DiT through vLLM-Omni's runner (see the module docstring); the output of the last
    request (every request has the same inputs). ``hooks["calls"]`` lists the platform's
    diffusion-KV hooks in the order vLLM-Omni called them."""
    calls: list[str] = []
    with recording_hooks(calls):
        result = _run(shape, paged=paged, requests=requests)
    result.hooks["calls"] = calls
    return result


def _run(shape: Shape, *, paged: bool, requests: int) -> RunResult:
    torch.manual_seed(shape.seed)
    device = torch.device("cpu")
    od = od_config(shape, paged)
    vllm_config = diffusion_vllm_config(device, od, shape.block_size)
    current_omni_platform.init_diffusion_worker_vllm_config(vllm_config)
    with set_current_diffusion_config(od), set_current_vllm_config(vllm_config):
        pipeline = TinyPipeline(shape).to(shape.dtype).eval()
    current_omni_platform.init_diffusion_model_runner_runtime(
        vllm_config=vllm_config, od_config=od, device=device
    )
    runner = DiffusionModelRunner(vllm_config, od, device)
    runner.pipeline = pipeline
    hooks: dict[str, Any] = {
        "block_size": vllm_config.cache_config.block_size,
        "kv_cache_layout": getattr(vllm_config.cache_config, "kv_cache_layout", None),
    }
    manager = None
    if paged:
        with set_current_vllm_config(vllm_config):
            specs = runner.get_kv_cache_spec()
        hooks["specs"] = {name: dataclasses.asdict(spec) for name, spec in specs.items()}
        worker_configs, scheduler_config = build_native_kv_cache_configs(vllm_config, [specs], [64 << 20])
        from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

        block_size, hash_block_size = resolve_kv_cache_block_sizes(scheduler_config, vllm_config)
        runner.set_kv_cache_config(worker_configs[0])
        hooks["num_blocks"] = worker_configs[0].num_blocks
        hooks["kv_cache_layout"] = getattr(vllm_config.cache_config, "kv_cache_layout", None)
        manager = DiffusionKVCacheManager(
            scheduler_config,
            max_model_len=vllm_config.model_config.max_model_len,
            scheduler_block_size=block_size,
            hash_block_size=hash_block_size,
        )
    output: torch.Tensor | None = None
    for r in range(requests):
        req = request(shape, f"req-{r}")
        metadata = None
        if manager is not None:
            kv_requests = [
                DiffusionKVRequest(
                    f"req-{r}-cfg{i}",
                    sequence_id=i,
                    prefix_len=shape.prefix,
                    target_len=shape.target,
                    seq_len=shape.prefix + shape.target,
                )
                for i in range(shape.cfg)
            ]
            metadata = manager.reserve_request(req.request_id, kv_requests)
            assert metadata is not None, "the scheduler could not admit the request"
            hooks.setdefault("block_ids", []).append([s.block_ids for s in metadata.sequences])
        result = runner.execute_model(req, diffusion_kv_metadata=metadata)
        if manager is not None:
            manager.free_request(req.request_id)
        assert isinstance(result.output, torch.Tensor)
        output = result.output
    hooks["backend"] = runner.diffusion_kv_backend
    hooks["pipeline"] = pipeline
    assert output is not None
    return RunResult(output, list(pipeline.target_inputs), hooks)
