"""Host threads: the pool is sized by the cores this process may use, and idle OpenMP threads wait passively
unless the user chose otherwise (deepinfer.host_threads)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from deepinfer.host_threads import cgroup_cpu_limit, usable_cores


def _probe(code: str, **env: str) -> str:
    """Run ``code`` in a fresh interpreter with ``env`` (OMP_* of this process removed) and return its stdout."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("OMP_")}
    out = subprocess.run([sys.executable, "-c", code], env={**base, **env}, capture_output=True, text=True,
                         timeout=120, check=True)
    return out.stdout.strip()


def test_cgroup_v2_quota(tmp_path: Path) -> None:
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert cgroup_cpu_limit(tmp_path) == 1.5
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_limit(tmp_path) is None


def test_cgroup_v1_quota(tmp_path: Path) -> None:
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("300000\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_cpu_limit(tmp_path) == 3.0
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert cgroup_cpu_limit(tmp_path) is None


def test_no_cgroup_files(tmp_path: Path) -> None:
    assert cgroup_cpu_limit(tmp_path) is None


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="no CPU affinity on this OS")
def test_usable_cores_follow_affinity() -> None:
    cpus = sorted(os.sched_getaffinity(0))
    code = f"import os; os.sched_setaffinity(0, {{{cpus[0]}}}); from deepinfer.host_threads import usable_cores; " \
           "print(usable_cores())"
    assert _probe(code) == "1"
    assert 1 <= usable_cores() <= len(cpus)


def test_importing_deepinfer_first_asks_for_passive_waiting() -> None:
    assert _probe("import deepinfer, os; print(os.environ.get('OMP_WAIT_POLICY'))") == "PASSIVE"


def test_user_choices_win() -> None:
    code = ("import deepinfer, os; from deepinfer.host_threads import configure_host_threads; "
            "print(os.environ['OMP_WAIT_POLICY']); print(configure_host_threads())")
    policy, note = _probe(code, OMP_WAIT_POLICY="ACTIVE", OMP_NUM_THREADS="1").splitlines()
    assert policy == "ACTIVE"
    assert note == "1 threads (OMP_NUM_THREADS), OMP_WAIT_POLICY=ACTIVE"


def test_torch_imported_first_is_reported() -> None:
    code = ("import torch, deepinfer, os; from deepinfer.host_threads import configure_host_threads; "
            "print(os.environ.get('OMP_WAIT_POLICY')); print(configure_host_threads())")
    policy, note = _probe(code).splitlines()
    assert policy == "None"
    assert "set OMP_WAIT_POLICY=PASSIVE" in note


def test_cpu_backend_sizes_the_pool() -> None:
    code = ("import deepinfer, torch; from deepinfer.host_threads import usable_cores; "
            "from deepinfer.backends.cpu import CpuBackend; note = CpuBackend().configure_host(); "
            "print(torch.get_num_threads() == usable_cores()); print(note)")
    same, note = _probe(code).splitlines()
    assert same == "True"
    assert note.endswith("passive OpenMP waits")


def test_ranks_share_the_cores() -> None:
    code = ("import deepinfer, os; from deepinfer.host_threads import share_host_threads, usable_cores; "
            "n = share_host_threads(2); "
            "print(n == max(1, usable_cores() // 2), os.environ['OMP_NUM_THREADS'] == str(n))")
    assert _probe(code) == "True True"
