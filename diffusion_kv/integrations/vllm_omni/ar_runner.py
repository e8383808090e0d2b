"""vLLM-Omni's AR-diffusion runner with its KV on diffusion-kv sessions (a runner subclass).

vLLM-Omni picks a worker's model runner from ``od_config.diffusion_model_runner_cls`` (an
import path) before the engine's default (``ARDiffusionEngine`` -> ``ARDiffusionModelRunner``).
:class:`DiffusionKVARModelRunner` is that runner with two steps replaced, everything else
(session lifetime, LRU eviction, reset / close requests, fail-closed binding around each
forward, the pipeline's own ``bind_ar_diffusion_state``) inherited unchanged:

* ``_preallocate_kv_cache``: the same checks, then a :class:`~.ar_sessions.DiffusionKVARCache`
  built from the pipeline's ``ARDiffusionKVCacheSpec`` and the runner's resolved
  ``ARDiffusionKVConfig`` (window / sink in frames) instead of vLLM-Omni's pools; the op's CPU
  kernel is installed (:func:`~.ar_sessions.install_cpu_kernel`);
* ``_new_session_state``: ``cache.state(session_id)`` (a :class:`~.ar_sessions.DiffusionKVARState`)
  where upstream builds an ``ARDiffusionKVState``.

Use: ``OmniDiffusionConfig(..., diffusion_model_runner_cls=
"diffusion_kv.integrations.vllm_omni.ar_runner.DiffusionKVARModelRunner")``. Importing this
module imports vLLM-Omni (it subclasses its runner).
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

from diffusion_kv.core.errors import UnsupportedFeatureError, ValidationError
from diffusion_kv.integrations.vllm_omni import ar_sessions

_ARDiffusionModelRunner: Any = importlib.import_module(
    "vllm_omni.experimental.ar_diffusion.runner"
).ARDiffusionModelRunner
_ARDiffusionKVCacheSpec: Any = importlib.import_module(
    "vllm_omni.experimental.ar_diffusion.capability"
).ARDiffusionKVCacheSpec

FIRST_BLOCK_FRAMES = {"DreamZeroPipeline": 1}
"""Pipelines whose stream starts with a first AR block of another length (by class name):
DreamZero's ``_prefill_kv_cache`` commits its first frame alone."""


class DiffusionKVARModelRunner(_ARDiffusionModelRunner):  # type: ignore[misc]
    """``ARDiffusionModelRunner`` whose session KV is served by diffusion-kv (module docstring)."""

    ar_diffusion_kv_config: Any
    kv_cache: Any

    max_frames = 4096
    """Frames a session's positions may reach between resets (its block table's width)."""

    backend: str | None = None
    """diffusion-kv backend for the session layers (None: the cpu platform's choice)."""

    def _available_memory_bytes(self) -> int:
        raise UnsupportedFeatureError(
            "DiffusionKVARModelRunner sizes its pools from the pipeline's sessions, not from free device memory"
        )

    @staticmethod
    def first_block_frames(pipeline: Any) -> int | None:
        """The pipeline's first AR block length in frames, when it differs (None otherwise):
        ``pipeline.ar_diffusion_first_block_frames`` if set, else :data:`FIRST_BLOCK_FRAMES`."""
        declared = getattr(pipeline, "ar_diffusion_first_block_frames", None)
        if declared is not None:
            return int(declared)
        return FIRST_BLOCK_FRAMES.get(type(pipeline).__name__)

    def _preallocate_kv_cache(self, *, available_bytes: int | None = None) -> None:
        if bool(getattr(self.od_config, "step_execution", False)):
            raise UnsupportedFeatureError(
                "DiffusionKVARModelRunner serves request-mode execution (step_execution=False)"
            )
        max_num_seqs = int(getattr(self.od_config, "max_num_seqs", 1) or 1)
        if max_num_seqs > 1:
            raise ValidationError(
                f"AR-diffusion sessions run one sequence at a time: max_num_seqs must be 1, got {max_num_seqs}"
            )
        capability = self._require_capability(self.pipeline)
        spec = capability.ar_diffusion_kv_cache_spec()
        if not isinstance(spec, _ARDiffusionKVCacheSpec):
            raise ValidationError(
                f"ar_diffusion_kv_cache_spec() must return ARDiffusionKVCacheSpec, got {type(spec).__name__}"
            )
        config = dataclasses.replace(
            self.ar_diffusion_kv_config,
            chunk_size=spec.tokens_per_frame,
            window_chunks=self.ar_diffusion_kv_config.window_chunks or spec.window_frames,
            sink_chunks=self.ar_diffusion_kv_config.sink_chunks or spec.sink_frames,
            reset_at_boundary=self.ar_diffusion_kv_config.reset_at_boundary or spec.reset_at_boundary,
        )
        if config.reset_at_boundary:
            raise UnsupportedFeatureError(
                "DiffusionKVARModelRunner: reset_at_boundary is not mapped onto the session policy yet"
            )
        heads = {
            name: spec.cross_attention_kv_heads.get(name, spec.num_kv_heads)
            for name in spec.cross_attention_lengths
        }
        other = {name: h for name, h in heads.items() if h != spec.num_kv_heads}
        if other:
            raise UnsupportedFeatureError(
                f"cross-attention contexts with other KV head counts than self-attention ({spec.num_kv_heads}): {other}"
            )
        self.ar_diffusion_kv_config = config
        self._ar_diffusion_capability = capability
        self._ar_diffusion_kv_cache_spec = spec
        ar_sessions.install_cpu_kernel()
        geometry = ar_sessions.ARGeometry(
            num_layers=spec.num_layers,
            num_kv_heads=spec.num_kv_heads,
            head_size=spec.head_size,
            tokens_per_frame=spec.tokens_per_frame,
            frames_per_block=spec.frames_per_block,
            window_frames=int(config.window_chunks),
            sink_frames=int(config.sink_chunks),
            dtype=self.od_config.dtype,
            first_block_frames=self.first_block_frames(self.pipeline),
        )
        self.kv_cache = ar_sessions.DiffusionKVARCache(
            geometry,
            kv_branches=tuple(b.name for b in spec.kv_branches),
            cross_attention_lengths=dict(spec.cross_attention_lengths),
            max_sessions=spec.session_capacity,
            max_frames=min(self.max_frames, -(-spec.max_model_len // spec.tokens_per_frame)),
            backend=self.backend,
        )
        self._session_capacity = spec.session_capacity

    def _new_session_state(self, session_id: str) -> ar_sessions.DiffusionKVARState:
        cache = self.kv_cache
        assert isinstance(cache, ar_sessions.DiffusionKVARCache)
        return cache.state(session_id)


__all__ = ["FIRST_BLOCK_FRAMES", "DiffusionKVARModelRunner"]
