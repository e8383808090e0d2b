"""Binding the emulator to a released wheel's contract (diffusion_kv.testing.npu_contract).

In the normal CPU run these bind a *synthetic* contract (the emulator's own schemas, small meta
functions written here) to check the binder: calls go through the dispatcher with the wheel's
schema, a renamed argument or a changed default is refused before anything is registered, and
outputs that disagree with the wheel's meta function fail the call. In the CI lane
(``ci/npu_contract_lane.sh``, ``DIFFUSION_KV_NPU_CONTRACT`` set) the session is bound to a real
wheel instead: the synthetic cases skip and the lane cases check the session really runs
through it.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch

from diffusion_kv.conformance.harness import PagedHarness
from diffusion_kv.core.rows import PagedRow
from diffusion_kv.platforms.npu import NpuPlatform
from diffusion_kv.platforms.npu.kernels import AscendKernels
from diffusion_kv.testing import TorchNpuEmulator, emulated_torch_npu
from diffusion_kv.testing import torch_npu_emulator as emulator_module
from diffusion_kv.testing.npu_contract import (
    ContractMismatch,
    WheelBinding,
    WheelContract,
    bind,
    bound,
    load_contract,
    method_differences,
    schema_differences,
)
from diffusion_kv.testing.torch_npu_emulator import EMULATED_OPS, SCATTER_SCHEMA, BoundOp, EmulatedOp

from .helpers import BF16, HEAD

SESSION = emulator_module.contract_binding()
synthetic = pytest.mark.skipif(
    SESSION is not None, reason="a released wheel's contract is bound for this session"
)
lane = pytest.mark.skipif(
    SESSION is None, reason="no wheel contract bound (ci/npu_contract_lane.sh binds one)"
)

GOOD_META = """
import torch


def fia_meta(query, key, value, *, softmax_lse_flag=False, **kwargs):
    lse = [query.shape[0], query.shape[1], 1] if softmax_lse_flag else [0]
    return torch.empty_like(query), torch.empty(lse, dtype=torch.float32, device="meta")


def scatter_meta(key, value, key_cache, value_cache, slot_mapping, **kwargs):
    return None
"""
MASK = torch.triu(torch.ones(2048, 2048, dtype=torch.int8), diagonal=1)


def write_contract(folder: Path, meta: str = GOOD_META, **schema_changes: str) -> WheelContract:
    schemas = {s.qualified: f"{s.namespace}::{s.schema}" for s in EMULATED_OPS}
    schemas.update({k.replace("__", "::"): v for k, v in schema_changes.items()})
    (folder / "wheel_meta.py").write_text(textwrap.dedent(meta))
    contract = {
        "version": "0.0.test",
        "wheel": "synthetic.whl",
        "schemas": schemas,
        "sources": {q: "the emulator's embedded schema" for q in schemas},
        "meta_module": "wheel_meta.py",
        "meta_functions": {
            "npu::npu_fused_infer_attention_score": "fia_meta",
            "npu::npu_scatter_pa_kv_cache": "scatter_meta",
        },
        "notes": ["synthetic"],
    }
    (folder / "contract.json").write_text(json.dumps(contract))
    return load_contract(folder)


def fia(module: object, **changes: object) -> tuple[torch.Tensor, torch.Tensor]:
    kc = torch.zeros(1, 128, HEAD, dtype=BF16)
    kwargs: dict[str, object] = dict(
        block_table=torch.tensor([[0]], dtype=torch.int32),
        input_layout="TND",
        block_size=128,
        actual_seq_lengths=[2],
        actual_seq_lengths_kv=[2],
        num_heads=1,
        sparse_mode=3,
        atten_mask=MASK,
    )
    kwargs.update(changes)
    out: tuple[torch.Tensor, torch.Tensor] = module.npu_fused_infer_attention_score(  # type: ignore[attr-defined]
        torch.zeros(2, 1, HEAD, dtype=BF16), kc, kc, **kwargs
    )
    return out


# --- the binder, with a synthetic contract ------------------------------------------------------


@synthetic
def test_bound_calls_go_through_the_dispatcher_with_the_wheels_schema(tmp_path: Path) -> None:
    contract = write_contract(tmp_path)
    assert (contract.version, contract.wheel, contract.notes) == ("0.0.test", "synthetic.whl", ("synthetic",))
    with bound(contract) as binding, emulated_torch_npu() as emu:
        op = emu.module.npu_scatter_pa_kv_cache
        assert isinstance(op, BoundOp)
        assert op.default is torch.ops.npu.npu_scatter_pa_kv_cache.default
        assert str(op.default._schema).startswith("npu::npu_scatter_pa_kv_cache(Tensor key")
        kc = torch.zeros(1, 128, 1, HEAD, dtype=BF16)
        AscendKernels(emu.module).write_kv(
            torch.ones(2, 1, HEAD, dtype=BF16),
            torch.ones(2, 1, HEAD, dtype=BF16),
            kc,
            kc.clone(),
            torch.tensor([3, 5], dtype=torch.int32),
        )
        assert emu.calls[0].args == {"cache_mode": "Norm"} and kc[0, [3, 5]].eq(1).all()
        with pytest.raises(
            RuntimeError,
            match="Unknown keyword argument 'slot_indices' for operator 'npu::npu_scatter_pa_kv_cache'",
        ):
            op(key=kc, value=kc, key_cache=kc, value_cache=kc, slot_mapping=kc, slot_indices=kc)
        out, lse = fia(emu.module)
        assert out.shape == (2, 1, HEAD) and lse.shape == (0,)
        assert dict(binding.calls) == {
            "npu::npu_scatter_pa_kv_cache": 1,
            "npu::npu_fused_infer_attention_score": 1,
        }
        assert dict(binding.meta_checks) == dict(binding.calls)
        assert binding.describe()[:2] == [
            "torch-npu 0.0.test (synthetic.whl):",
            "  atb::_npu_paged_attention: schema from the emulator's embedded schema; no meta function in the wheel",
        ]
    assert not hasattr(torch.ops.npu, "npu_scatter_pa_kv_cache")
    assert emulator_module.contract_binding() is None
    assert isinstance(TorchNpuEmulator().module.npu_scatter_pa_kv_cache, EmulatedOp)


@synthetic
def test_omitted_arguments_take_the_wheels_defaults(tmp_path: Path) -> None:
    with bound(write_contract(tmp_path)), emulated_torch_npu() as emu:
        kc = torch.zeros(2, 16, 16, 16, dtype=torch.float16)  # PA_NZ: [blocks, H*D/16, block_size, 16]
        emu.module.npu_scatter_pa_kv_cache(
            torch.ones(1, 4, 64, dtype=torch.float16),
            torch.ones(1, 4, 64, dtype=torch.float16),
            kc,
            kc.clone(),
            torch.tensor([1], dtype=torch.int32),
        )
        assert emu.calls[0].args == {"cache_mode": "PA_NZ"}


@synthetic
def test_a_changed_default_is_refused_before_registration(tmp_path: Path) -> None:
    changed = "npu::" + SCATTER_SCHEMA.replace("cache_mode='PA_NZ'", "cache_mode='Norm'")
    contract = write_contract(tmp_path, npu__npu_scatter_pa_kv_cache=changed)
    with pytest.raises(ContractMismatch) as info:
        bind(contract)
    assert str(info.value) == (
        "torch-npu 0.0.test (synthetic.whl) disagrees with the emulator:\n"
        "  npu::npu_scatter_pa_kv_cache: argument 'cache_mode' defaults to 'Norm' in the wheel, 'PA_NZ' here"
    )
    assert emulator_module.contract_binding() is None and not hasattr(
        torch.ops.npu, "npu_scatter_pa_kv_cache"
    )


@synthetic
def test_a_renamed_argument_is_refused(tmp_path: Path) -> None:
    renamed = "npu::" + SCATTER_SCHEMA.replace("Tensor slot_mapping", "Tensor slots")
    with pytest.raises(ContractMismatch) as info:
        bind(write_contract(tmp_path, npu__npu_scatter_pa_kv_cache=renamed))
    assert str(info.value).splitlines()[1:] == [
        "  npu::npu_scatter_pa_kv_cache: argument 'slot_mapping' is in the emulator's schema only (renamed or removed in the wheel)",
        "  npu::npu_scatter_pa_kv_cache: argument 'slots' is in the wheel's schema only (Tensor slots)",
        "  npu::npu_scatter_pa_kv_cache (emulator method npu_scatter_pa_kv_cache): the emulator's parameter 'slot_mapping' is not an argument of the wheel's schema",
        "  npu::npu_scatter_pa_kv_cache (emulator method npu_scatter_pa_kv_cache): the wheel's argument 'slots' is not a parameter of the emulator",
    ]


@synthetic
def test_outputs_that_disagree_with_the_wheels_meta_function_fail_the_call(tmp_path: Path) -> None:
    one_element_lse = GOOD_META.replace("else [0]", "else [1]")
    with (
        bound(write_contract(tmp_path, meta=one_element_lse)),
        emulated_torch_npu() as emu,
        pytest.raises(ContractMismatch) as info,
    ):
        fia(emu.module)
    assert str(info.value) == (
        "npu::npu_fused_infer_attention_score: the emulator returned (((2, 1, 128), torch.bfloat16), "
        "((0,), torch.float32)); torch-npu 0.0.test's meta function gives (((2, 1, 128), torch.bfloat16), "
        "((1,), torch.float32))"
    )


@synthetic
def test_a_meta_refusal_of_an_accepted_call_fails_it(tmp_path: Path) -> None:
    refusing = GOOD_META.replace(
        "    lse = [",
        '    torch._check(kwargs.get("input_layout") != "TND", lambda: "no TND here")\n    lse = [',
    )
    with (
        bound(write_contract(tmp_path, meta=refusing)),
        emulated_torch_npu() as emu,
        pytest.raises(
            ContractMismatch, match="meta function refused a call the emulator accepted .*no TND here"
        ),
    ):
        fia(emu.module)


@synthetic
def test_one_binding_at_a_time(tmp_path: Path) -> None:
    with bound(write_contract(tmp_path)), pytest.raises(RuntimeError, match="already bound"):
        bind(write_contract(tmp_path))


def test_schema_and_method_differences() -> None:
    base = "npu::op(Tensor x, *, int k=1, str? mode='A') -> Tensor"
    assert schema_differences(base, base.replace("'A'", '"A"')) == []
    assert schema_differences(base.replace("int k=1", "int k=2"), base) == [
        "argument 'k' defaults to 2 in the wheel, 1 here"
    ]
    assert schema_differences(base.replace("int k=1, ", ""), base) == [
        "argument 'k' is in the emulator's schema only (renamed or removed in the wheel)"
    ]
    assert schema_differences(base.replace("Tensor x, *,", "Tensor x,"), base) == [
        "argument 'k' is keyword-only=False in the wheel",
        "argument 'mode' is keyword-only=False in the wheel",
    ]
    assert schema_differences(base.replace("Tensor x", "Tensor(a!) x"), base) == [
        "argument 'x' has type Tensor (alias (True, ['a'])) in the wheel, Tensor (alias None) in the emulator"
    ]
    assert schema_differences(base.replace("-> Tensor", "-> (Tensor, Tensor)"), base) == [
        "returns ['Tensor', 'Tensor'] in the wheel, ['Tensor'] in the emulator"
    ]

    def method(x: object, *, k: int = 1, mode: str | None = "A") -> None: ...

    def loose(x: object, **rest: object) -> None: ...

    assert method_differences(base, method) == []
    assert method_differences(base.replace("mode", "kind"), method) == [
        "the emulator's parameter 'mode' is not an argument of the wheel's schema",
        "the wheel's argument 'kind' is not a parameter of the emulator",
    ]
    assert method_differences(base, loose) == []


# --- the lane: the session runs through a released wheel ---------------------------------------


@lane
def test_the_session_is_bound_to_a_released_wheel() -> None:
    assert isinstance(SESSION, WheelBinding)
    emu = TorchNpuEmulator()
    for name in ("npu_scatter_pa_kv_cache", "npu_fused_infer_attention_score", "_npu_reshape_and_cache"):
        op = getattr(emu.module, name)
        assert isinstance(op, BoundOp), f"{name} is not bound to torch-npu {SESSION.contract.version}"
    assert SESSION.has_meta("npu::npu_fused_infer_attention_score")
    assert SESSION.has_meta("npu::npu_scatter_pa_kv_cache")


@lane
def test_a_plugin_forward_is_checked_against_the_wheels_meta_functions() -> None:
    assert isinstance(SESSION, WheelBinding)
    before = dict(SESSION.meta_checks)
    with emulated_torch_npu() as emu:
        h = PagedHarness(
            NpuPlatform(), dtype=BF16, head_size=HEAD, block_size=128, num_blocks=8, layer_names=("layer.0",)
        )
        h.install("r", [130])
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(130, 4, HEAD, generator=g).to(BF16) for _ in range(3))
        batch = h.translator.prepare((PagedRow("r", 130, 130, 0, sequence_id=0),))
        with h.translator.activate(batch):
            h.executor.forward("layer.0", q, k, v)
        assert emu.ops() == ["npu_scatter_pa_kv_cache", "npu_fused_infer_attention_score"]
    for op in ("npu::npu_scatter_pa_kv_cache", "npu::npu_fused_infer_attention_score"):
        assert SESSION.meta_checks[op] == before.get(op, 0) + 1
