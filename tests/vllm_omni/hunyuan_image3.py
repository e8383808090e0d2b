"""vLLM-Omni 0.30.0's own ``HunyuanImage3Model`` at a tiny random config, dense or paged (the lane's
real-model harness; also a CLI for larger shapes on a GPU machine).

What runs is vLLM-Omni's model code: ``HunyuanImage3Model`` (``hunyuan_image3_transformer.py``)
with ``use_qk_norm``, its 2-D RoPE (``build_batch_2d_rope``, ``HunYuanRotary2DEmbedder``) and, per
layer, ``ImageKVCacheManager``: ``_forward_dense_legacy`` (the model's own prompt-KV cache, dense
attention with the Hunyuan mask) or ``_forward_paged`` (vLLM-Omni's ``Attention`` layer on the
forward context's ``paged_kv_runtime``). Its weights are random (no checkpoint; seeded, so every
mode builds the same weights), built the way vLLM-Omni's loader builds them
(``set_default_torch_dtype``, then the loader's post-load step, which on CPU repacks vLLM's linear
weights). The worker around it is vLLM-Omni's, driven by :mod:`engine` (runner, KV-cache config,
scheduler reservation, ``execute_model``).

Stand-ins, and why:

* :class:`Denoiser` plays ``HunyuanImage3Pipeline``'s request-level denoise loop (its
  ``__call__``): the real one needs a tokenizer, a VAE and a checkpoint. Its layout is Hunyuan's:
  ``prompt_len`` prompt tokens (text and the image-header tokens), the generated image's
  ``<timestep>`` token at ``prompt_len`` (``gen_timestep_scatter_index``), then ``image_tokens``
  image tokens, bidirectional among themselves (``full_attn_spans``), causal elsewhere. Step 0
  feeds prompt + image tokens; later steps feed only ``<timestep>`` + image tokens, with
  ``query_lens``/``seq_lens``, positions and the attention mask as the pipeline's
  ``_update_model_kwargs_for_generation`` builds them, each step under the pipeline's bfloat16
  autocast; two CFG rows (cond, uncond prompts) share the latents, combined with guidance after
  each step. Inputs are random embeddings; a run may be fed another run's latents at every step
  (``forced_latents``), so both run every step on the same inputs.
* ``torchvision`` (imported by the model file for its image preprocessor only; vLLM-Omni's CPU lane
  has no torchvision, whose CUDA builds break every vLLM-Omni import) is a stub while the model
  module is imported, where torchvision is missing.

Modes (:data:`MODES`): ``dense`` (the model's own dense path), ``diffusion_kv`` (paged through
diffusion-kv's vLLM-Omni platform plugin, the default once diffusion-kv is installed), ``native``
(paged on vLLM-Omni's own platform: the process must start with ``VLLM_PLUGINS`` naming the
plugins to load without ``diffusion_kv``, see :func:`native_env`).

``python tests/vllm_omni/hunyuan_image3.py --json [--device cuda] [--dtype bf16] ...`` runs the
three modes, each in its own process, and prints one JSON object: per mode, per-step wall-clock
times of the last of ``--requests`` (prefill, denoise steps; synchronised on CUDA), the backend
that ran, and the largest difference from dense (per step and final), or the error that stopped
it.
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import traceback
import types
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

import torch
from torch import nn

Mode = Literal["dense", "diffusion_kv", "native"]
MODES: tuple[Mode, ...] = ("dense", "diffusion_kv", "native")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DKV_PLATFORM = "diffusion_kv.integrations.vllm_omni.platform"
MODEL_MODULE = "vllm_omni.diffusion.models.hunyuan_image3.hunyuan_image3_transformer"


@dataclass(frozen=True)
class Shape:
    """One run's model and request geometry (hidden = heads x head size)."""

    dtype: torch.dtype = torch.bfloat16
    block_size: int | None = 32
    """The deployment's KV block size (None: the platform's default); a backend may round it up."""
    heads: int = 4
    kv_heads: int = 2
    layers: int = 2
    hidden: int = 256
    prompt_len: int = 40
    """Tokens before the generated image's ``<timestep>`` token (the prefix the pages keep)."""
    image_tokens: int = 36
    """Image tokens after ``<timestep>``: a ``token_height x token_width`` grid."""
    steps: int = 3
    cfg: int = 2
    guidance: float = 2.0
    seed: int = 0

    @property
    def head_size(self) -> int:
        return self.hidden // self.heads

    @property
    def target_len(self) -> int:
        """Tokens rewritten every step: ``<timestep>`` + image tokens (``num_image_tokens``)."""
        return 1 + self.image_tokens

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.target_len

    @property
    def grid(self) -> tuple[int, int]:
        """The image's token grid: the most square ``h x w == image_tokens``, ``h <= w``."""
        h = max(d for d in range(1, math.isqrt(self.image_tokens) + 1) if self.image_tokens % d == 0)
        return h, self.image_tokens // h

    @property
    def max_model_len(self) -> int:
        return max(512, self.seq_len)


@dataclass
class RunResult:
    output: torch.Tensor
    """The final latents, float32 ``[image_tokens, hidden]``."""
    step_latents: list[torch.Tensor]
    """The latents fed at each step, float32 ``[image_tokens, hidden]``."""
    step_outputs: list[torch.Tensor]
    """Each step's model output for the image tokens, float32 ``[cfg, image_tokens, hidden]``."""
    step_seconds: list[float]
    """Wall clock of each step's model forward (step 0: prefill), synchronised on CUDA."""
    tokens_per_step: list[int]
    """Tokens fed to the model per CFG row at each step."""
    paged_per_step: list[bool]
    """Whether the layers' ``ImageKVCacheManager`` took the paged path at each step."""
    hooks: dict[str, Any] = field(default_factory=dict)


# -- importing the model --------------------------------------------------------------------------


@contextmanager
def _torchvision_stub() -> Iterator[None]:
    """A ``torchvision`` module while the model file is imported, where none is installed: the
    file uses ``torchvision.transforms`` only in its image preprocessor, which nothing here runs."""
    try:
        import torchvision  # noqa: F401

        yield
        return
    except ImportError:
        pass
    import transformers  # noqa: F401  (its torchvision probe must run, and cache, without the stub)

    stub = types.ModuleType("torchvision")
    stub.transforms = types.SimpleNamespace()  # type: ignore[attr-defined]
    sys.modules["torchvision"] = stub
    try:
        yield
    finally:
        del sys.modules["torchvision"]


def model_module() -> types.ModuleType:
    """vLLM-Omni's ``hunyuan_image3_transformer`` module."""
    if MODEL_MODULE not in sys.modules:
        with _torchvision_stub():
            __import__(MODEL_MODULE)
    return sys.modules[MODEL_MODULE]


# -- the model and its request loop ---------------------------------------------------------------


def build_model(shape: Shape, od: Any, device: torch.device) -> nn.Module:
    """``HunyuanImage3Model`` with seeded random weights, built and post-processed as vLLM-Omni's
    loader does (call under the diffusion and vLLM configs)."""
    from vllm.config import LoadConfig
    from vllm.utils.torch_utils import set_default_torch_dtype
    from vllm_omni.diffusion.model_loader.diffusers_loader import DiffusersPipelineLoader

    hunyuan = model_module()
    with warnings.catch_warnings():  # the config passes transformers its deprecated rope_scaling=None
        warnings.filterwarnings("ignore", "`rope_scaling` is deprecated", FutureWarning)
        config = hunyuan.HunyuanImage3Config(
            vocab_size=64,
            hidden_size=shape.hidden,
            intermediate_size=2 * shape.hidden,
            num_hidden_layers=shape.layers,
            num_attention_heads=shape.heads,
            num_key_value_heads=shape.kv_heads,
            max_position_embeddings=shape.max_model_len,
            use_qk_norm=True,
            rms_norm_eps=1e-5,
        )
    with set_default_torch_dtype(shape.dtype), torch.device(device):
        model = hunyuan.HunyuanImage3Model(config)
    gen = torch.Generator().manual_seed(shape.seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            values = torch.randn(param.shape, generator=gen)
            if name.endswith("norm.weight"):
                values = 1.0 + 0.1 * values  # RMSNorm gains around 1
            else:
                values = values / math.sqrt(param.shape[-1])  # unit-variance activations
            param.copy_(values.to(param.dtype))
    # vLLM's linear layers need their quant method's post-load step (on CPU it repacks the weights)
    DiffusersPipelineLoader(LoadConfig(), od)._process_weights_after_loading(model, device)
    return model.eval()


class Denoiser(nn.Module):
    """The request-level denoise loop of ``HunyuanImage3Pipeline`` around ``HunyuanImage3Model``
    (see the module docstring); returns the final latents."""

    def __init__(self, shape: Shape, model: nn.Module, vllm_config: Any, device: torch.device) -> None:
        super().__init__()
        self.shape = shape
        self.model = model
        self.vllm_config = vllm_config
        self.device = device
        s = shape
        gen = torch.Generator().manual_seed(s.seed + 1)
        # cond and uncond prompts differ; the image tokens are shared by both rows
        self.prompt = torch.randn(s.cfg, s.prompt_len, s.hidden, generator=gen)
        self.timestep_tokens = torch.randn(s.steps, s.hidden, generator=gen)
        self.latents = torch.randn(s.image_tokens, s.hidden, generator=gen)
        h, w = s.grid
        cos, sin = model_module().build_batch_2d_rope(
            s.seq_len, s.head_size, image_infos=[[(slice(s.prompt_len + 1, s.seq_len), (h, w))]] * s.cfg
        )
        self.rope = (cos.to(device), sin.to(device))
        # Hunyuan's mask: causal, bidirectional within the image tokens
        mask = torch.ones(s.seq_len, s.seq_len, dtype=torch.bool).tril()
        mask[s.prompt_len + 1 :, s.prompt_len + 1 :] = True
        self.mask = mask.expand(s.cfg, 1, s.seq_len, s.seq_len).to(device)
        self.spans = [[(s.prompt_len + 1, s.seq_len)] for _ in range(s.cfg)]
        self.after_step: Callable[[int], None] | None = None
        """Called after each step with its index (the negative control corrupts pages here)."""
        self.forced_latents: list[torch.Tensor] | None = None
        """The latents to feed at each step instead of the loop's own (another run's
        ``step_latents``): every step then runs on the same inputs as that run."""
        self.last: RunResult | None = None

    def forward(self, batch: Any) -> Any:
        from vllm.forward_context import set_forward_context as set_vllm_forward_context
        from vllm_omni.diffusion.data import DiffusionOutput
        from vllm_omni.diffusion.forward_context import (
            get_forward_context,
            set_forward_context_denoise_step_idx,
        )

        s, dev = self.shape, self.device
        dtype = s.dtype
        image_attn = [layer.self_attn.image_attn for layer in self.model.layers]
        latents = self.latents.clone().to(dev)
        prompt = self.prompt.to(dev, dtype)
        gen_timestep = torch.full((s.cfg, 1), s.prompt_len, dtype=torch.long, device=dev)
        result = RunResult(torch.empty(0), [], [], [], [], [])
        result.hooks["runtime"] = get_forward_context().paged_kv_runtime  # the runner's, in paged mode
        for step in range(s.steps):
            # the runtime activates the prefill rows at step 0, the denoise rows afterwards
            set_forward_context_denoise_step_idx(step)
            if self.forced_latents is not None:
                latents = self.forced_latents[step].to(dev)
            result.step_latents.append(latents.cpu())
            image = torch.cat([self.timestep_tokens[step].to(dev)[None], latents]).to(dtype)
            image = image.expand(s.cfg, *image.shape)
            first = step == 0
            start = 0 if first else s.prompt_len  # later steps feed <timestep> + image tokens only
            embeds = torch.cat([prompt, image], dim=1) if first else image
            q_len = s.seq_len - start
            kwargs = dict(
                inputs_embeds=embeds,
                attention_mask=self.mask[:, :, start:, :],
                position_ids=torch.arange(start, s.seq_len, device=dev).expand(s.cfg, q_len),
                custom_pos_emb=(self.rope[0][:, start:], self.rope[1][:, start:]),
                mode="gen_image",
                first_step=first,
                query_lens=[q_len] * s.cfg,
                seq_lens=[s.seq_len] * s.cfg,
                num_image_tokens=s.target_len,
                gen_timestep_scatter_index=gen_timestep,
                full_attn_spans=self.spans,
                use_cache=False,
                output_attentions=False,
                output_hidden_states=False,
                return_dict=False,
            )
            result.paged_per_step.append(all(m.attn.is_paged_kv_active() for m in image_attn))
            _synchronize(dev)
            began = time.perf_counter()
            # the pipeline runs every denoise step under bfloat16 autocast (its RoPE emits bf16 Q/K)
            with (
                set_vllm_forward_context(None, self.vllm_config),
                torch.autocast(device_type=dev.type, dtype=torch.bfloat16),
            ):
                hidden = self.model(**kwargs)[0]
            _synchronize(dev)
            result.step_seconds.append(time.perf_counter() - began)
            result.tokens_per_step.append(int(embeds.shape[1]))
            pred = hidden[:, -s.image_tokens :].float()
            result.step_outputs.append(pred.cpu())
            cond, uncond = pred[0], pred[-1]
            guided = uncond + s.guidance * (cond - uncond)
            latents = latents - guided / s.steps
            if self.after_step is not None:
                self.after_step(step)
        set_forward_context_denoise_step_idx(None)
        result.output = latents.cpu()
        result.hooks["dense_prompt_kv"] = [m.image_kv_cache_map is not None for m in image_attn]
        self.last = result
        return DiffusionOutput(output=result.output)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -- one run --------------------------------------------------------------------------------------


def platform_is_diffusion_kv() -> bool:
    from vllm_omni.platforms import current_omni_platform

    return type(current_omni_platform).__module__ == DKV_PLATFORM


def kv_requests(shape: Shape, request_id: str) -> list[Any]:
    """The scheduler's rows of one request, as ``build_hunyuan_diffusion_kv_requests`` makes them:
    one per CFG row, the prefix ending at ``<timestep>``, the target its image span."""
    from vllm_omni.diffusion.diffusion_kv.request import DiffusionKVRequest

    return [
        DiffusionKVRequest(
            f"{request_id}/diffusion-kv/{i}",
            sequence_id=i,
            prefix_len=shape.prompt_len,
            target_len=shape.target_len,
            seq_len=shape.seq_len,
            kv_contexts=(),
        )
        for i in range(shape.cfg)
    ]


def start(shape: Shape, mode: Mode, device: torch.device | str = "cpu") -> Any:
    """A vLLM-Omni worker (:class:`engine.Worker`) whose pipeline is a :class:`Denoiser` around
    ``HunyuanImage3Model`` at ``shape``, in ``mode``. Call inside
    :func:`engine.single_rank_parallel_state` (the model's parallel layers need the groups)."""
    from tests.vllm_omni import engine

    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}; got {mode!r}")
    if mode == "diffusion_kv" and not platform_is_diffusion_kv():
        raise RuntimeError(
            "mode 'diffusion_kv' needs diffusion-kv's vLLM-Omni platform (installed, not opted out)"
        )
    if mode == "native" and platform_is_diffusion_kv():
        raise RuntimeError(
            "mode 'native' needs vLLM-Omni's own platform: start the process with native_env()"
        )
    # vLLM's CPU GEMM handlers free themselves with ``.item()``, which fails inside dynamo's
    # fake-tensor tracing (vLLM compiles ``SiluAndMul.forward_native`` at a new model's first
    # forward): dead models are collected here, at a safe point, not during that tracing
    gc.collect()
    paged = mode != "dense"
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:  # the worker's device names its index
        device = torch.device("cuda", torch.cuda.current_device())
    od = engine.od_config(
        dtype=shape.dtype,
        paged=paged,
        max_model_len=shape.max_model_len,
        rows_per_request=shape.cfg,
        model_type="Hunyuan",  # HunyuanImage3Config.model_type
        # one request-level forward carries both CFG rows' whole sequences at the prefill
        max_num_batched_tokens=max(2048, shape.cfg * shape.seq_len),
    )

    def build(vllm_config: Any) -> nn.Module:
        return Denoiser(shape, build_model(shape, od, device), vllm_config, device)

    # room for two requests' rows at max_model_len in bf16 pages (K and V), at least the default
    kv_bytes = 2 * shape.cfg * shape.max_model_len * shape.layers * shape.kv_heads * shape.head_size * 2 * 2
    return engine.start_worker(
        od,
        build,
        device=device,
        block_size=shape.block_size if paged else None,
        parallel_state=True,
        kv_cache_bytes=max(engine.KV_CACHE_BYTES, kv_bytes),
    )


def run(
    shape: Shape,
    mode: Mode,
    device: torch.device | str = "cpu",
    *,
    corrupt_after: int | None = None,
    forced_latents: list[torch.Tensor] | None = None,
    requests: int = 1,
) -> RunResult:
    """``HunyuanImage3Model`` at ``shape`` through vLLM-Omni's worker in ``mode`` (:func:`start`),
    ``requests`` times (same inputs); the last request's result. ``corrupt_after``: zero every
    KV-cache page after that step (a paged mode's negative control); ``forced_latents``: the
    latents each step feeds (another run's ``step_latents``; default: the loop's own)."""
    if corrupt_after is not None and mode == "dense":
        raise ValueError("corrupt_after needs a paged mode (dense keeps no pages)")
    worker = start(shape, mode, device)
    denoiser = worker.pipeline
    assert isinstance(denoiser, Denoiser)
    backend = worker.runner.diffusion_kv_backend
    if corrupt_after is not None:

        def corrupt(step: int) -> None:
            if step == corrupt_after:
                for cache in backend.kv_caches_by_layer.values():
                    cache.zero_()

        denoiser.after_step = corrupt
    denoiser.forced_latents = forced_latents
    for r in range(requests):
        worker.execute(f"req-{r}", kv_requests(shape, f"req-{r}") if mode != "dense" else ())
    result = denoiser.last
    assert result is not None
    result.hooks.update(worker.hooks, backend=backend, worker=worker)
    return result


# -- the CLI --------------------------------------------------------------------------------------


def native_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` for a process on vLLM-Omni's own platform: ``VLLM_PLUGINS`` naming every installed
    vLLM and vLLM-Omni plugin except ``diffusion_kv`` (vLLM-Omni's opt-out for any plugin)."""
    groups = ("vllm.general_plugins", "vllm.platform_plugins", "vllm_omni.platform_plugins")
    names = sorted(
        {
            ep.name
            for g in groups
            for ep in importlib.metadata.entry_points(group=g)
            if ep.name != "diffusion_kv"
        }
    )
    return dict(env, VLLM_PLUGINS=",".join(names) or "none")


def _summary(result: RunResult) -> dict[str, Any]:
    backend = result.hooks["backend"]
    chosen = getattr(backend, "vllm_config", None)
    extra = getattr(chosen, "additional_config", None) or {}
    return {
        "step_seconds": result.step_seconds,
        "tokens_per_step": result.tokens_per_step,
        "paged_per_step": result.paged_per_step,
        "runner_module": type(backend).__module__,
        "diffusion_kv_backend": extra.get("diffusion_kv_backend") if isinstance(extra, dict) else None,
        "block_size": result.hooks.get("block_size"),
        "kv_cache_layout": result.hooks.get("kv_cache_layout"),
    }


def _child(args: argparse.Namespace, shape: Shape) -> None:
    """One mode in this process: saves outputs and a summary (or the error) to ``args.out``."""
    from tests.vllm_omni import engine

    record: dict[str, Any]
    try:
        with engine.single_rank_parallel_state():
            result = run(shape, args.mode, args.device, requests=args.requests)
        record = {
            "ok": True,
            "summary": _summary(result),
            "step_outputs": result.step_outputs,
            "output": result.output,
        }
    except Exception as exc:  # the parent reports what stopped this mode
        record = {
            "ok": False,
            "error": f"{type(exc).__name__}: {exc}",
            "traceback": traceback.format_exc()[-4000:],
        }
    torch.save(record, args.out)


def _parent(args: argparse.Namespace, shape: Shape) -> dict[str, Any]:
    report: dict[str, Any] = {"shape": {**asdict(shape), "dtype": str(shape.dtype)}, "device": args.device}
    records: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in args.modes:
            out = Path(tmp) / f"{mode}.pt"
            env = native_env(dict(os.environ)) if mode == "native" else dict(os.environ)
            if mode == "dense" and args.dense_attention_backend:
                env["DIFFUSION_ATTENTION_BACKEND"] = args.dense_attention_backend
            command = [sys.executable, __file__, *sys.argv[1:], "--mode", mode, "--out", str(out)]
            began = time.perf_counter()
            proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.timeout)
            record: dict[str, Any] = (
                torch.load(out, weights_only=False)
                if out.exists()
                else {"ok": False, "error": f"exit {proc.returncode}", "traceback": proc.stderr[-4000:]}
            )
            record["process_seconds"] = time.perf_counter() - began
            records[mode] = record
    dense = records.get("dense")
    for mode, record in records.items():
        entry: dict[str, Any] = {"ok": record["ok"], "process_seconds": record["process_seconds"]}
        if record["ok"]:
            entry.update(record["summary"])
            if dense is not None and dense["ok"] and mode != "dense":
                entry["max_abs_diff_per_step"] = [
                    float((a - b).abs().max())
                    for a, b in zip(record["step_outputs"], dense["step_outputs"], strict=True)
                ]
                entry["max_abs_diff_final"] = float((record["output"] - dense["output"]).abs().max())
                entry["dense_final_abs_max"] = float(dense["output"].abs().max())
        else:
            entry["error"] = record["error"]
            entry["traceback_tail"] = record["traceback"]
        report[mode] = entry
    return report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON (the only output form)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument(
        "--block-size", type=int, default=None, help="KV block size (default: the platform's)"
    )
    parser.add_argument("--heads", type=int, default=Shape.heads)
    parser.add_argument("--kv-heads", type=int, default=Shape.kv_heads)
    parser.add_argument("--layers", type=int, default=Shape.layers)
    parser.add_argument("--hidden", type=int, default=Shape.hidden)
    parser.add_argument("--prompt-len", type=int, default=Shape.prompt_len)
    parser.add_argument("--image-tokens", type=int, default=Shape.image_tokens)
    parser.add_argument("--steps", type=int, default=Shape.steps)
    parser.add_argument(
        "--requests", type=int, default=2, help="requests per mode (the last is reported: warm)"
    )
    parser.add_argument("--modes", type=lambda v: v.split(","), default=list(MODES))
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per mode")
    parser.add_argument(
        "--dense-attention-backend",
        default=None,
        help="vLLM-Omni's DIFFUSION_ATTENTION_BACKEND for the dense mode only (e.g. TORCH_SDPA)",
    )
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)  # a child process
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    shape = replace(
        Shape(),
        dtype=DTYPES[args.dtype],
        block_size=args.block_size,
        heads=args.heads,
        kv_heads=args.kv_heads,
        layers=args.layers,
        hidden=args.hidden,
        prompt_len=args.prompt_len,
        image_tokens=args.image_tokens,
        steps=args.steps,
    )
    if args.mode is not None:
        _child(args, shape)
        return
    print(json.dumps(_parent(args, shape), indent=2))


if __name__ == "__main__":
    main()
