"""Where V4.1's Engram tables live (``engram_placement``).

``"host"`` (the default): host memory that the device's ops read in place (``Backend.host_resident``; on CUDA the
table is pinned and read through UVA, captured decode graphs included).  The released tables are ~189 GiB of FP8
and fit no GPU, while a step reads ~6 KiB of them a token a layer.  ``"device"``: device memory, when they fit.
A lookup reads the same bits either way, so outputs are the same bit for bit.  Under expert parallelism a rank
holds its row shard (:mod:`.engram_shard`) wherever the tables live.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from deepinfer.models.weight_reader import Stored
from deepinfer.quant import QuantizedTensor

PLACEMENTS = ("host", "device")
#: ``host_resident(host tensor, device) -> the tensor the device's ops read`` (``Backend.host_resident``).
HostResident = Callable[[torch.Tensor, torch.device], torch.Tensor]
#: The checkpoint name of an Engram table.
TABLE = "engram.embed.weight"


def check_placement(placement: object) -> str:
    """``placement`` if it is one of :data:`PLACEMENTS`, else a ``ValueError`` naming ``engram_placement``."""
    if placement not in PLACEMENTS:
        raise ValueError(f"engram_placement must be one of {list(PLACEMENTS)} (where V4.1's Engram tables live: "
                         f"host memory the device reads in place, or device memory), got {placement!r}")
    return str(placement)


def table_device(placement: str, device: torch.device) -> torch.device:
    """Where the loader reads tables into: the host for ``"host"`` (then :func:`place_tables`), else ``device``."""
    return torch.device("cpu") if check_placement(placement) == "host" else device


def place_tables(tensors: dict[str, Stored], host_resident: HostResident, device: torch.device) -> int:
    """Hand the Engram tables of ``tensors`` (in host memory; an FP8 table's scales too) to ``host_resident``, in
    place; returns their bytes."""
    held = 0
    for name, table in tensors.items():
        if not name.endswith(TABLE):
            continue
        if isinstance(table, QuantizedTensor):
            tensors[name] = QuantizedTensor(table.format, host_resident(table.data, device),
                                            host_resident(table.scale, device), table.shape, table.block)
            held += table.nbytes()
        else:
            tensors[name] = host_resident(table, device)
            held += table.nbytes
    return held
