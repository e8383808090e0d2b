"""vLLM-Omni's prefix-cache identity fields as diffusion-kv prefix keys (``docs/vllm-omni.md``).

vLLM-Omni describes a request's cacheable prefix with three things: ``cache_token_ids`` (the
prefix's token ids, multimodal placeholders included), the content hash of each multimodal
feature placed in the prefix (a reference image's hash; a model whose features depend on random
state, such as a VAE sample, folds that state into the feature's hash), and a
``cache_namespace`` (its model namespace with the LoRA id and scale). diffusion-kv maps them:

=============================================  ===================================================
vLLM-Omni                                       diffusion-kv
=============================================  ===================================================
``cache_token_ids[a:b]`` between features       :class:`ContentSpan` s ending on multiples of
                                                ``chunk`` (the block size), keyed by their ids
                                                (a prefix that differs only late still hits its
                                                leading blocks)
a feature at ``[offset, offset + length)``      one :class:`ContentSpan` keyed by its hash (its
                                                placeholder ids are not read)
``cache_namespace``                             :attr:`PrefixNamespace.model`
a LoRA (``lora_int_id``, scale)                 :attr:`PrefixNamespace.adapter`
the sequence (CFG branch)                        :attr:`PrefixNamespace.branch`
KV layout, parallel ranks                       from the worker (:func:`worker_namespace`)
=============================================  ===================================================

:func:`host_prefix_keys` gives the keys a :class:`~diffusion_kv.core.allocator.SequenceRequest`
carries. Importing this module imports neither vLLM nor vLLM-Omni.
"""

from __future__ import annotations

import itertools
import struct
from collections.abc import Sequence

from diffusion_kv.core.errors import ValidationError
from diffusion_kv.core.prefix_cache import ContentSpan
from diffusion_kv.core.runner import PagedWorker
from diffusion_kv.core.scheduler import row_prefix_keys, worker_namespace

FeatureSpan = tuple[int, int, "bytes | str"]
"""``(offset, length, content hash)`` of one multimodal feature inside the prefix."""


def _ids_key(ids: Sequence[int]) -> bytes:
    return b"ids:" + struct.pack(f"<{len(ids)}q", *ids)


def content_from_host(
    prefix_len: int,
    cache_token_ids: Sequence[int] | None,
    features: Sequence[FeatureSpan] = (),
    chunk: int = 16,
) -> tuple[ContentSpan, ...]:
    """The content spans of a prefix of ``prefix_len`` tokens (module table). Without token
    ids the prefix is named only where features cover it (a gap ends the named prefix)."""
    if type(prefix_len) is not int or prefix_len < 0:
        raise ValidationError(f"prefix_len must be an int >= 0; got {prefix_len!r}")
    if type(chunk) is not int or chunk <= 0:
        raise ValidationError(f"chunk must be a positive int; got {chunk!r}")
    ids: list[int] | None = None
    if cache_token_ids is not None:
        ids = list(cache_token_ids)
        if len(ids) < prefix_len or any(type(t) is not int for t in ids[:prefix_len]):
            raise ValidationError(
                f"cache_token_ids must hold at least prefix_len={prefix_len} integer ids; got {len(ids)} "
                "entries" + ("" if len(ids) < prefix_len else " with a non-integer among them")
            )
    placed: list[tuple[int, int, bytes | str]] = []
    for feature in features:
        try:
            offset, length, digest = feature
        except (TypeError, ValueError):
            raise ValidationError(f"a feature is (offset, length, content hash); got {feature!r}") from None
        if type(offset) is not int or type(length) is not int or length <= 0 or offset < 0:
            raise ValidationError(f"feature offset/length must be ints >= 0 / > 0; got {feature!r}")
        if offset + length > prefix_len:
            continue  # reaches past the prefix: not part of what may be cached
        placed.append((offset, offset + length, digest))
    placed.sort()
    for (a0, b0, _), (a1, _, _) in itertools.pairwise(placed):
        if a1 < b0:
            raise ValidationError(f"features overlap: [{a0}, {b0}) and one starting at {a1}")
    spans: list[ContentSpan] = []
    cursor = 0

    def fill(upto: int) -> None:
        nonlocal cursor
        if ids is None:
            return
        while cursor < upto:
            end = min(upto, (cursor // chunk + 1) * chunk)  # chunks end on multiples of chunk
            spans.append(ContentSpan(cursor, end, _ids_key(ids[cursor:end])))
            cursor = end

    for a, b, digest in placed:
        fill(a)
        if ids is None and a != cursor:
            break  # an unnamed gap: nothing after it is named
        spans.append(ContentSpan(a, b, digest))
        cursor = b
    fill(prefix_len)
    return tuple(spans)


def host_prefix_keys(
    runner: PagedWorker,
    *,
    cache_namespace: str,
    prefix_len: int,
    cache_token_ids: Sequence[int] | None,
    features: Sequence[FeatureSpan] = (),
    full_attn_spans: Sequence[tuple[int, int]] = (),
    branch: int = 0,
    lora: tuple[int, float] | None = None,
    block_size: int | None = None,
    chunk: int | None = None,
) -> tuple[bytes, ...]:
    """The prefix keys of one sequence (CFG ``branch``) of a vLLM-Omni request on ``runner``'s
    worker (module table); ``block_size`` defaults to the worker's tokens per block, ``chunk``
    (how many token ids one content span names at most) to the block size."""
    layout = runner.layout
    if layout is None:
        raise ValidationError("host_prefix_keys needs an initialised runner (initialize_kv_cache first)")
    if block_size is None:
        sizes = {g.block_size * runner.config.cp_size for g in layout.groups}
        if len(sizes) != 1:
            raise ValidationError(
                f"the worker's groups have different block sizes {sorted(sizes)}; pass block_size"
            )
        block_size = sizes.pop()
    if lora is not None and (not isinstance(lora, tuple) or len(lora) != 2 or type(lora[0]) is not int):
        raise ValidationError(f"lora must be (lora_int_id, scale); got {lora!r}")
    adapter = None if lora is None else f"lora {lora[0]} scale {float(lora[1]).hex()}"
    content = content_from_host(prefix_len, cache_token_ids, features, chunk or block_size)
    spans = tuple((int(a), int(b)) for a, b in full_attn_spans)
    namespace = worker_namespace(runner, cache_namespace, branch, adapter)
    return row_prefix_keys(runner, namespace, content, prefix_len, spans, block_size)


__all__ = ["FeatureSpan", "content_from_host", "host_prefix_keys"]
