"""Discovery and selection rules, against real entry points of the test distributions."""

from __future__ import annotations

import warnings

import pytest
import torch

import diffusion_kv
from diffusion_kv import (
    AmbiguousPlatformError,
    DuplicatePlatformError,
    PlatformNotFoundError,
    PlatformUnavailableError,
    PluginLoadError,
    Requirements,
    UnsupportedRequirementsError,
)
from diffusion_kv.core.errors import ValidationError
from diffusion_kv.platforms import selection
from diffusion_kv.platforms.cpu import CpuPlatform
from diffusion_kv.platforms.interface import AttentionMode
from diffusion_kv.platforms.selection import PluginLoadWarning

# --- the real group on this CPU machine ------------------------------------------------------------


def test_builtins_register_through_entry_points() -> None:
    statuses = {s.name: s for s in diffusion_kv.available_platforms()}
    assert set(statuses) >= {"cpu", "cuda", "npu"}
    assert statuses["cpu"].entry_point == "cpu = diffusion_kv.platforms.cpu:CpuPlatform"
    assert statuses["cuda"].entry_point == "cuda = diffusion_kv.platforms.cuda:CudaPlatform"
    assert statuses["npu"].entry_point == "npu = diffusion_kv.platforms.npu:NpuPlatform"
    assert statuses["cpu"].distribution.startswith("diffusion-kv ")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks CPU-only detection")
def test_cpu_machine_selects_cpu_and_explains_the_others() -> None:
    platform = diffusion_kv.get_platform()
    assert isinstance(platform, CpuPlatform)
    statuses = {s.name: s for s in diffusion_kv.available_platforms()}
    assert statuses["cpu"].selected and statuses["cpu"].available
    assert not statuses["cuda"].available
    assert "CPU-only" in statuses["cuda"].reason or "no CUDA device" in statuses["cuda"].reason
    assert not statuses["npu"].available and "torch_npu" in statuses["npu"].reason
    assert not statuses["cuda"].selected and not statuses["npu"].selected


def test_explicit_unknown_name_lists_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(PlatformNotFoundError) as info:
        diffusion_kv.get_platform("bogus")
    message = str(info.value)
    assert "'bogus'" in message and "cpu, cuda, npu" in message
    monkeypatch.setenv(selection.ENV_PLATFORM, "bogus")
    with pytest.raises(PlatformNotFoundError, match="'bogus'"):
        diffusion_kv.get_platform()


def test_env_platform_selects_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(selection.ENV_PLATFORM, "cpu")
    sel = selection.select_platform()
    assert sel.platform.name == "cpu"
    assert sel.how == f"requested by {selection.ENV_PLATFORM}"


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_requesting_unavailable_platform_gives_reason() -> None:
    with pytest.raises(PlatformUnavailableError, match="'cuda' is not available here"):
        diffusion_kv.get_platform("cuda")


def test_argument_wins_over_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(selection.ENV_PLATFORM, "bogus")
    assert diffusion_kv.get_platform("cpu").name == "cpu"


def test_instances_are_cached_per_plugin_set() -> None:
    assert diffusion_kv.get_platform("cpu") is diffusion_kv.get_platform("cpu")


# --- the test group: real broken entry points ----------------------------------------------------------


BROKEN = {"badcaps", "badsig", "dup", "importerror", "nomember", "notaplatform"}
BROKEN_BACKENDS = {"notabackend", "orphan", "reference"}


def test_broken_plugins_are_reported_not_swallowed(test_group: str) -> None:
    plugins = selection.discover()
    assert plugins.namespace == test_group
    assert {r.name for r in plugins.broken()} == BROKEN | BROKEN_BACKENDS
    errors = {r.name: str(r.error) for r in plugins.broken()}
    assert "importerror = dkv_test_plugins.does_not_exist:Plugin" in errors["importerror"]
    assert "ModuleNotFoundError" in errors["importerror"] and "Fix:" in errors["importerror"]
    assert "missing member(s) is_available" in errors["nomember"]
    assert "lacks parameter 'local_rank'" in errors["badsig"]
    assert "'is_available' must be a classmethod" in errors["badsig"]
    assert (
        "capabilities: slot_mapping_dtypes must be a non-empty frozenset of torch.int32/torch.int64"
        in errors["badcaps"]
    )
    assert "head_sizes must be None or a non-empty frozenset of positive ints" in errors["badcaps"]
    assert "dtypes must hold torch.dtype values" in errors["badcaps"]
    assert "is not a subclass of diffusion_kv.core.backend.PagedBackend" in errors["notabackend"]
    assert "no installed platform is named 'nosuch'" in errors["orphan"]
    assert (
        "platform 'cpu' has a built-in backend named 'reference'; the built-in is kept" in errors["reference"]
    )
    assert "not a subclass of diffusion_kv.platforms.interface.Platform" in errors["notaplatform"]
    assert "dkv-test-plugins 0.1.0" in errors["importerror"]


def test_duplicate_name_names_both_distributions(test_group: str) -> None:
    with pytest.raises(DuplicatePlatformError) as info:
        diffusion_kv.get_platform("dup")
    message = str(info.value)
    assert "claimed by 2 entry points" in message
    assert "dkv-test-plugins 0.1.0" in message and "dkv-test-plugins-dup 0.1.0" in message


@pytest.mark.parametrize("name", ["importerror", "nomember", "badsig", "badcaps", "notaplatform"])
def test_requesting_broken_plugin_raises_its_load_error(test_group: str, name: str) -> None:
    with pytest.raises(PluginLoadError, match=f"platform plugin '{name}'"):
        diffusion_kv.get_platform(name)


def test_broken_plugins_do_not_break_auto_selection(test_group: str) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        platform = diffusion_kv.get_platform()
    assert platform.name == "cpu"
    warned = {str(w.message).split("'")[1] for w in caught if issubclass(w.category, PluginLoadWarning)}
    assert warned == BROKEN | BROKEN_BACKENDS


def test_one_available_accelerator_wins(test_group: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DKV_TEST_FAKEACCEL", "1")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PluginLoadWarning)
        sel = selection.select_platform()
    assert sel.platform.name == "fakeaccel"
    assert "DKV_TEST_FAKEACCEL=1" in sel.how


def test_several_accelerators_are_ambiguous(test_group: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DKV_TEST_FAKEACCEL", "1")
    monkeypatch.setenv("DKV_TEST_FAKEACCEL2", "1")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PluginLoadWarning)
        with pytest.raises(AmbiguousPlatformError) as info:
            diffusion_kv.get_platform()
        message = str(info.value)
        assert "fakeaccel, fakeaccel2" in message
        assert selection.ENV_PLATFORM in message and selection.ENV_PLUGINS in message
        # an explicit choice resolves it
        assert diffusion_kv.get_platform("fakeaccel2").name == "fakeaccel2"


def test_raising_detector_is_a_reason(test_group: str) -> None:
    with pytest.raises(PlatformUnavailableError, match="detector raised OSError: driver query failed"):
        diffusion_kv.get_platform("raisingdetector")


def test_allowlist_limits_which_entry_points_load(test_group: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(selection.ENV_PLUGINS, "cpu, fakeaccel ,nothere")
    monkeypatch.setenv(selection.ENV_BACKEND_PLUGINS, "extra")
    selection.refresh()
    plugins = selection.discover()
    assert plugins.names == ["cpu", "fakeaccel"]
    assert plugins.broken() == []
    assert plugins.not_installed == ("nothere",)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing broken was loaded, so nothing is warned
        assert diffusion_kv.get_platform().name == "cpu"
    with pytest.raises(PlatformNotFoundError, match="installed: cpu, fakeaccel"):
        diffusion_kv.get_platform("importerror")


def test_allowlist_without_reference_and_no_accelerator(
    test_group: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(selection.ENV_PLUGINS, "fakeaccel")
    monkeypatch.setenv(selection.ENV_BLOCKED_BACKENDS, "notabackend,reference")
    selection.refresh()
    with pytest.raises(PlatformNotFoundError, match="reference platform 'cpu' is not loaded"):
        diffusion_kv.get_platform()


# --- requirements and aggregated reasons ----------------------------------------------------------------


def test_requirements_supported_pass() -> None:
    req = Requirements(dtype=torch.float16, head_size=80, block_size=16, num_heads=8, num_kv_heads=2)
    assert diffusion_kv.get_platform("cpu", req).name == "cpu"


def test_aggregated_reasons_show_requirements_once_and_every_reason(test_group: str) -> None:
    req = Requirements(dtype=torch.int8, ulysses_degree=2, dcp_size=2, graph_capture=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PluginLoadWarning)
        with pytest.raises(UnsupportedRequirementsError) as info:
            diffusion_kv.get_platform(requirements=req)
    message = str(info.value)
    assert message.count("  requirements: ") == 1
    assert "dtype=int8, ulysses_degree=2, dcp_size=2, graph_capture=True" in message
    cpu_part = message.split("`cpu` is not supported because:")[1].split("`fakeaccel`")[0]
    for reason in (
        "extra: dtype=int8",
        "extra: graph capture",
        "reference: dtype=int8",
        "reference: graph capture",
    ):
        assert reason in cpu_part
    # the cpu reference serves strict Ulysses and DCP, so neither is a reason against it
    assert "Ulysses" not in cpu_part and "decode context parallelism" not in cpu_part
    assert "`fakeaccel` is not supported because:" in message
    assert "unavailable: DKV_TEST_FAKEACCEL is not 1" in message
    assert "`importerror` is not supported because:" in message and "not loaded:" in message


def test_explicit_platform_with_unsupported_requirements() -> None:
    req = Requirements(attention_modes=frozenset({AttentionMode.PIECEWISE}), dtype=torch.int32)
    with pytest.raises(UnsupportedRequirementsError) as info:
        diffusion_kv.get_platform("cpu", req)
    message = str(info.value)
    assert "`cpu` is not supported because:" in message
    assert "reference: dtype=int32 (supported: ['bfloat16', 'float16', 'float32', 'float64'])" in message


def test_allowlist_does_not_import_excluded_plugins(test_group: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.delitem(sys.modules, "dkv_test_plugins.bad", raising=False)
    monkeypatch.setenv(selection.ENV_PLUGINS, "cpu")
    monkeypatch.setenv(selection.ENV_BACKEND_PLUGINS, "extra")  # bad.py also holds backends
    selection.refresh()
    assert selection.discover().names == ["cpu"]
    assert "dkv_test_plugins.bad" not in sys.modules


# --- backends added through the entry-point group ------------------------------------------------------


def test_a_distribution_adds_a_backend_to_a_builtin_platform(test_group: str) -> None:
    platform = diffusion_kv.get_platform("cpu")
    backends = platform.candidate_backends()
    assert [(b.name, b.priority) for b in backends] == [("extra", 150), ("sdpa", 120), ("reference", 100)]
    assert backends[0].__module__ == "dkv_test_plugins.good"
    assert platform.select_backend(Requirements(dtype=torch.float32)).name == "extra"
    lines = platform.explain()
    assert lines[0].startswith("cpu: selects backend 'extra'")
    assert lines[1].startswith("  [150] extra") and lines[2].startswith("  [120] sdpa")
    origin = "[entry point 'extra = dkv_test_plugins.good:ExtraCpuBackend', dkv-test-plugins 0.1.0]"
    assert f"{origin}: selected" in lines[1] and "[" not in lines[2].removeprefix("  [120]")
    assert lines[3].startswith("  [100] reference")
    status = next(s for s in diffusion_kv.available_platforms() if s.name == "cpu")
    assert [(b["name"], b["source"]) for b in status.backends] == [
        ("extra", "entry point 'extra = dkv_test_plugins.good:ExtraCpuBackend', dkv-test-plugins 0.1.0"),
        ("sdpa", "built-in"),
        ("reference", "built-in"),
    ]


def test_the_platform_allowlist_keeps_the_backends_of_the_platforms_it_names(
    test_group: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DIFFUSION_KV_PLUGINS limits platforms only: allowlisting ``cpu`` keeps the backend another
    distribution adds to it, and quietly leaves out one serving a platform not named."""
    monkeypatch.setenv(selection.ENV_PLUGINS, "cpu")
    selection.refresh()
    plugins = selection.discover()
    assert plugins.names == ["cpu"]
    assert [b.name for b in diffusion_kv.get_platform("cpu").candidate_backends()] == [
        "extra",
        "sdpa",
        "reference",
    ]
    assert plugins.left_out_backends == [
        ("orphan", "its platform 'nosuch' is not named in DIFFUSION_KV_PLUGINS")
    ]
    # the invalid backend entry points are still reported: the platform list does not hide them
    assert sorted(r.name for r in plugins.broken_backends()) == ["notabackend", "reference"]


def test_the_backend_allowlist_and_block_list_limit_backend_entry_points_only(
    test_group: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys

    monkeypatch.delitem(sys.modules, "dkv_test_plugins.good", raising=False)
    monkeypatch.setenv(selection.ENV_BACKEND_PLUGINS, "notabackend, orphan")
    monkeypatch.setenv(selection.ENV_BLOCKED_BACKENDS, "orphan")
    selection.refresh()
    plugins = selection.discover()
    assert "fakeaccel" in plugins.names  # platforms are not limited by the backend lists
    assert [b.name for b in plugins.backend_records] == ["notabackend"]
    assert plugins.left_out_backends == [
        ("extra", "not named in DIFFUSION_KV_BACKEND_PLUGINS"),
        ("orphan", "named in DIFFUSION_KV_BLOCKED_BACKENDS"),
        ("reference", "not named in DIFFUSION_KV_BACKEND_PLUGINS"),
    ]
    # arguments win over the environment, and a differently limited set is loaded apart
    explicit = selection.discover(backend_allowlist=["extra"], blocked_backends=[])
    assert [(r.name, r.error) for r in explicit.backend_records] == [("extra", None)]
    assert explicit is not plugins and selection.discover() is plugins


def test_a_backend_named_in_the_platform_allowlist_is_warned_about(
    test_group: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(selection.ENV_PLUGINS, "cpu,extra")
    selection.refresh()
    with pytest.warns(selection.PluginLoadWarning) as record:
        plugins = selection.discover()
    assert str(record[0].message) == (
        "DIFFUSION_KV_PLUGINS limits platforms only; 'extra' name backend entry points (limit those "
        "with DIFFUSION_KV_BACKEND_PLUGINS, or leave them out with DIFFUSION_KV_BLOCKED_BACKENDS)"
    )
    assert plugins.not_installed == ("extra",) and plugins.misplaced == ("extra",)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"allowlist": "cpu"}, "a platform allowlist must be an iterable of entry-point names; got 'cpu'"),
        ({"backend_allowlist": ["extra", ""]}, "a backend allowlist must hold non-empty entry-point names"),
        ({"blocked_backends": [3]}, "a backend block list must hold non-empty entry-point names; got [3]"),
    ],
)
def test_bad_plugin_lists_are_refused(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValidationError) as info:
        selection.discover(**kwargs)  # type: ignore[arg-type]
    assert message in str(info.value)
