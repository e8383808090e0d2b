"""vLLM-Omni's prefix-cache identity fields mapped to prefix keys (no vLLM-Omni import)."""

from __future__ import annotations

import pytest
import torch

from diffusion_kv.core.errors import ValidationError
from diffusion_kv.core.prefix_cache import ContentSpan
from diffusion_kv.core.runner import PagedLayerSpec, PagedWorker, RunnerConfig
from diffusion_kv.integrations.vllm_omni.prefix import content_from_host, host_prefix_keys
from diffusion_kv.platforms.cpu import CpuPlatform


@pytest.fixture(scope="module")
def runner() -> PagedWorker:
    r = PagedWorker(
        CpuPlatform(),
        RunnerConfig(max_model_len=128, max_rows_per_request=2, max_num_seqs=2, max_num_batched_tokens=256),
    )
    r.register_kv_cache_layers({"l0": PagedLayerSpec(2, 2, 16, torch.float32)})
    r.initialize_kv_cache(num_blocks=32, block_size=8)
    return r


def test_content_spans_chunk_ids_around_features() -> None:
    ids = list(range(100, 140))
    spans = content_from_host(40, ids, [(10, 12, b"img")], chunk=8)
    assert [(s.start, s.end) for s in spans] == [(0, 8), (8, 10), (10, 22), (22, 24), (24, 32), (32, 40)]
    assert spans[2].key == b"img"
    assert spans[0].key == b"ids:" + b"".join(i.to_bytes(8, "little") for i in range(100, 108))
    # a feature reaching past the prefix is not part of it; its placeholder ids are named instead
    assert [s.key for s in content_from_host(16, ids, [(12, 8, b"late")], chunk=16)] == [
        spans[0].key[:4] + b"".join(i.to_bytes(8, "little") for i in range(100, 116))
    ]
    # without ids only what features name from token 0 on
    assert content_from_host(40, None, [(0, 16, "a"), (16, 8, "b"), (30, 4, "c")]) == (
        ContentSpan(0, 16, "a"),
        ContentSpan(16, 24, "b"),
    )


def test_bad_host_fields_are_refused() -> None:
    with pytest.raises(ValidationError, match="at least prefix_len=8 integer ids; got 4 entries"):
        content_from_host(8, [1, 2, 3, 4])
    with pytest.raises(ValidationError, match="with a non-integer among them"):
        content_from_host(2, [1, 2.0])  # type: ignore[list-item]
    with pytest.raises(ValidationError, match="features overlap"):
        content_from_host(32, list(range(32)), [(0, 10, "a"), (8, 4, "b")])
    with pytest.raises(ValidationError, match=r"a feature is \(offset, length, content hash\)"):
        content_from_host(32, list(range(32)), [(0, 10)])  # type: ignore[list-item]


def test_host_keys_follow_every_identity_field(runner: PagedWorker) -> None:
    ids = list(range(48))

    def keys(**kw: object) -> tuple[bytes, ...]:
        args: dict[str, object] = dict(
            cache_namespace="hunyuan-image3@rev1", prefix_len=40, cache_token_ids=ids, features=[(16, 8, b"ref")],
            full_attn_spans=[(40, 48)],
        )  # fmt: skip
        args.update(kw)
        return host_prefix_keys(runner, **args)  # type: ignore[arg-type]

    base = keys()
    assert len(base) == 5 and keys() == base  # 40 prefix tokens, block 8, the target span starts at 40
    assert keys(branch=1)[0] != base[0] and keys(lora=(3, 1.0))[0] != base[0]
    assert keys(cache_namespace="other")[0] != base[0]
    changed = keys(features=[(16, 8, b"another image")])
    assert changed[:2] == base[:2] and all(a != b for a, b in zip(changed[2:], base[2:], strict=True))
    late = keys(cache_token_ids=[*ids[:35], 999, *ids[36:]])
    assert late[:4] == base[:4] and late[4] != base[4]
    # a span from token 36 into the target pulls the cut back to 32
    assert len(keys(full_attn_spans=[(36, 48)])) == 4
    with pytest.raises(ValidationError, match=r"lora must be \(lora_int_id, scale\)"):
        keys(lora="x")
