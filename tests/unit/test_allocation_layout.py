"""Allocation snapshot DTOs and the cache layout."""

from __future__ import annotations

import json
import pickle
from types import SimpleNamespace

import pytest
import torch

from diffusion_kv.core.allocation import ContextAllocation, RequestAllocation, SequenceAllocation
from diffusion_kv.core.capabilities import AttentionMode
from diffusion_kv.core.errors import ValidationError
from diffusion_kv.core.layout import AttentionSpec, CacheLayout, KVCacheGroup, single_group_layout


def sample() -> RequestAllocation:
    return RequestAllocation(
        request_id="req-1",
        allocation_generation=3,
        sequences=(
            SequenceAllocation(0, 4, 6, 10, [[1, 2, 3]], ["ref"], cached_prefix_len=4),  # type: ignore[arg-type]
            SequenceAllocation(1, 4, 6, 10, ((4, 5, 6),), ("ref",)),
        ),
        contexts=(ContextAllocation("ref", "image", 5, ((7, 8),)),),
    )


def test_lists_are_normalised_to_tuples_and_immutable() -> None:
    snap = sample()
    assert snap.sequences[0].block_ids == ((1, 2, 3),)
    assert snap.sequences[0].context_ids == ("ref",)
    with pytest.raises(AttributeError):
        snap.request_id = "x"  # type: ignore[misc]
    assert snap.num_rows == 3


def test_pickle_round_trip() -> None:
    snap = sample()
    assert pickle.loads(pickle.dumps(snap)) == snap


def test_json_round_trip() -> None:
    snap = sample()
    text = json.dumps(snap.to_dict())
    assert RequestAllocation.from_dict(json.loads(text)) == snap
    assert json.loads(text)["sequences"][0]["cached_prefix_len"] == 4


def test_content_key_ignores_generation() -> None:
    a = sample()
    b = RequestAllocation(a.request_id, 9, a.sequences, a.contexts)
    assert a != b and a.content_key() == b.content_key()


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"request_id": "r", "allocation_generation": 0}, r"lacks field\(s\) \['sequences'\]"),
        (
            {"request_id": "r", "allocation_generation": 0, "sequences": [], "extra": 1},
            r"unknown field\(s\) \['extra'\]",
        ),
        ([], "must be a mapping"),
        (
            {"request_id": "r", "allocation_generation": 0, "sequences": [{"sequence_id": 0}]},
            r"sequence snapshot lacks field\(s\)",
        ),
    ],
)
def test_from_dict_errors(data: object, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        RequestAllocation.from_dict(data)  # type: ignore[arg-type]


def test_structural_errors() -> None:
    with pytest.raises(ValidationError, match="block_ids must be a sequence"):
        SequenceAllocation(0, 0, 1, 1, 5)  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="block_ids group 0 must be a sequence of ints"):
        SequenceAllocation(0, 0, 1, 1, (3,))  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="context_ids must be a sequence of strings"):
        SequenceAllocation(0, 0, 1, 1, ((1,),), "ref")
    with pytest.raises(ValidationError, match="sequences must hold SequenceAllocation"):
        RequestAllocation("r", 0, ({"sequence_id": 0},))  # type: ignore[arg-type]


def test_layout_from_vllm_shaped_config() -> None:
    spec = SimpleNamespace(block_size=16, num_kv_heads=4, head_size=64, dtype=torch.bfloat16, non_causal=True)
    config = SimpleNamespace(
        num_blocks=100,
        kv_cache_groups=[SimpleNamespace(layer_names=["blk.0.attn", "blk.1.attn"], kv_cache_spec=spec)],
    )
    lay = CacheLayout.from_kv_cache_config(
        config, max_model_len=1000, max_rows_per_request=3, max_num_seqs=2, max_num_batched_tokens=4096
    )
    assert lay.groups == (
        KVCacheGroup(
            16, ("blk.0.attn", "blk.1.attn"), AttentionSpec(4, 64, torch.bfloat16, AttentionMode.FULL)
        ),
    )
    assert lay.max_num_reqs == 6
    assert lay.max_blocks_per_row() == [63]
    assert lay.group_of("blk.1.attn") == 0
    with pytest.raises(ValidationError, match="not KVCacheConfig-shaped"):
        CacheLayout.from_kv_cache_config(
            SimpleNamespace(),
            max_model_len=1,
            max_rows_per_request=1,
            max_num_seqs=1,
            max_num_batched_tokens=1,
        )
    with pytest.raises(ValidationError, match="KV-cache group 0 is not KVCacheGroupSpec-shaped"):
        CacheLayout.from_kv_cache_config(
            SimpleNamespace(num_blocks=1, kv_cache_groups=[SimpleNamespace(layer_names=["x"])]),
            max_model_len=1,
            max_rows_per_request=1,
            max_num_seqs=1,
            max_num_batched_tokens=1,
        )


def test_layout_validation() -> None:
    spec = AttentionSpec(2, 8, torch.float16)
    with pytest.raises(ValidationError, match=r"layer\(s\) \['x'\] appear in more than one KV-cache group"):
        CacheLayout((KVCacheGroup(4, ("x",), spec), KVCacheGroup(4, ("x", "y"), spec)), 8, 16, 1, 1, 16)
    with pytest.raises(ValidationError, match="CacheLayout.num_blocks must be a positive integer; got 0"):
        single_group_layout(
            ["x"],
            num_kv_heads=2,
            head_size=8,
            dtype=torch.float16,
            block_size=4,
            num_blocks=0,
            max_model_len=8,
        )
    with pytest.raises(ValidationError, match="AttentionSpec.head_size must be a positive integer"):
        AttentionSpec(2, 0, torch.float16)
    with pytest.raises(ValidationError, match="duplicates"):
        KVCacheGroup(4, ("a", "a"), spec)
    assert spec.bytes_per_token() == 2 * 2 * 8 * 2
