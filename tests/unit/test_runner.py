"""Runner backend: registration rules and atomic KV-cache initialisation."""

from __future__ import annotations

import dataclasses
import re
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from diffusion_kv.core.allocation import RequestAllocation, SequenceAllocation
from diffusion_kv.core.block_tables import TorchBlockTables
from diffusion_kv.core.capabilities import AttentionMode
from diffusion_kv.core.errors import (
    NativeBackendError,
    StateError,
    UnsupportedRequirementsError,
    ValidationError,
)
from diffusion_kv.core.layer_context import AttentionMetadata
from diffusion_kv.core.registry import KVCacheMode
from diffusion_kv.core.rows import PagedRow, PhaseRows
from diffusion_kv.core.runner import PagedLayerSpec, PagedWorker, ParallelConfig, RunnerConfig
from diffusion_kv.platforms.cpu import CpuPlatform
from diffusion_kv.platforms.cpu.backend import CpuReferenceBackend


def config(**kw: Any) -> RunnerConfig:
    base: dict[str, Any] = dict(
        max_model_len=64, max_rows_per_request=2, max_num_seqs=2, max_num_batched_tokens=256
    )
    base.update(kw)
    return RunnerConfig(**base)


def spec(**kw: Any) -> PagedLayerSpec:
    base: dict[str, Any] = dict(num_heads=4, num_kv_heads=2, head_size=8, dtype=torch.float32)
    base.update(kw)
    return PagedLayerSpec(**base)


FAIL: dict[str, str | None] = {"part": None}


class FailingTables(TorchBlockTables):
    def __init__(self, **kwargs: Any) -> None:
        if FAIL["part"] == "block_tables":
            raise RuntimeError("BlockTables construction failed")
        super().__init__(**kwargs)


class FlakyBackend(CpuReferenceBackend):
    """The reference backend with a switchable failure in one part."""

    @classmethod
    def block_tables_cls(cls) -> Any:
        return FailingTables

    def __init__(self, group: Any) -> None:
        if FAIL["part"] == "builder":
            raise RuntimeError("builder construction failed")
        super().__init__(group)

    def allocate_kv_cache(self, layer: Any) -> Any:
        if FAIL["part"] == "allocation":
            raise MemoryError("cache allocation failed")
        return super().allocate_kv_cache(layer)


class FlakyPlatform(CpuPlatform):
    backends = (FlakyBackend,)


class NoUlyssesBackend(CpuReferenceBackend):
    """The reference backend declaring no Ulysses support (as a plugin without it would)."""

    capabilities = dataclasses.replace(CpuReferenceBackend.capabilities, supports_ulysses=False)


class NoUlyssesCpu(CpuPlatform):
    backends = (NoUlyssesBackend,)


def test_registration_gives_rank_local_geometry() -> None:
    backend = PagedWorker(NoUlyssesCpu(), config(parallel=ParallelConfig(ulysses_degree=2)))
    with pytest.raises(UnsupportedRequirementsError, match="Ulysses sequence parallelism"):
        backend.register_kv_cache_layers({"a": spec()})
    assert backend.layers == {}

    backend = PagedWorker(CpuPlatform(), config(parallel=ParallelConfig(ulysses_degree=2)))
    geom = backend.register_kv_cache_layers(
        {"a": spec(), "b": spec(skip_sequence_parallel=True, num_heads=2, num_kv_heads=1)}
    )
    assert (geom["a"].num_heads, geom["a"].num_kv_heads) == (2, 1)
    assert (geom["b"].num_heads, geom["b"].num_kv_heads) == (2, 1)
    assert geom["a"].scale == 8**-0.5


@pytest.mark.parametrize(
    ("parallel", "message"),
    [
        (ParallelConfig(ring_degree=2), "Ring or hybrid Ulysses\\+Ring"),
        (ParallelConfig(allgather_degree=2), "all-gather-KV"),
        (
            ParallelConfig(ulysses_degree=2, ulysses_mode="non_strict"),
            "only strict Ulysses; got ulysses_mode='non_strict'",
        ),
    ],
)
def test_unsupported_sequence_parallel_modes(parallel: ParallelConfig, message: str) -> None:
    backend = PagedWorker(CpuPlatform(), config(parallel=parallel))
    with pytest.raises(NotImplementedError, match=message):
        backend.register_kv_cache_layers({"a": spec()})
    assert backend.layers == {}


@pytest.mark.parametrize(
    ("layers", "exc", "message"),
    [
        ({}, ValidationError, "at least one paged attention layer"),
        ({"a": spec(num_heads=3)}, ValidationError, "num_heads=3 must be a multiple of num_kv_heads=2"),
        ({"a": spec(), "b": spec(head_size=16)}, ValidationError, "one rank-local attention geometry"),
        ({"a": spec(num_kv_heads=0)}, ValidationError, "num_kv_heads must be a positive integer"),
        ({"a": spec(dtype=torch.int8)}, UnsupportedRequirementsError, "dtype=int8"),
        ({"a": "not a spec"}, ValidationError, "needs a PagedLayerSpec"),
        ({"a": spec(cache_role="")}, ValidationError, "cache_role must be a non-empty string"),
    ],
)
def test_registration_rejections_keep_previous(layers: dict, exc: type[Exception], message: str) -> None:
    backend = PagedWorker(CpuPlatform(), config())
    backend.register_kv_cache_layers({"keep": spec()})
    with pytest.raises(exc, match=message):
        backend.register_kv_cache_layers(layers)
    assert list(backend.layers) == ["keep"]


def test_ulysses_divisibility() -> None:
    backend = PagedWorker(CpuPlatform(), config(parallel=ParallelConfig(ulysses_degree=4)))
    with pytest.raises(ValidationError, match="divisible by ulysses_degree=4"):
        backend.register_kv_cache_layers({"a": spec()})


@pytest.mark.parametrize(
    ("part", "message", "cause"),
    [
        (
            "block_tables",
            "failed to build its BlockTables (RuntimeError: BlockTables construction failed)",
            RuntimeError,
        ),
        (
            "builder",
            "failed to build its backend 'reference' (RuntimeError: builder construction failed)",
            RuntimeError,
        ),
        (
            "allocation",
            "failed to build its KV-cache allocation for layer 'a' (MemoryError: cache allocation failed)",
            MemoryError,
        ),
    ],
)
def test_initialisation_is_atomic(part: str, message: str, cause: type[Exception]) -> None:
    platform = FlakyPlatform()
    FAIL["part"] = part
    backend = PagedWorker(platform, config())
    backend.register_kv_cache_layers({"a": spec(), "b": spec()})
    with pytest.raises(NativeBackendError, match=re.escape(f"platform 'cpu' {message}")) as info:
        backend.initialize_kv_cache(num_blocks=16, block_size=4)
    assert isinstance(info.value.__cause__, cause)
    assert not backend.initialized
    assert backend.registry is None and backend.translator is None and backend.kv_caches == {}
    assert list(backend.layers) == ["a", "b"]  # registration survives; a retry works
    FAIL["part"] = None
    layout = backend.initialize_kv_cache(num_blocks=16, block_size=4)
    assert backend.initialized and layout.max_num_reqs == 4
    with pytest.raises(StateError, match="already initialised"):
        backend.initialize_kv_cache(num_blocks=16)
    with pytest.raises(StateError, match="cannot change after the KV cache is initialised"):
        backend.register_kv_cache_layers({"a": spec()})


def test_initialisation_checks() -> None:
    backend = PagedWorker(CpuPlatform(), config())
    with pytest.raises(StateError, match="register paged layers"):
        backend.initialize_kv_cache(num_blocks=4)
    backend.register_kv_cache_layers({"a": spec()})
    with pytest.raises(ValidationError, match="needs a layout or num_blocks"):
        backend.initialize_kv_cache()
    other = PagedWorker(CpuPlatform(), config())
    other.register_kv_cache_layers({"z": spec()})
    with pytest.raises(ValidationError, match=r"registered=\['a'\], configured=\['z'\]"):
        backend.initialize_kv_cache(other.layout_for(8))
    assert not backend.initialized


def test_vllm_shaped_config_and_mixed_modes() -> None:
    backend = PagedWorker(CpuPlatform(), config())
    backend.register_kv_cache_layers({"c": spec(), "f": spec(mode=AttentionMode.FULL)})
    mk = lambda names, causal: SimpleNamespace(  # noqa: E731
        layer_names=names,
        kv_cache_spec=SimpleNamespace(
            block_size=4, num_kv_heads=2, head_size=8, dtype=torch.float32, non_causal=not causal
        ),
    )
    layout = backend.initialize_kv_cache(
        SimpleNamespace(num_blocks=32, kv_cache_groups=[mk(["c"], True), mk(["f"], False)])
    )
    assert [g.spec.mode for g in layout.groups] == [AttentionMode.CAUSAL, AttentionMode.FULL]
    assert backend.translator is not None and backend.translator._modes == (
        AttentionMode.CAUSAL,
        AttentionMode.FULL,
    )


def test_end_to_end_install_activate_remove() -> None:
    backend = PagedWorker(CpuPlatform(), config())
    backend.register_kv_cache_layers({"a": spec()})
    backend.initialize_kv_cache(num_blocks=16, block_size=4)
    snap = RequestAllocation("r", 0, (SequenceAllocation(0, 4, 2, 6, ((3, 1),)),))
    assert backend.install(snap) is True
    assert backend.resolve("r", 0).row_index == 0
    phases = PhaseRows((PagedRow("r", 6, 6, sequence_id=0),), (PagedRow("r", 2, 6, 4, sequence_id=0),))
    q = torch.randn(6, 4, 8)
    kv = torch.randn(6, 2, 8)
    with backend.activate(phases) as runtime:
        runtime.ensure_active(0)
        out0 = backend.forward("a", q, kv, kv, AttentionMetadata([[(4, 6)]]))
        runtime.ensure_active(1)
        out1 = backend.forward("a", q[4:], kv[4:], kv[4:], AttentionMetadata([[(4, 6)]]))
    torch.testing.assert_close(out1, out0[4:])
    assert backend.remove(["r"]) == 1
    assert backend.kv_bytes_per_block() == 4 * 2 * 2 * 8 * 4


def test_dense_mode_and_uninitialised_calls() -> None:
    backend = PagedWorker(CpuPlatform(), config(mode=KVCacheMode.DENSE))
    assert backend.remove(["x"]) == 0
    with pytest.raises(StateError, match="not initialised"):
        backend.install(RequestAllocation("r", 0, (SequenceAllocation(0, 0, 1, 1, ((1,),)),)))
    backend.register_kv_cache_layers({"a": spec()})
    backend.initialize_kv_cache(num_blocks=4, block_size=4)
    with pytest.raises(ValidationError, match="dense execution must not install"):
        backend.install(RequestAllocation("r", 0, (SequenceAllocation(0, 0, 1, 1, ((1,),)),)))


def test_caches_the_host_owns_are_bound_not_copied() -> None:
    from diffusion_kv.core.backend import KVPageLayout, allocate_pages

    backend = PagedWorker(CpuPlatform(), config())
    backend.register_kv_cache_layers({"a": spec(), "b": spec()})
    owned = {
        n: allocate_pages(KVPageLayout.COMBINED, 16, 4, 2, 8, torch.float32, torch.device("cpu"))
        for n in "ab"
    }
    backend.initialize_kv_cache(num_blocks=16, block_size=4, kv_caches=owned)
    assert all(backend.kv_caches[n] is owned[n] for n in "ab")  # zero-copy: the host's tensors

    wrong = dict(owned, b=torch.zeros(2, 16, 4, 2, 16))
    other = PagedWorker(CpuPlatform(), config())
    other.register_kv_cache_layers({"a": spec(), "b": spec()})
    with pytest.raises(
        ValidationError, match=r"cannot use the given cache of layer 'b': shapes \[\(2, 16, 4, 2, 16\)\]"
    ):
        other.initialize_kv_cache(num_blocks=16, block_size=4, kv_caches=wrong)
    with pytest.raises(ValidationError, match=r"kv_caches must name every paged layer: missing \['b'\]"):
        other.initialize_kv_cache(num_blocks=16, block_size=4, kv_caches={"a": owned["a"]})
    half = {n: t.half() for n, t in owned.items()}  # type: ignore[union-attr]
    with pytest.raises(ValidationError, match="dtype/device torch.float16/cpu"):
        other.initialize_kv_cache(num_blocks=16, block_size=4, kv_caches=half)
    assert not other.initialized


def test_graph_capture_is_refused_where_it_cannot_be_honoured() -> None:
    from diffusion_kv import StateError as PublicStateError
    from diffusion_kv import UnsupportedFeatureError

    backend = PagedWorker(CpuPlatform(), config())
    backend.register_kv_cache_layers({"a": spec()})
    backend.initialize_kv_cache(num_blocks=16, block_size=4)
    assert not backend.supports_graph_capture
    with pytest.raises(
        UnsupportedFeatureError,
        match=r"backends declaring supports_graph_capture; \['reference'\] of platform 'cpu'",
    ):
        backend.capture(lambda x: x, torch.zeros(1))
    assert issubclass(UnsupportedFeatureError, NotImplementedError) and PublicStateError is StateError
