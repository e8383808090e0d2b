"""Every public call on the newer surfaces refuses bad input with a ``DiffusionKVError``.

The sweep calls the scheduler, the allocator and its pool, the runner (configuration,
registration, binding, capture, lookups), the layout records, phase rows and backend selection
with the inputs a careless or hostile caller passes (``None``, a string for a tuple, a float
for a count, a negative count, the wrong record type) and checks the exact error type, the facts
its message names, and that the refusal changed nothing. Each case raised a built-in
``TypeError``/``AttributeError``/``RuntimeError`` or was silently accepted before.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch

import diffusion_kv
from diffusion_kv import (
    AttentionSpec,
    CacheLayout,
    ConfigurationError,
    DiffusionKVAllocator,
    DiffusionKVError,
    DiffusionRequest,
    DiffusionScheduler,
    FreeListPool,
    KVCacheGroup,
    KVCacheMode,
    KVRequest,
    NativeBackendError,
    PagedLayerSpec,
    PagedWorker,
    ParallelConfig,
    PhaseRows,
    Requirements,
    RunnerConfig,
    SequenceRequest,
    ValidationError,
)
from diffusion_kv.core.allocator import AdmissionError
from diffusion_kv.core.backend import PagedBackend
from diffusion_kv.models.demo import DemoConfig
from diffusion_kv.models.stream import StreamConfig
from diffusion_kv.platforms.cpu import CpuPlatform
from diffusion_kv.platforms.cpu.backend import CpuReferenceBackend
from diffusion_kv.platforms.interface import ENV_BACKEND

BS = 4


def config(**kw: Any) -> RunnerConfig:
    base: dict[str, Any] = dict(
        max_model_len=32, max_rows_per_request=2, max_num_seqs=2, max_num_batched_tokens=128
    )
    base.update(kw)
    return RunnerConfig(**base)


def registered(**kw: Any) -> PagedWorker:
    runner = PagedWorker(CpuPlatform(), config(**kw))
    runner.register_kv_cache_layers({n: PagedLayerSpec(2, 1, 8, torch.float32) for n in ("l0", "l1")})
    return runner


def initialised() -> PagedWorker:
    runner = registered()
    runner.initialize_kv_cache(num_blocks=16, block_size=BS)
    return runner


def allocator(runner: PagedWorker | None = None) -> DiffusionKVAllocator:
    rows = runner.layout.max_num_reqs if runner is not None and runner.layout is not None else 4
    return DiffusionKVAllocator(
        block_size=BS, max_model_len=32, max_rows_per_request=2, worker_rows=rows, pool=FreeListPool(16)
    )


def scheduler() -> DiffusionScheduler:
    runner = initialised()
    sched = DiffusionScheduler(runner, allocator(runner))
    sched.submit(DiffusionRequest("a", 4, 4, steps=2))
    return sched


def request() -> DiffusionRequest:
    return DiffusionRequest("a", 4, 4, steps=2)


SPEC = AttentionSpec(1, 8, torch.float32)
V = ValidationError

# (call, exact error type, a fact its message states)
CASES: dict[str, tuple[Callable[[], object], type[DiffusionKVError], str]] = {
    # -- the scheduler -------------------------------------------------------------------------
    "DiffusionScheduler(None, allocator)": (
        lambda: DiffusionScheduler(None, allocator()),  # type: ignore[arg-type]
        V,
        "the scheduler needs a PagedWorker; got NoneType",
    ),
    "DiffusionScheduler(runner, None)": (
        lambda: DiffusionScheduler(initialised(), None),  # type: ignore[arg-type]
        V,
        "the scheduler needs a DiffusionKVAllocator; got NoneType",
    ),
    "scheduler.step(None)": (lambda: scheduler().step(None), V, "step takes the model callback"),  # type: ignore[arg-type]
    "scheduler.run(3)": (lambda: scheduler().run(3), V, "run takes the model callback"),  # type: ignore[arg-type]
    "scheduler.run(fn, on_step=3)": (
        lambda: scheduler().run(lambda b: None, on_step=3),  # type: ignore[arg-type]
        V,
        "on_step takes a callback",
    ),
    "scheduler.cancel(['a'])": (
        lambda: scheduler().cancel(["a"]),  # type: ignore[arg-type]
        V,
        "cancel takes a non-empty request id string; got ['a']",
    ),
    "scheduler.cancel(None)": (lambda: scheduler().cancel(None), V, "cancel takes a non-empty request id"),  # type: ignore[arg-type]
    "DiffusionRequest(full_attn_spans=[{4: 8}])": (
        lambda: DiffusionRequest("a", 4, 4, 1, full_attn_spans=[{4: 8}]),  # type: ignore[arg-type]
        V,
        "full_attn_spans must be (start, end) pairs",
    ),
    "DiffusionRequest.rows(-1)": (lambda: request().rows(-1), V, "step must be an int in [0, 2); got -1"),
    "DiffusionRequest.rows(2)": (lambda: request().rows(2), V, "step must be an int in [0, 2); got 2"),
    "DiffusionRequest.phase(None)": (lambda: request().phase(None), V, "got None"),  # type: ignore[arg-type]
    "DiffusionRequest.step_tokens('0')": (lambda: request().step_tokens("0"), V, "got '0'"),  # type: ignore[arg-type]
    "reap_unreserved(None, allocator)": (
        lambda: diffusion_kv.reap_unreserved(None, allocator()),  # type: ignore[arg-type]
        V,
        "reap_unreserved takes a PagedWorker and a DiffusionKVAllocator; got NoneType and DiffusionKVAllocator",
    ),
    # -- the allocator and its pool --------------------------------------------------------------
    "FreeListPool.allocate(-1)": (lambda: FreeListPool(4).allocate(-1), V, "an int >= 0; got -1"),
    "FreeListPool.allocate(1.5)": (lambda: FreeListPool(4).allocate(1.5), V, "an int >= 0; got 1.5"),  # type: ignore[arg-type]
    "FreeListPool.allocate(None)": (lambda: FreeListPool(4).allocate(None), V, "an int >= 0; got None"),  # type: ignore[arg-type]
    "DiffusionKVAllocator(pool=None)": (
        lambda: DiffusionKVAllocator(
            block_size=BS,
            max_model_len=32,
            max_rows_per_request=2,
            worker_rows=4,
            pool=None,  # type: ignore[arg-type]
        ),
        V,
        "pool must be a BlockPool",
    ),
    "allocator.reserve(KVRequest([...]))": (
        lambda: allocator().reserve(KVRequest(["a"], (SequenceRequest(0, 1, 1),))),  # type: ignore[arg-type]
        AdmissionError,
        "request_id must be a non-empty string; got ['a']",
    ),
    "allocator.blocks_of([])": (
        lambda: allocator().blocks_of([]),  # type: ignore[arg-type]
        V,
        "blocks_of takes a non-empty request id",
    ),
    "allocator.blocks_of(None)": (lambda: allocator().blocks_of(None), V, "got None"),  # type: ignore[arg-type]
    # -- the runner: configuration and registration ------------------------------------------------
    "PagedWorker(None, config)": (
        lambda: PagedWorker(None, config()),  # type: ignore[arg-type]
        V,
        "PagedWorker needs a platform",
    ),
    "PagedWorker(platform, None)": (
        lambda: PagedWorker(CpuPlatform(), None),  # type: ignore[arg-type]
        V,
        "PagedWorker needs a RunnerConfig; got NoneType",
    ),
    "RunnerConfig(mode='paged')": (
        lambda: PagedWorker(CpuPlatform(), config(mode="paged")),
        V,
        "RunnerConfig.mode must be KVCacheMode.PAGED or KVCacheMode.DENSE; got 'paged'",
    ),
    "RunnerConfig(parallel=None)": (
        lambda: PagedWorker(CpuPlatform(), config(parallel=None)),
        V,
        "RunnerConfig.parallel must be a ParallelConfig; got NoneType",
    ),
    "ParallelConfig(ring_degree='2')": (
        lambda: PagedWorker(CpuPlatform(), config(parallel=ParallelConfig(ring_degree="2"))),  # type: ignore[arg-type]
        V,
        "ParallelConfig.ring_degree must be a positive integer; got '2'",
    ),
    "RunnerConfig(device='nodev')": (
        lambda: PagedWorker(CpuPlatform(), config(device="nodev")),
        V,
        "RunnerConfig.device='nodev' cannot be used here",
    ),
    "RunnerConfig(device=3.5)": (
        lambda: PagedWorker(CpuPlatform(), config(device=3.5)),
        V,
        "RunnerConfig.device=3.5 cannot be used here",
    ),
    "RunnerConfig(slot_mapping_dtype='int64')": (
        lambda: PagedWorker(CpuPlatform(), config(slot_mapping_dtype="int64")),
        V,
        "slot_mapping_dtype must be torch.int32, torch.int64 or None; got 'int64'",
    ),
    "register_kv_cache_layers([...])": (
        lambda: PagedWorker(CpuPlatform(), config()).register_kv_cache_layers([("l0", None)]),  # type: ignore[arg-type]
        V,
        "takes a mapping of layer name to PagedLayerSpec; got list",
    ),
    # -- the runner: binding, lookups, capture ---------------------------------------------------
    "initialize_kv_cache(kv_caches=3)": (
        lambda: registered().initialize_kv_cache(num_blocks=16, block_size=BS, kv_caches=3),  # type: ignore[arg-type]
        V,
        "kv_caches must map each paged layer name to its cache; got int",
    ),
    "initialize_kv_cache(kv_caches requiring grad)": (
        lambda: registered().initialize_kv_cache(
            num_blocks=16,
            block_size=BS,
            kv_caches={n: torch.zeros(2, 16, BS, 1, 8, requires_grad=True) for n in ("l0", "l1")},
        ),
        V,
        "requires grad",
    ),
    "initialize_kv_cache(one tensor, two layers)": (
        lambda: registered().initialize_kv_cache(
            num_blocks=16, block_size=BS, kv_caches=dict.fromkeys(("l0", "l1"), torch.zeros(2, 16, BS, 1, 8))
        ),
        V,
        "share memory",
    ),
    "blocks_for(-5)": (lambda: initialised().blocks_for(-5), V, "a token count, an int >= 0; got -5"),
    "blocks_for(1.5)": (lambda: initialised().blocks_for(1.5), V, "got 1.5"),  # type: ignore[arg-type]
    "blocks_for('3')": (lambda: initialised().blocks_for("3"), V, "got '3'"),  # type: ignore[arg-type]
    "resolve([], 0)": (
        lambda: initialised().resolve([], 0),  # type: ignore[arg-type]
        V,
        "resolve takes a non-empty request id string",
    ),
    "resolve('a', '0')": (
        lambda: initialised().resolve("a", "0"),  # type: ignore[arg-type]
        V,
        "sequence_id must be an int >= 0 or None",
    ),
    "activate(None)": (
        lambda: initialised().activate(None).__enter__(),  # type: ignore[arg-type]
        V,
        "activate takes PhaseRows; got NoneType",
    ),
    "capture(None)": (lambda: initialised().capture(None), V, "capture takes the step function"),  # type: ignore[arg-type]
    "capture(fn, 3)": (
        lambda: initialised().capture(lambda x: x, 3),  # type: ignore[arg-type]
        V,
        "captured-step inputs must be tensors",
    ),
    "capture(fn, warmups=0)": (
        lambda: initialised().capture(lambda: None, warmups=0),
        V,
        "capture warmups must be an int >= 1; got 0",
    ),
    # -- layout records and phase rows ------------------------------------------------------------
    "KVCacheGroup(layer_names='l0')": (
        lambda: KVCacheGroup(BS, "l0", SPEC),  # type: ignore[arg-type]
        V,
        "KVCacheGroup.layer_names must be a tuple of layer names; got str 'l0'",
    ),
    "KVCacheGroup(layer_names=None)": (
        lambda: KVCacheGroup(BS, None, SPEC),  # type: ignore[arg-type]
        V,
        "KVCacheGroup.layer_names must be a tuple of layer names; got NoneType",
    ),
    "KVCacheGroup(spec=None)": (
        lambda: KVCacheGroup(BS, ("l0",), None),  # type: ignore[arg-type]
        V,
        "KVCacheGroup.spec must be an AttentionSpec; got NoneType",
    ),
    "CacheLayout(groups=None)": (
        lambda: CacheLayout(None, 16, 32, 2, 2, 64),  # type: ignore[arg-type]
        V,
        "CacheLayout.groups must be a tuple of KVCacheGroup; got NoneType",
    ),
    "PhaseRows(None, None)": (
        lambda: PhaseRows(None, None),  # type: ignore[arg-type]
        V,
        "PhaseRows.prefill must be a sequence of PagedRow; got None",
    ),
    # -- backend selection ---------------------------------------------------------------------------
    "Requirements(head_size=-1)": (
        lambda: Requirements(head_size=-1),
        V,
        "Requirements.head_size must be a positive int or None; got -1",
    ),
    "Requirements(attention_modes='causal')": (
        lambda: Requirements(attention_modes="causal"),  # type: ignore[arg-type]
        V,
        "Requirements.attention_modes must be a set of AttentionMode; got str",
    ),
    "Requirements(dtype='float16')": (
        lambda: Requirements(dtype="float16"),  # type: ignore[arg-type]
        V,
        "Requirements.dtype must be a torch.dtype or None",
    ),
    "get_platform('cpu', 3)": (
        lambda: diffusion_kv.get_platform("cpu", 3),  # type: ignore[arg-type]
        V,
        "requirements must be a Requirements record or None; got int",
    ),
    "platform.select_backend(None)": (
        lambda: CpuPlatform().select_backend(None),  # type: ignore[arg-type]
        V,
        "requirements must be a Requirements record; got NoneType",
    ),
    "platform.select_backend(req, 3)": (
        lambda: CpuPlatform().select_backend(Requirements(), 3),  # type: ignore[arg-type]
        V,
        "compatible_with must be a sequence of PagedBackend classes; got int",
    ),
    "platform.not_supported_reasons(None)": (
        lambda: CpuPlatform().not_supported_reasons(None),  # type: ignore[arg-type]
        V,
        "requirements must be a Requirements record",
    ),
    "platform.explain(3)": (
        lambda: CpuPlatform().explain(3),  # type: ignore[arg-type]
        V,
        "requirements must be a Requirements record",
    ),
    "select_backend(force=PagedBackend)": (
        lambda: CpuPlatform().select_backend(Requirements(), force=PagedBackend),
        V,
        "a backend choice must be a concrete backend class with a name; PagedBackend has none",
    ),
    "StreamConfig(max_cached_blocks=4) without caching": (
        lambda: StreamConfig(max_cached_blocks=4),
        V,
        "max_cached_blocks=4 caps the prefix cache, which is off (prefix_caching=None, shared_prefixes=None)",
    ),
    "StreamConfig(pool_fraction=0)": (
        lambda: StreamConfig(pool_fraction=0),
        V,
        "pool_fraction must be in (0, 1]; got 0",
    ),
    "StreamConfig(requests=0)": (
        lambda: StreamConfig(requests=0),
        V,
        "requests must be a positive integer; got 0",
    ),
    "DemoConfig(cfg_rows=3)": (lambda: DemoConfig(cfg_rows=3), V, "cfg_rows must be 1 or 2; got 3"),
    "available_platforms(namespace=3)": (
        lambda: diffusion_kv.available_platforms(namespace=3),  # type: ignore[arg-type]
        V,
        "an entry-point group must be a non-empty string or None; got 3",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_is_a_diffusion_kv_error(case: str) -> None:
    call, error, fact = CASES[case]
    with pytest.raises(DiffusionKVError) as info:
        call()
    assert type(info.value) is error, f"{case}: {type(info.value).__name__}: {info.value}"
    assert fact in str(info.value), str(info.value)


def test_every_public_error_type_is_in_the_hierarchy() -> None:
    errors = [
        getattr(diffusion_kv, name)
        for name in diffusion_kv.__all__
        if isinstance(getattr(diffusion_kv, name), type)
        and issubclass(getattr(diffusion_kv, name), BaseException)
    ]
    assert len(errors) == 18
    assert all(issubclass(e, DiffusionKVError) for e in errors)
    assert issubclass(ValidationError, ValueError) and issubclass(AdmissionError, ValidationError)


def test_refusals_leave_the_runner_and_scheduler_as_they_were() -> None:
    sched = scheduler()
    runner = sched.runner
    assert runner.registry is not None
    before = (sched.waiting, sched.running, sched.allocator.reserved(), sched.blocks_in_use, sched.tick)
    for call in (
        lambda: sched.step(None),  # type: ignore[arg-type]
        lambda: sched.cancel(["a"]),  # type: ignore[arg-type]
        lambda: runner.blocks_for(-5),
        lambda: runner.resolve([], 0),  # type: ignore[arg-type]
        lambda: runner.activate(None).__enter__(),  # type: ignore[arg-type]
    ):
        with pytest.raises(ValidationError):
            call()
    assert (
        sched.waiting,
        sched.running,
        sched.allocator.reserved(),
        sched.blocks_in_use,
        sched.tick,
    ) == before
    assert runner.registry.installed_requests() == () and runner.translator is not None
    assert runner.translator.active_batch is None  # the scheduler's stepper activates only in step()
    pool = FreeListPool(4)
    with pytest.raises(ValidationError):
        pool.allocate(-1)
    assert pool.num_free == 4


def test_a_paged_mode_string_never_means_dense() -> None:
    """``mode="paged"`` was accepted and then behaved as dense (installs refused)."""
    with pytest.raises(ValidationError, match="got 'paged'"):
        PagedWorker(CpuPlatform(), config(mode="paged"))
    runner = PagedWorker(CpuPlatform(), config(mode=KVCacheMode.PAGED))
    assert runner.config.mode is KVCacheMode.PAGED


def test_a_backend_forced_on_a_platform_that_is_not_installed_is_an_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(ENV_BACKEND, "tpu:flash")
    fact = (
        "DIFFUSION_KV_BACKEND='tpu:flash' names platform 'tpu', which is not installed in group "
        "'diffusion_kv.platforms' (installed: cpu, cuda, npu)"
    )
    with pytest.raises(ConfigurationError) as info:
        diffusion_kv.get_platform("cpu")
    assert fact in str(info.value)
    with pytest.raises(ConfigurationError) as info:
        registered().initialize_kv_cache(num_blocks=16, block_size=BS)  # the worker path, too
    assert fact in str(info.value)
    monkeypatch.setenv(ENV_BACKEND, "cuda:triton")  # an installed platform's choice leaves cpu alone
    runner = registered()
    runner.initialize_kv_cache(num_blocks=16, block_size=BS)
    assert type(runner.backends[0]) is CpuReferenceBackend


def test_a_backend_accepting_a_block_size_its_kernels_lack_is_a_native_error() -> None:
    """Its ``not_supported_reasons`` said yes, its capabilities say no: an error, not an assert."""

    class Inconsistent(CpuReferenceBackend):
        name = "inconsistent"
        capabilities = dataclasses.replace(CpuReferenceBackend.capabilities, kernel_block_sizes=(16,))

        @classmethod
        def not_supported_reasons(cls, requirements: Requirements) -> list[str]:
            return []

    class InconsistentCpu(CpuPlatform):
        backends = (Inconsistent,)

    runner = PagedWorker(InconsistentCpu(), config())
    runner.register_kv_cache_layers({"l0": PagedLayerSpec(2, 1, 8, torch.float32)})
    with pytest.raises(
        NativeBackendError,
        match=r"chose backend 'inconsistent' for KV-cache group 0, but its capabilities declare no kernel "
        r"block size for block size 4 \(16\)",
    ):
        runner.initialize_kv_cache(num_blocks=16, block_size=BS)
    assert not runner.initialized


def test_a_backend_choice_without_a_name_leaves_the_runner_uninitialised() -> None:
    runner = registered(backend=PagedBackend)
    with pytest.raises(ValidationError, match="PagedBackend has none"):
        runner.initialize_kv_cache(num_blocks=8, block_size=BS)
    assert not runner.initialized and runner.backends == () and runner.kv_caches == {}
