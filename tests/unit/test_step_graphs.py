"""Graph keys and kept captures without a GPU: ``Translator.graph_key`` (None unless every
backend keys the batch; otherwise the backends' keys plus the memory the core hands the layers),
and ``StepGraphs``' policy (replay a kept capture serving the active batch, capture a keyed batch
not seen, run an unkeyed one eagerly unless told to capture it, keep at most ``limit``) with a
stand-in for the CUDA capture. The real captures and replays: ``tests/gpu/test_session_graphs.py``."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import pytest
import torch

from diffusion_kv import DiffusionKVAllocator, FreeListPool, KVRequest, PagedLayerSpec, SequenceRequest
from diffusion_kv.core.errors import ValidationError
from diffusion_kv.core.graphs import StepGraphs
from diffusion_kv.core.rows import PagedRow
from diffusion_kv.core.runner import PagedWorker, RunnerConfig
from diffusion_kv.core.translate import PreparedBatch
from diffusion_kv.platforms.cpu import CpuPlatform
from diffusion_kv.platforms.cpu.sdpa import CpuSdpaBackend


class KeyedSdpa(CpuSdpaBackend):
    """Keys batches by their query lengths alone -- unsound for this backend (its metadata hold
    per-batch views), enough to drive the core's plumbing here."""

    name = "keyed-sdpa"

    def graph_key(self, metadata: Any) -> Hashable | None:
        return ("qsl", metadata.host_query_start_loc)


def _worker(backend: Any) -> PagedWorker:
    worker = PagedWorker(
        CpuPlatform(), RunnerConfig(256, 2, 2, 512, device=torch.device("cpu"), backend=backend)
    )
    worker.register_kv_cache_layers({"l0": PagedLayerSpec(2, 2, 8, torch.float32)})
    worker.initialize_kv_cache(num_blocks=32, block_size=16)
    alloc = DiffusionKVAllocator(
        block_size=16, max_model_len=256, max_rows_per_request=2, worker_rows=4, pool=FreeListPool(32)
    )
    snapshot = alloc.reserve(KVRequest("r", (SequenceRequest(0, 40, 8),)))
    assert snapshot is not None
    worker.install(snapshot)
    with worker.stepper() as runtime:  # the prefill: every token written, so later rows may read them
        runtime.ensure_rows([PagedRow("r", 48, 48, 0, sequence_id=0)])
        q, k, v = (torch.randn(48, 2, 8) for _ in range(3))
        worker.forward("l0", q, k, v)
    return worker


def test_a_batch_is_keyed_only_where_every_backend_keys_it() -> None:
    plain = _worker("sdpa")
    assert plain.translator is not None
    assert (
        plain.translator.graph_key(plain.translator.prepare([PagedRow("r", 48, 48, 0, sequence_id=0)]))
        is None
    )
    keyed = _worker(KeyedSdpa)
    translator = keyed.translator
    assert translator is not None
    batch = translator.prepare([PagedRow("r", 8, 48, 40, sequence_id=0)])
    key = translator.graph_key(batch)
    assert key is not None
    assert key[:4] == ((8,), 8, True, ("qsl", (0, 8)))  # query lengths, tokens, real slots, the backend's key
    slots = batch.slot_mappings_by_layer["l0"]
    assert (slots.data_ptr(), tuple(slots.shape)) == key[4][:2]  # the slot mapping's memory
    with pytest.raises(ValidationError, match="different translator"):
        translator.graph_key(plain.translator.prepare([PagedRow("r", 48, 48, 0, sequence_id=0)]))


class _Step:
    """A stand-in for a CapturedStep: serves the batches whose key it holds."""

    def __init__(self, batch: PreparedBatch, key: tuple[Any, ...] | None, out: torch.Tensor) -> None:
        self.batch, self.key, self.warmup_output, self.replayed = batch, key, out, 0

    def serves(self, batch: PreparedBatch, key: tuple[Any, ...] | None = None) -> bool:
        return batch is self.batch or (self.key is not None and key == self.key)

    def replay(self, *inputs: torch.Tensor) -> torch.Tensor:
        self.replayed += 1
        return self.warmup_output


def test_step_graphs_replays_captures_or_runs_eagerly() -> None:
    worker = _worker(KeyedSdpa)
    translator = worker.translator
    assert translator is not None
    made: list[_Step] = []

    def capture(fn: Any, *inputs: torch.Tensor) -> Any:
        batch = translator.require_active().batch
        made.append(_Step(batch, translator.graph_key(batch), fn(*inputs)))
        return made[-1]

    # on the CPU every preparation makes fresh tensors, so no two batches share the core's part
    # of the key: key them by shape alone here (the CUDA tier's persistent buffers do that)
    translator.graph_key = lambda batch: ("shape", batch.query_lens)  # type: ignore[method-assign]
    graphs = StepGraphs(capture, translator, limit=2)
    x = torch.ones(1)
    shapes = [PagedRow("r", n, 48, 48 - n, sequence_id=0) for n in (8, 4, 2)]
    with worker.stepper() as runtime:
        for rows in ([shapes[0]], [shapes[0]], [shapes[1]], [shapes[0]], [shapes[2]], [shapes[1]]):
            runtime.ensure_rows(rows)
            graphs.run(lambda t: t + 1, x)
    # 8: capture, replay (the same batch); 4: capture; 8 prepared again: replay (graph-equal);
    # 2: capture, dropping 4's (least recently used); 4: captured again, dropping 8's
    assert (graphs.captures, graphs.replays, graphs.eager) == (4, 2, 0)
    assert [s.replayed for s in made] == [2, 0, 0, 0]
    assert [s.key for s in graphs.steps] == [("shape", (2,)), ("shape", (4,))]

    plain = _worker("sdpa")
    assert plain.translator is not None
    calls: list[int] = []

    def no_capture(fn: Any, *inputs: torch.Tensor) -> Any:
        calls.append(1)

    unkeyed = StepGraphs(no_capture, plain.translator)
    with plain.stepper() as runtime:
        runtime.ensure_rows([PagedRow("r", 8, 48, 40, sequence_id=0)])
        assert torch.equal(unkeyed.run(lambda t: t * 3, x), x * 3)
    assert (unkeyed.captures, unkeyed.eager, calls) == (0, 1, [])
    with pytest.raises(ValidationError, match="limit must be an int >= 1; got 0"):
        StepGraphs(capture, translator, limit=0)
    with pytest.raises(ValidationError, match="capture_unkeyed must be a bool"):
        StepGraphs(capture, translator, capture_unkeyed=1)  # type: ignore[arg-type]
