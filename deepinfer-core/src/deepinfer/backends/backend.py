"""What a backend is: a name, a torch device type, an availability check, an op table, device services."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

logger = logging.getLogger(__name__)


class Backend:
    """Base class for backends.  Subclasses override what their hardware does differently.

    The engine never branches on the backend's name; it calls these methods.  Ops not returned by
    :meth:`load_ops` fall back to core's reference implementation (see :mod:`deepinfer.ops`).
    """

    #: Name users put in ``DEEPINFER_ACCELERATOR``; equals the entry point's name.
    name: str = ""
    #: torch device type tensors live on (``"cpu"``, ``"cuda"``, ``"npu"``, ...).
    device_type: str = "cpu"
    #: Rank when ``DEEPINFER_ACCELERATOR`` is unset: highest usable wins; ``None`` = only by name.
    auto_priority: int | None = None
    #: torch.distributed backend for the communicator factory.
    dist_backend: str = "gloo"

    # --- availability -------------------------------------------------------------------------
    def unavailable_reason(self) -> str | None:
        """``None`` when usable here, else one sentence saying why not (e.g. "no CUDA device")."""
        return None

    # --- ops ----------------------------------------------------------------------------------
    @property
    def batch_invariant_ops(self) -> tuple[str, ...]:
        """Overridden ops that keep a row's result independent of the batch (proven per op by
        ``deepinfer.testing.check_batch_invariance``); under ``DEEPINFER_BATCH_INVARIANT=1`` other overrides of
        batched ops give way to core's batch-invariant references.  Read when the table is built, after
        :meth:`load_ops`; a backend may set it as a class attribute (a tuple) instead."""
        return ()

    def load_ops(self) -> Mapping[str, Callable[..., Any]]:
        """Return overrides of reference ops by op name.  Called once, after the availability check.

        Each override takes exactly its reference's parameters (names, kinds, defaults; see
        :mod:`deepinfer.ops.signature`): building the op table fails otherwise, naming the op and both signatures.
        """
        return {}

    def op_coverage(self) -> Mapping[str, Callable[..., bool]]:
        """``{op name: covers}`` for overrides that handle only some inputs (a power-of-two stream count, ...).

        ``covers`` takes the op's arguments (the reference's signature) and returns whether the override handles
        them; calls it refuses run core's reference, so a kernel never raises for a shape it does not support.
        It runs before every call of its op: read shapes, dtypes and plain arguments only (no device sync, no
        tensor math), and never the number of rows (under ``DEEPINFER_BATCH_INVARIANT=1`` a row's bits must not
        depend on the batch).  Called once, after :meth:`load_ops`; ops not listed are covered in full.
        """
        return {}

    # --- device services ----------------------------------------------------------------------
    def configure_host(self) -> str:
        """Set up this process's host side for the backend, once, when it is selected (e.g. the CPU backend sizes
        torch's thread pool); return what was done for the start-up log line ('' if nothing)."""
        return ""

    def device(self, index: int = 0) -> torch.device:
        """The torch device for local device ``index``."""
        return torch.device(self.device_type, index) if self.device_type != "cpu" else torch.device("cpu")

    def memory_info(self, device: torch.device) -> tuple[int, int]:
        """(free, total) bytes of memory for tensors on ``device``."""
        raise NotImplementedError(f"backend {self.name!r} does not report memory")

    def synchronize(self, device: torch.device) -> None:
        """Block until all queued work on ``device`` has finished."""

    def host_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A host tensor the device can copy from without blocking the host (``dst.copy_(buf, non_blocking=True)``);
        the caller refills it only after the device has passed the previous copy.  Default: plain memory."""
        return torch.empty(numel, dtype=dtype)

    def to_host_async(self, t: torch.Tensor) -> Callable[[], torch.Tensor]:
        """Start copying device tensor ``t`` to the host and return a function that waits for that copy alone
        (not for work queued after it) and returns the host tensor.  Default: copy now."""
        host = t.cpu()
        return lambda: host

    def host_resident(self, t: torch.Tensor, device: torch.device) -> torch.Tensor:
        """Host tensor ``t`` as a tensor on ``device`` that ops read in place, without a copy in device memory where
        the device can read host memory: a table too large for the device (V4.1's Engram tables) whose few rows a
        step reads.  ``t`` is handed over (contiguous; the backend may pin it where it is); its bits stay as they
        are, so ops on the result give the results they give on a device copy.  Default: ``t`` itself on the
        host; on another device a copy in device memory (this device cannot read host memory; logged)."""
        placed = t.to(device)
        if placed is not t:
            logger.info("backend %r cannot read host memory from %s: a %.1f MiB table is copied to device memory",
                        self.name, device, t.nbytes / 2**20)
        return placed

    def to_device(self, t: torch.Tensor, device: torch.device) -> torch.Tensor:
        """``t`` (a host tensor: a step's token ids, positions, row indices) on ``device``, without blocking the
        host where the device allows it.  The copy may still be in flight when this returns: the caller must not
        mutate ``t`` until the device's current stream has passed it.  Default: ``t.to(device)``."""
        return t.to(device)

    @contextlib.contextmanager
    def graph_capture(self, device: torch.device) -> Iterator[Callable[[Callable[[], Any]], Callable[[], Any]]]:
        """Yield ``capture(fn) -> replay``; ``replay()`` re-runs ``fn``'s work on the same buffers.

        The default captures nothing and replays eagerly, which is exact on any device.
        """
        yield lambda fn: fn

    def manual_seed(self, seed: int) -> None:
        """Seed every generator of this device."""
        torch.manual_seed(seed)

    def init_communicator(self, rank: int, world_size: int, init_method: str, timeout_s: float = 300.0,
                          device: torch.device | None = None) -> None:
        """Create the default torch.distributed process group (``dist_backend``: gloo here, NCCL on CUDA, HCCL on
        Ascend) for collectives between ranks.  A collective waits at most ``timeout_s`` for the other ranks;
        ``device``: this rank's device (bound to the group where the device has an index)."""
        import datetime

        import torch.distributed as dist

        if dist.is_initialized():
            return
        if device is not None and device.index is not None:  # collectives and kernels use the current device
            torch.accelerator.set_device_index(device.index)
        dist.init_process_group(self.dist_backend, init_method=init_method, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s),
                                device_id=device if device is not None and device.index is not None else None)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} device_type={self.device_type!r}>"
