"""The embedding host's runtime as a value: ``HostRuntime`` reaches selection and every backend
instance through the runner; a backend declares ``needs_host``; nothing is process-global."""

from __future__ import annotations

import ast
import pathlib
from typing import Any, ClassVar

import pytest
import torch

import diffusion_kv
from diffusion_kv.core.backend import GroupContext
from diffusion_kv.core.capabilities import Requirements
from diffusion_kv.core.errors import UnsupportedRequirementsError, ValidationError
from diffusion_kv.core.host import NO_HOST_REASON, HostRuntime
from diffusion_kv.core.runner import PagedLayerSpec, PagedWorker, RunnerConfig
from diffusion_kv.platforms.cpu import CpuPlatform
from diffusion_kv.platforms.cpu.backend import CpuReferenceBackend
from diffusion_kv.platforms.selection import validate_backend_class

CONFIG = {"model": "tiny"}


class HostedBackend(CpuReferenceBackend):
    """The reference kernels, but only with a host whose config it can read."""

    name: ClassVar[str] = "hosted"
    platform: ClassVar[str] = "cpu"
    needs_host: ClassVar[bool] = True
    prepared: ClassVar[list[Any]] = []

    @classmethod
    def host_reasons(cls, host: HostRuntime | None) -> list[str]:
        reasons = super().host_reasons(host)
        if host is not None and host.config is None:
            reasons.append("the host gave no config")
        return reasons

    @classmethod
    def prepare_worker(cls, host: HostRuntime | None) -> None:
        cls.prepared.append(host)

    def __init__(self, group: GroupContext) -> None:
        super().__init__(group)
        self.seen = group.host


def runner(host: Any = None, backend: Any = HostedBackend, max_model_len: int = 40) -> PagedWorker:
    r = PagedWorker(
        CpuPlatform(),
        RunnerConfig(
            max_model_len=max_model_len, max_rows_per_request=1, max_num_seqs=2, max_num_batched_tokens=64,
            backend=backend,
        ),
        host=host,
    )  # fmt: skip
    r.register_kv_cache_layers({"blocks.0.attn": PagedLayerSpec(2, 2, 16, torch.float32)})
    r.initialize_kv_cache(num_blocks=4, block_size=16)
    return r


def test_a_backend_that_needs_a_host_gets_the_runners_host() -> None:
    host = HostRuntime(config=CONFIG, kv_cache_config="KV", name="test host")
    r = runner(host)
    (backend,) = r.backends
    assert type(backend) is HostedBackend and backend.seen is host and r.host is host


def test_without_a_host_it_is_refused_with_the_reason_and_nothing_is_initialised() -> None:
    r = PagedWorker(
        CpuPlatform(),
        RunnerConfig(max_model_len=40, max_rows_per_request=1, max_num_seqs=2, max_num_batched_tokens=64,
                     backend=HostedBackend),
    )  # fmt: skip
    r.register_kv_cache_layers({"blocks.0.attn": PagedLayerSpec(2, 2, 16, torch.float32)})
    with pytest.raises(UnsupportedRequirementsError) as err:
        r.initialize_kv_cache(num_blocks=4, block_size=16)
    assert f"      {NO_HOST_REASON}" in str(err.value).splitlines()
    assert (r.initialized, r.backends, r.kv_caches) == (False, (), {})
    with pytest.raises(UnsupportedRequirementsError, match="the host gave no config"):
        runner(HostRuntime(config=None))


def test_selection_and_explain_take_the_host() -> None:
    platform = CpuPlatform()
    req = Requirements(dtype=torch.float32, head_size=16)
    host = HostRuntime(config=CONFIG)
    assert platform.host_reasons(HostedBackend, None) == [NO_HOST_REASON]
    assert platform.host_reasons(HostedBackend, host) == []
    assert platform.host_reasons(CpuReferenceBackend, None) == []  # the default: no host needed
    assert platform.select_backend(req, force=HostedBackend, host=host) is HostedBackend
    lines = platform.explain(req, force=HostedBackend)
    assert lines[-1].endswith(f"float64 math [a class given as the backend choice]: {NO_HOST_REASON}")
    assert platform.explain(req, force=HostedBackend, host=host)[-1].endswith(
        "float64 math [a class given as the backend choice]: selected"
    )
    with pytest.raises(ValidationError, match="host must be a HostRuntime or None; got dict"):
        platform.select_backend(req, host=CONFIG)  # type: ignore[arg-type]


def test_init_worker_prepares_the_selected_backend_with_the_host() -> None:
    class Platform(CpuPlatform):
        backends: ClassVar[tuple[type[CpuReferenceBackend], ...]] = (HostedBackend, CpuReferenceBackend)

    HostedBackend.prepared.clear()
    host = HostRuntime(config=CONFIG)
    Platform().init_worker(host)
    Platform().init_worker()  # without a host the reference backend is selected: nothing recorded
    assert HostedBackend.prepared == [host]


def test_block_table_widths_follow_the_hosts_alignment() -> None:
    # 40 tokens of 16-token blocks: 3 blocks; a host aligning rows to 128 tokens wants 8
    plain = runner(HostRuntime(config=CONFIG))
    aligned = runner(HostRuntime(config=CONFIG, block_table_alignment=128))
    assert plain.block_tables is not None and aligned.block_tables is not None
    assert plain.block_tables.max_num_blocks_per_group == [3]  # type: ignore[attr-defined]
    assert aligned.block_tables.max_num_blocks_per_group == [8]  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"block_table_alignment": 0}, "block_table_alignment must be a positive integer; got 0"),
        ({"block_table_alignment": True}, "block_table_alignment must be a positive integer; got True"),
        ({"attn_groups": "groups"}, "attn_groups must be a sequence .* got str"),
        ({"name": ""}, "name must be a non-empty string"),
    ],
)
def test_a_malformed_host_is_refused(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        HostRuntime(**kwargs)


def test_the_runner_refuses_what_is_not_a_host() -> None:
    with pytest.raises(ValidationError, match="host must be a HostRuntime or None; got dict"):
        runner(CONFIG)


def test_load_time_validation_checks_the_host_declarations() -> None:
    class Bad(CpuReferenceBackend):
        name: ClassVar[str] = "bad"
        needs_host = "yes"  # type: ignore[assignment]
        host_kv_cache_layouts = ["LBHNC"]  # type: ignore[assignment]

    problems = validate_backend_class(Bad)
    assert "needs_host must be a bool; got 'yes'" in problems
    assert (
        "host_kv_cache_layouts must be None or a non-empty tuple of layout names; got ['LBHNC']" in problems
    )
    assert validate_backend_class(HostedBackend) == []


def _identifiers(tree: ast.AST) -> set[str]:
    """Names a module defines, reads or looks up with ``getattr`` (string literals elsewhere,
    e.g. the migration list of removed names, do not count)."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            found.add(node.id)
        elif isinstance(node, ast.Attribute):
            found.add(node.attr)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)):
            found.add(node.name)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
        ):
            found.add(str(node.args[1].value))
    return found


def test_no_module_holds_host_objects_or_makes_backend_classes_at_run_time() -> None:
    """The old side channels stay gone: no process-global runtime, no getattr side contract, no
    ``type(name, bases, namespace)`` call."""
    root = pathlib.Path(diffusion_kv.__file__).parent
    trees = {path: ast.parse(path.read_text()) for path in root.rglob("*.py")}
    banned = {
        "bind_vllm_runtime",
        "needs_vllm_runtime",
        "runtime_reasons",
        "is_vllm_native",
        "_derived",
        "_BOUND",
    }
    offenders = {
        f"{path.relative_to(root)}: {sorted(banned & _identifiers(tree))}"
        for path, tree in trees.items()
        if banned & _identifiers(tree)
    }
    assert offenders == set()
    three_arg_type = [
        f"{path.relative_to(root)}:{node.lineno}"
        for path, tree in trees.items()
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "type"
        and len(node.args) == 3
    ]
    assert three_arg_type == []


HOST_ADAPTER_CLASSES = {
    ("integrations/vllm/compat.py", "block_tables_cls", "VllmBlockTables"),
    ("integrations/vllm/tier.py", "layer_adapter_cls", "PagedLayerAdapter"),
    ("integrations/vllm_omni/native.py", "vllm_attention_backend_for", "PagedBuilder"),
    ("integrations/vllm_omni/native.py", "vllm_attention_backend_for", "PagedAttentionBackend"),
    ("integrations/vllm_omni/platform.py", "platform_class", "DiffusionKVOmniPlatform"),
}
"""The only classes the package defines inside a function: each subclasses a host class that
exists only once the host is known (a per-version vLLM symbol, or the platform vLLM-Omni
detected), is built once per host and cached, and holds no host objects
(docs/architecture.md, "The embedding host's runtime")."""


def test_classes_are_built_in_functions_only_over_a_hosts_run_time_base() -> None:
    root = pathlib.Path(diffusion_kv.__file__).parent
    found = set()
    for path in root.rglob("*.py"):
        for fn in ast.walk(ast.parse(path.read_text())):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found |= {
                    (path.relative_to(root).as_posix(), fn.name, node.name)
                    for node in ast.walk(fn)
                    if isinstance(node, ast.ClassDef)
                }
    assert found == HOST_ADAPTER_CLASSES
