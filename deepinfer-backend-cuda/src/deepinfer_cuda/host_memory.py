"""Host memory the GPU reads in place (``CudaBackend.host_resident``): a host tensor page-locked where it is
(``cudaHostRegister``, mapped and portable) and a CUDA tensor over its device address (``cudaHostGetDevicePointer``).

Under unified virtual addressing (every 64-bit CUDA platform) a kernel's loads from that address go over PCIe /
NVLink-C2C to host memory: nothing is copied into device memory, the bits are the host tensor's, and a captured
graph replays the same loads (no host synchronisation).  What suits it: a large table a step reads a few rows of
(V4.1's Engram tables: ~6 KiB a token a layer out of ~95 GiB).
"""

from __future__ import annotations

import mmap
import weakref
from typing import Any

import torch

#: cudaHostRegisterPortable | cudaHostRegisterMapped: pinned for every context, mapped into the device's space.
_REGISTER_FLAGS = 0x01 | 0x02
#: A host tensor this large came from its own mmap (glibc maps every allocation over 32 MiB): the pages it spans
#: are its own and are registered where they are.  A smaller one may share a page with another registered range
#: (which CUDA refuses), so it is copied into pages of its own first.
OWN_PAGES_BYTES = 64 << 20


def _runtime() -> Any:
    try:
        from cuda.bindings import runtime  # cuda-python >= 12.6
    except ImportError:  # pragma: no cover - older layout
        from cuda import cudart as runtime
    return runtime


def _check(result: Any, what: str) -> Any:
    """Unpack a cuda-python ``(cudaError_t, *values)`` tuple, raising on error."""
    runtime = _runtime()
    err, *values = result if isinstance(result, tuple) else (result,)
    if err != runtime.cudaError_t.cudaSuccess:
        _, msg = runtime.cudaGetErrorString(err)
        raise RuntimeError(f"{what} failed: {getattr(err, 'name', err)}: "
                           f"{msg.decode() if isinstance(msg, bytes) else msg}")
    return values[0] if values else None


def _unregister(address: int, host: torch.Tensor) -> None:
    """Unpin the pages from ``address`` (``host``'s: kept alive until now by this finaliser's reference)."""
    try:
        _runtime().cudaHostUnregister(address)
    except Exception:  # noqa: BLE001 - at interpreter exit the CUDA context may already be gone
        pass


class _Mapped:
    """The device address of a registered host tensor as a byte array (``__cuda_array_interface__``).  The CUDA
    tensors made over it hold it; when the last goes, its pages (from ``registered``) are unregistered, then the
    host tensor is freed."""

    def __init__(self, host: torch.Tensor, address: int, registered: int):
        self.__cuda_array_interface__ = {"shape": (host.nbytes,), "typestr": "|u1", "data": (address, False),
                                         "strides": None, "version": 3}
        weakref.finalize(self, _unregister, registered, host)


def _pages(t: torch.Tensor) -> tuple[int, int]:
    """(first address, bytes) of the whole pages ``t`` spans: what is registered (its pages are its own)."""
    start = t.data_ptr() - t.data_ptr() % mmap.PAGESIZE
    stop = -(-(t.data_ptr() + t.nbytes) // mmap.PAGESIZE) * mmap.PAGESIZE
    return start, stop - start


def _own_pages(t: torch.Tensor) -> torch.Tensor:
    """``t`` if its memory has pages of its own (a large tensor that is its whole storage), else a copy in an
    anonymous mapping (pages of its own)."""
    if t.nbytes >= OWN_PAGES_BYTES and t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.nbytes:
        return t
    pages = mmap.mmap(-1, t.nbytes)  # the tensor made over it keeps it alive
    copy = torch.frombuffer(pages, dtype=torch.uint8).view(t.dtype).view(t.shape)
    copy.copy_(t)
    return copy


def mapped_view(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` (a contiguous host tensor, handed over) page-locked and seen from ``device``: a CUDA tensor of ``t``'s
    shape and dtype whose storage is host memory.  Raises if torch would not make it a view (a copy in device
    memory is what the caller asked to avoid)."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError(f"host_resident takes a contiguous host tensor, got one on {t.device} "
                         f"(contiguous: {t.is_contiguous()})")
    if t.numel() == 0:
        return torch.empty(t.shape, dtype=t.dtype, device=device)
    host = _own_pages(t)
    runtime = _runtime()
    start, size = _pages(host)
    with torch.cuda.device(device):  # the registration's device is the one torch reads off the address
        _check(runtime.cudaHostRegister(start, size, _REGISTER_FLAGS), "cudaHostRegister")
        try:
            base = int(_check(runtime.cudaHostGetDevicePointer(start, 0), "cudaHostGetDevicePointer"))
        except Exception:
            runtime.cudaHostUnregister(start)
            raise
        address = base + host.data_ptr() - start  # the pages map contiguously
        view = torch.as_tensor(_Mapped(host, address, start), device=device)
    if view.data_ptr() != address:
        raise RuntimeError(f"torch copied a mapped host tensor to {view.device} instead of viewing it in place")
    return view.view(t.dtype).view(t.shape)
