"""A tiny DiT run through vLLM-Omni's own worker code, dense or paged (the lane's harness).

Everything that runs is vLLM-Omni's (0.30.0) or vLLM's, except the model itself and the
scheduler's two calls this file makes in the engine's place:

* the model: :class:`TinyPipeline` (random weights; a prefix of fixed tokens and a target span
  denoised ``steps`` times, HunyuanImage-style mask: causal prefix, one bidirectional target
  span) built from vLLM-Omni's ``Attention`` layers with ``paged_kv_cache_role`` set, as a paged
  DiT declares them; in paged mode, steps after the first feed only the target tokens (the
  prefix is read from the pages), which is what paging is for;
* the engine's steps around the worker (:func:`run`, through :mod:`engine`, shared with the
  real-model harness :mod:`hunyuan_image3`): ``create_diffusion_vllm_config`` (which calls the
  platform's ``configure_diffusion_vllm_config``; a ``Shape.block_size`` is put on the cache
  config before the hook sees it), the worker's
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

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from vllm_omni.diffusion.attention.backends.abstract import AttentionMetadata
from vllm_omni.diffusion.attention.layer import Attention
from vllm_omni.diffusion.data import DiffusionOutput, OmniDiffusionConfig
from vllm_omni.diffusion.diffusion_kv.request import DiffusionKVRequest
from vllm_omni.diffusion.forward_context import get_forward_context, set_forward_context_denoise_step_idx
from vllm_omni.diffusion.vllm_config import configure_diffusion_vllm_config, create_base_diffusion_vllm_config
from vllm_omni.platforms import current_omni_platform

from tests.vllm_omni import engine


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
    return engine.od_config(
        dtype=shape.dtype,
        paged=paged,
        max_model_len=shape.max_model_len,
        rows_per_request=shape.cfg,
        model_type="tiny_dit",
    )


def kv_requests(shape: Shape, request_id: str) -> list[DiffusionKVRequest]:
    """The scheduler's rows of one request: one per CFG row, prefix then target."""
    return [
        DiffusionKVRequest(
            f"{request_id}-cfg{i}",
            sequence_id=i,
            prefix_len=shape.prefix,
            target_len=shape.target,
            seq_len=shape.prefix + shape.target,
        )
        for i in range(shape.cfg)
    ]


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

    def build(_: Any) -> nn.Module:
        return TinyPipeline(shape).to(shape.dtype).eval()

    worker = engine.start_worker(
        od_config(shape, paged), build, device=torch.device("cpu"), block_size=shape.block_size
    )
    output: torch.Tensor | None = None
    for r in range(requests):
        result = worker.execute(f"req-{r}", kv_requests(shape, f"req-{r}") if paged else ())
        assert isinstance(result.output, torch.Tensor)
        output = result.output
    pipeline = worker.pipeline
    assert isinstance(pipeline, TinyPipeline) and output is not None
    hooks = dict(worker.hooks, backend=worker.runner.diffusion_kv_backend, pipeline=pipeline)
    return RunResult(output, list(pipeline.target_inputs), hooks)
