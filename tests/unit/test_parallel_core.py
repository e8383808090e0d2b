"""Single-process checks of core.parallel and the DCP/CFG paths of the runner (no process group)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from diffusion_kv.core.allocation import ContextAllocation, RequestAllocation, SequenceAllocation
from diffusion_kv.core.errors import StateError, UnsupportedRequirementsError, ValidationError
from diffusion_kv.core.parallel import (
    RankGroup,
    SequencePadding,
    UlyssesParallel,
    build_parallel_groups,
    init_distributed_from_env,
    merge_partial_attention,
    select_cfg_branch,
    verify_replicated,
)
from diffusion_kv.core.runner import PagedLayerSpec, PagedWorker, RunnerConfig
from diffusion_kv.core.translate import dcp_local_seq_lens
from diffusion_kv.platforms.cpu import CpuPlatform
from diffusion_kv.platforms.cpu.backend import CpuReferenceBackend
from tests.parallel import scenarios


def seq(i: int, contexts: tuple[str, ...] = ()) -> SequenceAllocation:
    return SequenceAllocation(i, 4, 4, 8, ((i,),), context_ids=contexts)


def test_cfg_branch_keeps_its_sequence_and_contexts() -> None:
    snap = RequestAllocation(
        "r",
        3,
        (seq(0, ("a",)), seq(1, ("b",))),
        (ContextAllocation("a", "img", 4, ((5,),)), ContextAllocation("b", "img", 4, ((6,),))),
    )
    mine = select_cfg_branch(snap, 2, 1)
    assert mine == RequestAllocation("r", 3, (seq(1, ("b",)),), (ContextAllocation("b", "img", 4, ((6,),)),))
    assert select_cfg_branch(snap, 1, 0) is snap
    with pytest.raises(ValidationError, match="has 2 sequences; CFG-parallel size 3 needs exactly one"):
        select_cfg_branch(snap, 3, 0)
    with pytest.raises(ValidationError, match=r"cfg_parallel_rank must lie in \[0, 2\); got 2"):
        select_cfg_branch(snap, 2, 2)


def test_sequence_padding_positions_and_round_trip() -> None:
    assert SequencePadding.rear(22, 4) == SequencePadding(22, 2)
    assert SequencePadding.rear(24, 4) == SequencePadding(24, 0)
    # [joint | image (10 real + 2 pad)] vs [image (10 real + 2 pad) | joint]
    assert SequencePadding.for_joint(12, 2, 5, "front") == SequencePadding(15, 2)
    assert SequencePadding.for_joint(12, 2, 5, "rear") == SequencePadding(10, 2)
    with pytest.raises(ValidationError, match="joint_strategy must be 'front' or 'rear'; got 'middle'"):
        SequencePadding.for_joint(12, 2, 5, "middle")
    x = torch.arange(2 * 9, dtype=torch.float32).reshape(2, 9, 1, 1) + 1
    pad = SequencePadding(3, 2)
    stripped = UlyssesParallel.strip_padding(x, pad)
    assert stripped[0, :, 0, 0].tolist() == [1, 2, 3, 6, 7, 8, 9]
    back = UlyssesParallel.insert_padding(stripped, pad)
    assert back[0, :, 0, 0].tolist() == [1, 2, 3, 0, 0, 6, 7, 8, 9]
    with pytest.raises(ValidationError, match=r"padding \[8, 10\) lies outside the gathered sequence of 9"):
        UlyssesParallel.strip_padding(x, SequencePadding(8, 2))


def test_ulysses_rejects_heads_not_divisible_before_communicating() -> None:
    uly = UlyssesParallel(RankGroup(2, 0, None))  # no process group: must fail before any collective
    with pytest.raises(ValidationError, match="query has 3 heads, not divisible by ulysses_degree=2"):
        uly.scatter_heads(torch.zeros(1, 4, 3, 8), "query")
    with pytest.raises(ValidationError, match=r"must be \[B, L, H, D\] or \[L, H, D\]; got \(4, 8\)"):
        uly.scatter_heads(torch.zeros(4, 8))


def test_ulysses_degree_one_is_the_plain_call() -> None:
    runner = scenarios.make_runner()
    runner.install(scenarios.snapshot())
    uly = UlyssesParallel(RankGroup.single())
    via, _ = scenarios.run_steps(
        runner,
        lambda layer, q, k, v, md: uly.attention(runner.forward, layer, q, k, v, md),
    )
    for key, ref in scenarios.reference().items():
        torch.testing.assert_close(via[key], ref, atol=0, rtol=0)


def test_lse_merge_equals_attention_over_the_union() -> None:
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(5, 3, 12, generator=g)  # [T, H, keys]
    values = torch.randn(12, 4, generator=g)
    scores[0, :, :6] = float("-inf")  # query 0 sees no key of the first set
    full = torch.einsum("thk,kd->thd", torch.softmax(scores, -1), values)
    outs, lses = [], []
    for keys in (slice(0, 6), slice(6, 12)):
        part = scores[:, :, keys]
        lse = torch.logsumexp(part, -1)
        probs = torch.exp(part - torch.where(torch.isfinite(lse), lse, 0)[..., None])
        outs.append(torch.einsum("thk,kd->thd", probs, values[keys]))
        lses.append(lse)
    torch.testing.assert_close(merge_partial_attention(outs, lses), full, atol=1e-6, rtol=1e-6)
    with pytest.raises(ValidationError, match="need one LSE per partial output; got 2 and 1"):
        merge_partial_attention(outs, lses[:1])


class Capture:
    """A DCP merger for one simulated rank: records the partial, returns it unmerged."""

    def __init__(self, size: int, rank: int) -> None:
        self.size, self.rank = size, rank
        self.partials: list[tuple[torch.Tensor, torch.Tensor]] = []

    def merge(self, output: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
        self.partials.append((output.clone(), lse.clone()))
        return output


@pytest.mark.parametrize(("cp_size", "interleave"), [(2, 1), (2, 4), (4, 2)])
def test_cpu_partials_merge_to_the_single_rank_result(cp_size: int, interleave: int) -> None:
    """Every DCP rank simulated in one process; the LSE merge of their partials is exact."""
    reference = scenarios.reference()
    captures = [Capture(cp_size, r) for r in range(cp_size)]
    for rank, capture in enumerate(captures):
        runner = scenarios.make_runner(
            cp_size=cp_size, cp_rank=rank, cp_interleave=interleave, dcp_merger=capture
        )
        runner.install(scenarios.snapshot(cp_size=cp_size))
        scenarios.run_steps(runner, runner.forward)
    # native calls: step 0 causal, full, piecewise (causal prefix + full target segments);
    # step 1 causal, full, piecewise (the target only: one full segment)
    calls = [c.partials for c in captures]
    assert {len(c) for c in calls} == {7}
    merged = [merge_partial_attention([c[i][0] for c in calls], [c[i][1] for c in calls]) for i in range(7)]
    for index, key in ((0, "causal/0"), (1, "full/0"), (4, "causal/1"), (5, "full/1"), (6, "piecewise/1")):
        ref = reference[key]
        torch.testing.assert_close(merged[index].reshape(ref.shape), ref, atol=1e-5, rtol=1e-5)
    # a single rank's partial alone is not the answer (the test can fail)
    assert not torch.allclose(
        calls[0][1][0].reshape(reference["full/0"].shape), reference["full/0"], atol=1e-3
    )


def config(**kw: Any) -> RunnerConfig:
    base: dict[str, Any] = dict(
        max_model_len=64, max_rows_per_request=2, max_num_seqs=2, max_num_batched_tokens=256
    )
    base.update(kw)
    return RunnerConfig(**base)


def registered(**kw: Any) -> PagedWorker:
    merger = kw.pop("dcp_merger", None)
    runner = PagedWorker(CpuPlatform(), config(**kw), dcp_merger=merger)
    runner.register_kv_cache_layers({"a": PagedLayerSpec(4, 2, 8, torch.float32)})
    return runner


def test_dcp_configuration_errors_leave_the_runner_uninitialised() -> None:
    runner = registered(cp_size=2, cp_rank=1, cp_interleave=3)
    with pytest.raises(
        ValidationError, match="cp_interleave=3 must divide the kernel block size 16 of KV-cache group 0"
    ):
        runner.initialize_kv_cache(num_blocks=8, block_size=16)
    assert not runner.initialized and runner.registry is None
    runner = registered(cp_size=2, cp_rank=1, dcp_merger=Capture(4, 1))
    with pytest.raises(
        ValidationError,
        match="process group has size 4 and this rank is 1; RunnerConfig says cp_size=2, cp_rank=1",
    ):
        runner.initialize_kv_cache(num_blocks=8, block_size=16)
    assert not runner.initialized
    runner = registered(cp_size=2, cp_rank=1)  # no merger and no process group
    with pytest.raises(StateError, match="needs an initialised torch.distributed process group"):
        runner.initialize_kv_cache(num_blocks=8, block_size=16)
    assert not runner.initialized
    with pytest.raises(ValidationError, match=r"cp_rank must lie in \[0, cp_size=2\); got 2"):
        PagedWorker(CpuPlatform(), config(cp_size=2, cp_rank=2))
    with pytest.raises(
        ValidationError, match=r"cfg_parallel_rank must lie in \[0, cfg_parallel_size=2\); got -1"
    ):
        PagedWorker(CpuPlatform(), config(cfg_parallel_size=2, cfg_parallel_rank=-1))


def test_dcp_needs_partial_backends() -> None:
    class NoPartial(CpuReferenceBackend):
        name = "no-partial"
        capabilities = dataclasses.replace(CpuReferenceBackend.capabilities, supports_dcp=False)

    class Platform(CpuPlatform):
        backends = (NoPartial,)

    runner = PagedWorker(Platform(), config(cp_size=2, cp_rank=0), dcp_merger=Capture(2, 0))
    with pytest.raises(
        UnsupportedRequirementsError, match=r"no-partial: decode context parallelism \(cp_size 2\)"
    ):
        runner.register_kv_cache_layers({"a": PagedLayerSpec(4, 2, 8, torch.float32)})
    assert not runner.initialized and runner.layers == {}


def test_dcp_snapshot_block_counts_use_the_virtual_block() -> None:
    runner = registered(cp_size=2, cp_rank=0, dcp_merger=Capture(2, 0))
    runner.initialize_kv_cache(num_blocks=8, block_size=4)
    assert runner.blocks_for(17) == [3]  # 17 tokens over 2 ranks x 4 tokens per block
    bad = RequestAllocation("r", 0, (SequenceAllocation(0, 9, 8, 17, ((0, 1, 2, 3, 4),)),))
    with pytest.raises(
        ValidationError, match="has 5 blocks; expected 3 for 17 tokens at block size 4 x cp_size 2"
    ):
        runner.install(bad)
    assert runner.registry is not None and runner.registry.rows == {}


def test_cpu_forward_refuses_dcp_metadata() -> None:
    runner = registered(cp_size=2, cp_rank=0, dcp_merger=Capture(2, 0))
    runner.initialize_kv_cache(num_blocks=8, block_size=4)
    runner.install(RequestAllocation("r", 0, (SequenceAllocation(0, 4, 4, 8, ((0,),)),)))
    assert runner.executor is not None and runner.translator is not None
    from diffusion_kv.core.rows import PagedRow

    batch = runner.translator.prepare([PagedRow("r", 8, 8, 0, sequence_id=0)])
    backend = runner.executor.backends["a"]
    with pytest.raises(ValidationError, match="DCP-sharded \\(cp_size=2\\).*use forward_partial"):
        backend.forward(
            runner.layers["a"], torch.zeros(8, 4, 8), runner.kv_caches["a"], batch.attn_metadata["a"]
        )


def test_process_group_helpers_without_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(
        StateError, match=r"\['RANK', 'WORLD_SIZE', 'MASTER_ADDR', 'MASTER_PORT'\] are not set"
    ):
        init_distributed_from_env("gloo")
    with pytest.raises(StateError, match="build_parallel_groups needs an initialised torch.distributed"):
        build_parallel_groups(2, 1)
    verify_replicated({"anything": 1}, RankGroup.single(), "rows")  # a group of one agrees with itself
    with pytest.raises(ValidationError, match=r"rank must lie in \[0, 2\); got 2"):
        RankGroup(2, 2)


def test_prepare_hands_the_host_local_seq_lens_to_the_builder() -> None:
    """Under DCP the builder gets each row's rank-local key count on the host (no device read)."""
    runner = scenarios.make_runner(cp_size=2, cp_rank=1, cp_interleave=1, dcp_merger=Capture(2, 1))
    runner.install(scenarios.snapshot(cp_size=2))
    assert runner.translator is not None
    batch = runner.translator.prepare(scenarios.phases().prefill)
    common = batch.common
    expected = dcp_local_seq_lens(common.seq_lens_cpu, 2, 1, 1)
    assert common.dcp_local_seq_lens_cpu is not None
    assert common.dcp_local_seq_lens_cpu.tolist() == expected.tolist()
    assert common.dcp_local_seq_lens is not None and common.dcp_local_seq_lens.tolist() == expected.tolist()
