"""The CPU reference backend: core's plain-PyTorch ops, registered like any third-party plugin."""

from __future__ import annotations

import os

import torch

from deepinfer.backends.backend import Backend
from deepinfer.backends.hookspecs import hookimpl
from deepinfer.host_threads import configure_host_threads


def _available_host_memory() -> int:
    """MemAvailable from /proc/meminfo where the OS has it, else free physical pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class CpuBackend(Backend):
    """Runs everything with core's reference ops on the host.  Always usable."""

    name = "cpu"
    device_type = "cpu"
    auto_priority = 0
    dist_backend = "gloo"

    def configure_host(self) -> str:
        """Every op runs on host threads here: size the pool by the usable cores, waiting passively."""
        return configure_host_threads()

    def memory_info(self, device: torch.device) -> tuple[int, int]:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return _available_host_memory(), total


@hookimpl
def deepinfer_backend() -> Backend:
    return CpuBackend()
