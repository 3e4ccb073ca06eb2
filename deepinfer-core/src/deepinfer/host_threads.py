"""Host threads for ops that run on the CPU: how many, and how idle ones wait.

torch's OpenMP pool defaults to every core the machine has and to spinning between parallel regions.  On a
machine other processes share (CI runners, notebooks beside other work, a container given 2 of 64 cores) the
spinning workers take the cores the working ones need: the embedded model's example ran 25x slower on a loaded
2-core machine.  So DeepInfer asks for passive waiting (``OMP_WAIT_POLICY=PASSIVE``) before torch loads OpenMP,
and sizes the pool by the cores this process may use (its CPU affinity and its cgroup's quota), unless the user
set either.  This module imports nothing heavy: :mod:`deepinfer` calls :func:`prefer_passive_waiting` at import.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path


def prefer_passive_waiting() -> None:
    """Ask OpenMP for passive waiting where the user has not chosen and OpenMP is not loaded yet (it reads the
    variable once, when torch loads it)."""
    if "OMP_WAIT_POLICY" not in os.environ and "torch" not in sys.modules:
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"


def cgroup_cpu_limit(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """The CPU quota of this process's cgroup in cores (cgroup v2 ``cpu.max``, else v1 ``cpu.cfs_*``), or None."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota_us = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period_us = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return quota_us / period_us if quota_us > 0 and period_us > 0 else None
    except (OSError, ValueError):
        return None


def usable_cores() -> int:
    """Cores this process may run on: its CPU affinity, capped by its cgroup's quota (rounded up), at least 1."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    limit = cgroup_cpu_limit()
    if limit is not None:
        cores = min(cores, max(1, math.ceil(limit)))
    return max(1, cores)


def share_host_threads(ranks: int) -> int:
    """Give each of ``ranks`` processes on this host an equal share of the usable cores (as torchrun's
    ``OMP_NUM_THREADS=1`` default does: ranks that each take every core run many times slower); the share is
    exported as ``OMP_NUM_THREADS`` so that :func:`configure_host_threads` keeps it.  Returns the share."""
    import torch

    n = max(1, usable_cores() // max(1, ranks))
    os.environ["OMP_NUM_THREADS"] = str(n)
    torch.set_num_threads(n)
    return n


def configure_host_threads() -> str:
    """Size torch's intra-op pool to the usable cores (``OMP_NUM_THREADS``, when set, wins); return what was done
    and how idle threads wait, for the start-up log line."""
    import torch

    if "OMP_NUM_THREADS" in os.environ:
        threads = f"{torch.get_num_threads()} threads (OMP_NUM_THREADS)"
    else:
        cores = usable_cores()
        torch.set_num_threads(cores)
        threads = f"{cores} threads (the cores usable by CPU affinity and cgroup quota)"
    policy = os.environ.get("OMP_WAIT_POLICY")
    if policy is None:
        waiting = "spinning OpenMP waits (torch was imported before deepinfer: set OMP_WAIT_POLICY=PASSIVE)"
    else:
        waiting = "passive OpenMP waits" if policy.upper() == "PASSIVE" else f"OMP_WAIT_POLICY={policy}"
    return f"{threads}, {waiting}"
