"""Backend discovery and selection through the ``deepinfer.backends`` entry points."""

from __future__ import annotations

import importlib.util
import logging
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from deepinfer.backends import Backend, BackendError, discover, select_backend
from deepinfer.backends.cpu import CpuBackend

HAS_CUDA = torch.cuda.is_available()
HAS_TORCH_NPU = importlib.util.find_spec("torch_npu") is not None


def _installed_names() -> set[str]:
    return {ib.name for ib in discover()}


def test_in_repo_backends_are_discovered_through_entry_points():
    # build.sh --dev installs all three distributions; each registers by entry point, core's cpu included.
    found = {ib.name: ib for ib in discover()}
    assert {"cpu", "nvidia", "ascend"} <= set(found)
    assert found["cpu"].distribution.startswith("deepinfer-core")
    assert found["nvidia"].distribution.startswith("deepinfer-backend-cuda")
    assert found["ascend"].distribution.startswith("deepinfer-backend-ascend")
    assert isinstance(found["cpu"].backend, CpuBackend)


def test_unknown_name_lists_installed_backends(monkeypatch):
    monkeypatch.setenv("DEEPINFER_ACCELERATOR", "bogus")
    with pytest.raises(BackendError) as err:
        select_backend()
    msg = str(err.value)
    assert "'bogus'" in msg and "names no installed backend" in msg
    for name in _installed_names():
        assert name in msg
    assert "cpu [deepinfer-core" in msg and "(usable)" in msg


@pytest.mark.skipif(HAS_CUDA, reason="a CUDA device is present, so nvidia is usable")
def test_nvidia_without_gpu_says_why(monkeypatch):
    monkeypatch.setenv("DEEPINFER_ACCELERATOR", "nvidia")
    with pytest.raises(BackendError, match=r"backend 'nvidia' .* unusable here: .*(without CUDA|no CUDA device)"):
        select_backend()


@pytest.mark.skipif(HAS_TORCH_NPU, reason="torch_npu is installed")
def test_ascend_without_torch_npu_says_why(monkeypatch):
    monkeypatch.setenv("DEEPINFER_ACCELERATOR", "ascend")
    with pytest.raises(BackendError, match="torch_npu is not importable"):
        select_backend()


@pytest.mark.skipif(HAS_CUDA or HAS_TORCH_NPU, reason="an accelerator backend would win")
def test_unset_picks_best_usable_and_logs_why(monkeypatch, caplog):
    monkeypatch.delenv("DEEPINFER_ACCELERATOR", raising=False)
    with caplog.at_level(logging.INFO, logger="deepinfer.backends.registry"):
        backend = select_backend()
    assert backend.name == "cpu"
    assert "DEEPINFER_ACCELERATOR is unset; using backend 'cpu'" in caplog.text
    assert "nvidia" in caplog.text  # the log says why the others lost


def test_explicit_cpu(monkeypatch):
    monkeypatch.setenv("DEEPINFER_ACCELERATOR", "cpu")
    backend = select_backend()
    assert backend.name == "cpu" and backend.device() == torch.device("cpu")
    free, total = backend.memory_info(backend.device())
    assert 0 < free <= total


def _fake_distribution(root: Path, dist: str, entry_points: str) -> None:
    info = root / f"{dist.replace('-', '_')}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[deepinfer.backends]\n{entry_points}\n")


def test_two_distributions_claiming_one_name_fail_clearly(tmp_path, monkeypatch):
    _fake_distribution(tmp_path, "rogue-backend", "cpu = deepinfer.backends.cpu")
    monkeypatch.syspath_prepend(str(tmp_path))
    claimed = r"backend name 'cpu' is claimed by more than one distribution .*rogue-backend"
    with pytest.raises(BackendError, match=claimed):
        select_backend("cpu")


def test_broken_plugin_is_reported_and_others_still_work(tmp_path, monkeypatch):
    _fake_distribution(tmp_path, "broken-backend", "broken = no_such_module_xyz.plugin")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert select_backend("cpu").name == "cpu"
    with pytest.raises(BackendError, match=r"'broken' .* unusable here: plugin failed to load: ModuleNotFoundError"):
        select_backend("broken")


def test_plugin_returning_wrong_name_is_rejected(tmp_path, monkeypatch):
    # The entry point says 'alias' but the hook returns the cpu backend, whose name is 'cpu'.
    _fake_distribution(tmp_path, "alias-backend", "alias = deepinfer.backends.cpu")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(BackendError, match="returned a backend named 'cpu'"):
        select_backend("alias")


def test_importing_core_loads_no_device_library():
    code = textwrap.dedent(
        """
        import sys, torch
        before = set(sys.modules)
        import deepinfer, deepinfer.backends, deepinfer.ops, deepinfer.testing, deepinfer.envs
        from deepinfer.backends import discover
        discover()  # loading every plugin must stay cheap too
        new = {m.split('.')[0] for m in set(sys.modules) - before}
        print(sorted(new & {'triton', 'tilelang', 'torch_npu', 'cuda', 'deepinfer_cuda_kernels'}))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_base_backend_defaults_are_exact_services():
    backend = CpuBackend()
    calls = []
    with backend.graph_capture(backend.device()) as capture:
        replay = capture(lambda: calls.append(1))
    replay()
    replay()
    assert calls == [1, 1]  # eager replay re-runs the captured work each time
    assert Backend().unavailable_reason() is None
