"""TorchBlockTables: exact slot mappings and gathered tables against hand-computed vectors."""

from __future__ import annotations

import pytest
import torch

from diffusion_kv.core.block_tables import BlockTables, TorchBlockTables, block_table_width
from diffusion_kv.core.errors import ValidationError


def make(
    block_size: int = 16,
    width: int = 4,
    kernel: int | None = None,
    cp_size: int = 1,
    cp_rank: int = 0,
    cp_interleave: int = 1,
    slot_dtype: torch.dtype = torch.int64,
    groups: int = 1,
) -> TorchBlockTables:
    return TorchBlockTables(
        block_sizes=[block_size] * groups,
        max_num_reqs=4,
        max_num_batched_tokens=256,
        max_num_blocks_per_group=[width] * groups,
        device="cpu",
        kernel_block_sizes=[kernel or block_size] * groups,
        cp_size=cp_size,
        cp_rank=cp_rank,
        cp_interleave=cp_interleave,
        slot_mapping_dtype=slot_dtype,
    )


def install(bt: TorchBlockTables, row: int, *groups: list[int]) -> None:
    bt.append_block_ids(row, tuple(groups), overwrite=True)
    bt.apply_staged_writes()


def slots(
    bt: TorchBlockTables, rows: list[int], spans: list[tuple[int, int]], padded: int | None = None
) -> list:
    idx = torch.tensor(rows, dtype=torch.int32)
    lens = [b - a for a, b in spans]
    qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    positions = torch.cat([torch.arange(a, b) for a, b in spans])
    total = int(qsl[-1])
    return bt.compute_slot_mappings(idx, qsl, positions, padded or total).tolist()


def test_satisfies_protocol() -> None:
    assert isinstance(make(), BlockTables)


def test_non_contiguous_blocks_prefix_then_suffix() -> None:
    bt = make()
    install(bt, 0, [3, 1])
    prefix = slots(bt, [0], [(0, 17)])
    assert prefix == [[*range(48, 64), 16]]
    suffix = slots(bt, [0], [(17, 19)])
    assert suffix == [[17, 18]]


def test_gather_zero_fills_beyond_installed_and_padded_rows() -> None:
    bt = make()
    install(bt, 2, [3, 1])
    install(bt, 1, [7])
    (table,) = bt.gather_block_tables(torch.tensor([2, 1], dtype=torch.int32), num_reqs_padded=3)
    assert table.dtype == torch.int32
    assert table.tolist() == [[3, 1, 0, 0], [7, 0, 0, 0], [0, 0, 0, 0]]


def test_gather_after_overwrite_with_fewer_blocks_hides_stale_entries() -> None:
    bt = make()
    install(bt, 0, [3, 1, 2])
    install(bt, 0, [9])
    (table,) = bt.gather_block_tables(torch.tensor([0], dtype=torch.int32), 1)
    assert table.tolist() == [[9, 0, 0, 0]]
    assert bt.num_blocks.cpu[0, 0].item() == 1


def test_padding_and_invalid_rows_get_minus_one() -> None:
    bt = make()
    install(bt, 0, [2])
    assert slots(bt, [0], [(0, 3)], padded=5) == [[32, 33, 34, -1, -1]]
    idx = torch.tensor([-1, 0], dtype=torch.int32)
    qsl = torch.tensor([0, 2, 3], dtype=torch.int32)
    out = bt.compute_slot_mappings(idx, qsl, torch.tensor([0, 1, 5]), 3)
    assert out.tolist() == [[-1, -1, 37]]


def test_positions_beyond_installed_blocks_are_not_written() -> None:
    bt = make()
    install(bt, 0, [2])
    assert slots(bt, [0], [(14, 18)]) == [[46, 47, -1, -1]]


def test_several_rows_packed() -> None:
    bt = make(block_size=4)
    install(bt, 0, [5, 6])
    install(bt, 3, [1])
    assert slots(bt, [3, 0], [(1, 3), (3, 6)]) == [[5, 6, 23, 24, 25]]


def test_int32_slots() -> None:
    bt = make(slot_dtype=torch.int32)
    install(bt, 0, [3, 1])
    out = bt.compute_slot_mappings(torch.tensor([0]), torch.tensor([0, 2]), torch.tensor([15, 16]), 2)
    assert out.dtype == torch.int32 and out.tolist() == [[63, 16]]


def test_kernel_block_split_matches_manager_slots() -> None:
    bt = make(block_size=32, kernel=16)
    assert bt.blocks_per_kv_block == [2]
    install(bt, 1, [1, 7, 3])
    (table,) = bt.gather_block_tables(torch.tensor([1]), 1)
    assert table.tolist() == [[2, 3, 14, 15, 6, 7, 0, 0]]
    assert bt.num_blocks.cpu.tolist() == [[0, 6, 0, 0]]
    # manager formula: block b, offset o -> b * 32 + o
    expected = [b * 32 + o for b in (1, 7, 3) for o in range(32)]
    assert slots(bt, [1], [(0, 96)]) == [expected]


def test_dcp_interleave_cp2() -> None:
    rank0, rank1 = make(block_size=4, cp_size=2, cp_rank=0), make(block_size=4, cp_size=2, cp_rank=1)
    for bt in (rank0, rank1):
        install(bt, 0, [5, 2])
    assert slots(rank0, [0], [(0, 16)]) == [[20, -1, 21, -1, 22, -1, 23, -1, 8, -1, 9, -1, 10, -1, 11, -1]]
    assert slots(rank1, [0], [(0, 16)]) == [[-1, 20, -1, 21, -1, 22, -1, 23, -1, 8, -1, 9, -1, 10, -1, 11]]


def test_dcp_interleave_cp4_interleave2() -> None:
    bt = make(block_size=4, cp_size=4, cp_rank=1, cp_interleave=2)
    install(bt, 0, [5, 2])
    out = slots(bt, [0], [(0, 20)])[0]
    local = {p: s for p, s in enumerate(out) if s != -1}
    assert local == {2: 20, 3: 21, 10: 22, 11: 23, 18: 8, 19: 9}


def test_dcp_every_position_owned_by_exactly_one_rank() -> None:
    owners = []
    for rank in range(4):
        bt = make(block_size=8, cp_size=4, cp_rank=rank, cp_interleave=2)
        install(bt, 0, [1, 2])
        owners.append(slots(bt, [0], [(0, 64)])[0])
    for p in range(64):
        assert sum(owners[r][p] != -1 for r in range(4)) == 1


def test_two_groups_independent() -> None:
    bt = TorchBlockTables(
        block_sizes=[4, 8],
        max_num_reqs=2,
        max_num_batched_tokens=32,
        max_num_blocks_per_group=[4, 2],
        device="cpu",
    )
    install(bt, 0, [3, 1], [2])
    assert slots(bt, [0], [(3, 6)]) == [[15, 4, 5], [19, 20, 21]]


def test_append_without_overwrite_extends() -> None:
    bt = make(block_size=4)
    bt.append_block_ids(0, ([3],), overwrite=True)
    bt.append_block_ids(0, ([1],), overwrite=False)
    bt.apply_staged_writes()
    assert bt.gather_block_tables(torch.tensor([0]), 1)[0].tolist() == [[3, 1, 0, 0]]


def test_append_rejects_overflow_without_mutation() -> None:
    bt = make(block_size=4, width=2)
    before = bt.num_blocks.cpu.clone()
    with pytest.raises(ValidationError, match="3 kernel blocks exceed the table width 2"):
        bt.append_block_ids(0, ([1, 2, 3],), overwrite=True)
    assert torch.equal(bt.num_blocks.cpu, before)
    bt.apply_staged_writes()
    assert bt.gather_block_tables(torch.tensor([0]), 1)[0].tolist() == [[0, 0]]


def test_staged_writes_are_invisible_until_applied() -> None:
    bt = make(block_size=4)
    bt.append_block_ids(0, ([3],), overwrite=True)
    assert bt.num_blocks.gpu[0, 0].item() == 0
    bt.clear_staged_writes()
    bt.apply_staged_writes()
    assert bt.block_tables[0].gpu[0].tolist() == [0, 0, 0, 0]


def test_the_accelerator_write_path_lands_every_staged_id_in_place() -> None:
    """The indexed (device-table) write: every staged slice of every row, overwrites and
    appends alike, in one copy; run here with the host view switched off."""
    bt = make(block_size=4, width=6, groups=2)
    for table in bt.block_tables:
        table._host = None  # take the path a device table takes
    bt.append_block_ids(0, ([3, 1], [5]), overwrite=True)
    bt.append_block_ids(2, ([7], [2, 4, 6]), overwrite=True)
    bt.append_block_ids(0, ([9], []), overwrite=False)
    bt.apply_staged_writes()
    assert bt.block_tables[0].gpu[:3].tolist() == [[3, 1, 9, 0, 0, 0], [0] * 6, [7, 0, 0, 0, 0, 0]]
    assert bt.block_tables[1].gpu[:3].tolist() == [[5, 0, 0, 0, 0, 0], [0] * 6, [2, 4, 6, 0, 0, 0]]
    assert bt.num_blocks.gpu[:, :3].tolist() == [[3, 0, 1], [1, 0, 3]]
    assert not bt.block_tables[0]._staged and not bt.block_tables[1]._staged


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(kernel_block_sizes=[24]), "must be a positive divisor of block size 16"),
        (dict(cp_size=2, cp_rank=2), "cp_rank must lie in"),
        (dict(cp_size=2, cp_interleave=3), "cp_interleave=3 must divide"),
        (dict(max_num_reqs=0), "max_num_reqs must be a positive integer"),
        (dict(slot_mapping_dtype=torch.float32), "slot_mapping_dtype"),
        (dict(max_num_blocks_per_group=[4, 4]), "one block size, kernel block size and capacity per group"),
    ],
)
def test_constructor_validation(kwargs: dict, message: str) -> None:
    base: dict = dict(
        block_sizes=[16], max_num_reqs=2, max_num_batched_tokens=8, max_num_blocks_per_group=[4], device="cpu"
    )
    base.update(kwargs)
    with pytest.raises(ValidationError, match=message):
        TorchBlockTables(**base)


def test_block_table_width_rounds_to_128_tokens() -> None:
    assert block_table_width(100, 16) == 104
    assert block_table_width(3, 128) == 3
    assert block_table_width(5, 48) == 8
    assert block_table_width(5, 16, token_alignment=None) == 5


def test_the_geometry_record_is_what_every_blocktables_is_built_from() -> None:
    from diffusion_kv.core.block_tables import BlockTablesGeometry

    geometry = BlockTablesGeometry.of(
        block_sizes=[32, 64], max_num_reqs=3, max_num_batched_tokens=96, max_num_blocks_per_group=[4, 2],
        device="cpu", kernel_block_sizes=[16, 64],
    )  # fmt: skip
    assert geometry.blocks_per_kv_block == (2, 1)
    assert geometry.kwargs() == {
        "block_sizes": [32, 64], "max_num_reqs": 3, "max_num_batched_tokens": 96,
        "max_num_blocks_per_group": [4, 2], "device": torch.device("cpu"), "kernel_block_sizes": [16, 64],
        "cp_size": 1, "cp_rank": 0, "cp_interleave": 1, "slot_mapping_dtype": torch.int64,
    }  # fmt: skip
    tables = TorchBlockTables(**geometry.kwargs())
    assert tables.geometry == geometry
    # the record itself: what the runner hands over (geometry.build), the keywords kept for vLLM's signature
    by_record = TorchBlockTables(geometry)
    assert by_record.geometry == geometry and by_record.blocks_per_kv_block == [2, 1]
    assert isinstance(geometry.build(TorchBlockTables), TorchBlockTables)
    with pytest.raises(ValidationError, match="takes a BlockTablesGeometry or its keywords, not both"):
        TorchBlockTables(geometry, max_num_reqs=3)

    class KeywordTables(TorchBlockTables):  # a subclass written to the keyword protocol
        def __init__(self, **keywords: object) -> None:
            self.seen = sorted(keywords)
            super().__init__(**keywords)

    built = geometry.build(KeywordTables)
    assert isinstance(built, KeywordTables) and built.seen == sorted(geometry.kwargs())
    assert BlockTablesGeometry.of(
        block_sizes=[16], max_num_reqs=1, max_num_batched_tokens=1, max_num_blocks_per_group=[1], device="cpu"
    ).kernel_block_sizes == (16,)  # fmt: skip
    with pytest.raises(ValidationError, match="group 0: kernel block size 24 must be a positive divisor"):
        BlockTablesGeometry.of(
            block_sizes=[32], max_num_reqs=1, max_num_batched_tokens=1, max_num_blocks_per_group=[1],
            device="cpu", kernel_block_sizes=[24],
        )  # fmt: skip


def test_to_device_on_the_host_returns_the_tensor_itself() -> None:
    from diffusion_kv.core.transfer import to_device

    host = torch.arange(5)
    assert to_device(host, "cpu") is host and to_device(host, torch.device("cpu")) is host


def test_to_device_refuses_while_a_cuda_graph_is_captured(monkeypatch: pytest.MonkeyPatch) -> None:
    """The refusal comes before any copy or pinned allocation (checked here with the capture
    query patched, so it runs without a GPU); the host tensor is left as it was."""
    from diffusion_kv.core import transfer
    from diffusion_kv.core.errors import StateError

    def no_pinning() -> bool:
        raise AssertionError("pinned memory was asked for during a capture")

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setattr(transfer, "pinned_memory_available", no_pinning)
    host = torch.arange(4)
    with pytest.raises(StateError, match="while a CUDA graph is being captured"):
        transfer.to_device(host, "cuda")
    with pytest.raises(StateError, match="while a CUDA graph is being captured"):
        transfer.to_device(host, torch.device("cuda", 0))
    assert host.tolist() == [0, 1, 2, 3]
    assert transfer.to_device(host, "cpu") is host  # the host target never asks
