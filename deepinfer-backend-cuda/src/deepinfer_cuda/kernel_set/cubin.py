"""Load a cubin with the CUDA driver API (cuda-python) and launch it on torch's current stream.

The launch follows the manifest entry, not Triton's launcher: explicit parameters packed by their
Triton types, then the hidden trailing pointers as null (the builder refused kernels that need scratch
memory), ``32 * num_warps`` threads, the entry's dynamic shared memory.  A host-side TMA descriptor
(``TensorDescriptor``) is passed as Triton's launcher passes it: the ``CUtensorMap`` encoded with the
entry's ``tensordesc_meta`` (cached: weights keep their address), then its shape and strides.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from deepinfer_cuda.kernel_set.manifest import KernelEntry
from deepinfer_cuda.kernel_set.specialize import tensordesc_rank

_CTYPES: dict[str, type] = {
    "i1": ctypes.c_uint8, "u1": ctypes.c_uint8, "i8": ctypes.c_int8, "u8": ctypes.c_uint8,
    "i16": ctypes.c_int16, "u16": ctypes.c_uint16, "i32": ctypes.c_int32, "u32": ctypes.c_uint32,
    "i64": ctypes.c_int64, "u64": ctypes.c_uint64, "fp32": ctypes.c_float, "fp64": ctypes.c_double,
}
_STATIC_SHARED_LIMIT = 48 * 1024
#: Triton's device TMA element-type enum -> the driver's CUtensorMapDataType (they differ for 8, 9, 10).
_TMA_HOST_DTYPE = {**{i: i for i in range(16)}, 8: 10, 9: 8, 10: 9}
_CU_TENSOR_MAP_L2_PROMOTION_128B = 2
#: The signature type of a TileLang kernel's ``__grid_constant__ CUtensorMap`` param.
TENSORMAP = "tensormap"


def param_ctype(sig_type: str) -> type:
    """The ctypes type one explicit parameter is passed as (pointers as 64-bit addresses)."""
    ty = sig_type.split(":")[0]
    return ctypes.c_uint64 if ty.startswith("*") else _CTYPES[ty]


def _driver() -> Any:
    global _DRIVER
    if _DRIVER is None:
        try:
            from cuda.bindings import driver  # cuda-python >= 12.6
        except ImportError:  # pragma: no cover - older layout
            from cuda import cuda as driver
        _DRIVER = driver
        global _SUCCESS
        _SUCCESS = driver.CUresult.CUDA_SUCCESS
    return _DRIVER


_DRIVER: Any = None
_SUCCESS: Any = None


def _check(result: Any, what: str) -> Any:
    """Unpack a cuda-python ``(CUresult, *values)`` tuple, raising on error."""
    err, *values = result if isinstance(result, tuple) else (result,)
    if err != _SUCCESS:
        _, msg = _driver().cuGetErrorString(err)
        raise RuntimeError(f"{what} failed: {err.name if hasattr(err, 'name') else err}: "
                           f"{msg.decode() if isinstance(msg, bytes) else msg}")
    return values[0] if len(values) == 1 else tuple(values)


class CubinFunction:
    """One loaded cubin on one device, ready to launch."""

    __slots__ = ("entry", "device_index", "_module", "_function", "_plain", "_maps", "_storage", "_params",
                 "_params_addr", "_threads", "_lock", "_pdl")

    def __init__(self, entry: KernelEntry, cubin: bytes, device_index: int):
        driver = _driver()
        self.entry = entry
        self.device_index = device_index
        _check(driver.cuInit(0), "cuInit")
        device = _check(driver.cuDeviceGet(device_index), "cuDeviceGet")
        if int(_check(driver.cuCtxGetCurrent(), "cuCtxGetCurrent")) == 0:
            # torch makes the primary context current lazily; load into that same context.
            ctx = _check(driver.cuDevicePrimaryCtxRetain(device), "cuDevicePrimaryCtxRetain")
            _check(driver.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
        self._module = _check(driver.cuModuleLoadData(cubin), f"cuModuleLoadData({entry.cubin})")
        self._function = _check(driver.cuModuleGetFunction(self._module, entry.entry.encode()),
                                f"cuModuleGetFunction({entry.entry})")
        static = _check(driver.cuFuncGetAttribute(
            driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, self._function), "cuFuncGetAttribute")
        # past 48 KiB of static + dynamic shared memory (a TileLang kernel's barriers are static), opt in
        if entry.shared + static > _STATIC_SHARED_LIMIT:
            attr = driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN
            optin = _check(driver.cuDeviceGetAttribute(attr, device), "cuDeviceGetAttribute")
            if entry.shared > optin - static:
                raise RuntimeError(f"{entry.entry} needs {entry.shared} B of shared memory; the device allows "
                                   f"{optin - static}")
            _check(driver.cuFuncSetAttribute(
                self._function, driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                optin - static), "cuFuncSetAttribute")
        # Parameter storage is allocated once and refilled per launch: cuLaunchKernel copies the values
        # before it returns, and the lock keeps two threads from interleaving their fills.
        self._storage, self._plain, self._maps = param_storage(entry)
        self._params = (ctypes.c_void_p * len(self._storage))(*[ctypes.addressof(v) for v in self._storage])
        self._params_addr = ctypes.addressof(self._params)
        self._threads = 32 * entry.num_warps
        self._lock = threading.Lock()
        self._pdl = _programmatic_config(entry.shared, self._threads) if entry.launch_pdl else None

    def launch(self, grid: Sequence[int], stream: int, args: Mapping[str, Any]) -> None:
        """Launch on ``stream`` (a raw ``cudaStream_t``); ``args`` holds at least the explicit params by name.

        Tensors are passed as their ``data_ptr()``; constexprs in ``args`` are ignored (baked in).
        """
        gx, gy, gz = (tuple(grid) + (1, 1))[:3]
        if gx * gy * gz == 0:
            return
        with self._lock:
            for slot, name in self._plain:
                value = args[name]
                slot.value = value.data_ptr() if isinstance(value, torch.Tensor) else value
            for tensor_map, name in self._maps:
                tensor_map.fill(args[name], args)
            config = self._pdl if PROGRAMMATIC_LAUNCH else None
            if config is not None:
                config.gridDimX, config.gridDimY, config.gridDimZ = gx, gy, gz
                config.hStream = stream
                result = _DRIVER.cuLaunchKernelEx(config, self._function, self._params_addr, 0)
            else:
                result = _DRIVER.cuLaunchKernel(self._function, gx, gy, gz, self._threads, 1, 1, self.entry.shared,
                                                stream, self._params_addr, 0)
        if result[0] != _SUCCESS:
            _check(result, f"{'cuLaunchKernel' if config is None else 'cuLaunchKernelEx'}({self.entry.entry})")


#: Whether kernels built for it (``KernelEntry.launch_pdl``: every Triton kernel, see
#: ``kernels/grid_dependency.py``) launch as programmatic dependents; False launches them as plain kernels (their
#: grid-dependency instructions are then no-ops), for A/B timing.
PROGRAMMATIC_LAUNCH = True


def _programmatic_config(shared: int, threads: int) -> Any:
    """A ``CUlaunchConfig`` with programmatic stream serialization allowed (grid and stream set per launch)."""
    driver = _driver()
    attr = driver.CUlaunchAttribute()
    attr.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    attr.value.programmaticStreamSerializationAllowed = 1
    config = driver.CUlaunchConfig()
    config.blockDimX, config.blockDimY, config.blockDimZ = threads, 1, 1
    config.sharedMemBytes = shared
    config.attrs = [attr]
    config.numAttrs = 1
    return config


def param_storage(entry: KernelEntry) -> tuple[list[Any], list[tuple[Any, str]], list[tuple[Any, str]]]:
    """ctypes storage for every ``.param`` of ``entry`` in order, plus who fills it: ``(storage, name)`` per scalar
    or pointer param, ``(tensor map params, name)`` per TMA descriptor (its 1 + 2 * rank slots); hidden pointers
    stay null."""
    storage: list[Any] = []
    plain: list[tuple[Any, str]] = []
    maps: list[tuple[Any, str]] = []  # _TensorMapParams (Triton) or _RecipeMap (TileLang)
    metas = iter(entry.tensordesc_meta)
    recipes = iter(entry.tensormaps)
    for name, ty in entry.signature:
        rank = tensordesc_rank(ty.split(":")[0])
        if ty == TENSORMAP:  # TileLang: the CUtensorMap alone, encoded from the tensor param ``name``
            maps.append((_RecipeMap(next(recipes)), name))
            storage += maps[-1][0].storage
        elif rank is None:
            plain.append((param_ctype(ty)(), name))
            storage.append(plain[-1][0])
        else:
            maps.append((_TensorMapParams(next(metas), rank), name))
            storage += maps[-1][0].storage
    storage += [ctypes.c_uint64(0) for _ in entry.hidden_params]
    return storage, plain, maps


class _TensorMapParams:
    """The params of one TMA descriptor argument: the ``CUtensorMap`` (128 bytes), its shape (u32) and strides
    (u64), as Triton's launcher passes a ``TensorDescriptor`` whose loads were lowered to TMA."""

    __slots__ = ("meta", "storage", "_map", "_cache")

    def __init__(self, meta: dict[str, Any], rank: int):
        self.meta = meta
        self._map = (ctypes.c_uint8 * 128)()
        self.storage: list[Any] = [self._map] + [ctypes.c_uint32() for _ in range(rank)]
        self.storage += [ctypes.c_uint64() for _ in range(rank)]
        self._cache: dict[tuple[Any, ...], bytes] = {}

    def fill(self, desc: Any, args: Mapping[str, Any]) -> None:
        shape, strides = [int(d) for d in desc.shape], [int(s) for s in desc.strides]
        key = (desc.base.data_ptr(), tuple(shape), tuple(strides), desc.padding)
        encoded = self._cache.get(key)
        if encoded is None:
            encoded = self._cache[key] = encode_tensor_map(desc.base.data_ptr(), shape, strides, desc.padding,
                                                           self.meta)
        ctypes.memmove(self._map, encoded, 128)
        for slot, v in zip(self.storage[1:], shape + strides, strict=False):
            slot.value = v


def encode_tensor_map(address: int, shape: Sequence[int], strides: Sequence[int], padding: str,
                      meta: Mapping[str, Any]) -> bytes:
    """The 128-byte ``CUtensorMap`` Triton's launcher would build (``fill_tma_descriptor``): dims innermost
    first, byte strides of the outer dims, the compiler's box (``block_size``) and swizzle, L2 promotion of 128
    bytes, zero fill out of bounds (NaN for ``padding="nan"``)."""
    driver = _driver()
    elem = int(meta["elem_size"])
    rank = len(shape)
    u64, u32 = driver.cuuint64_t, driver.cuuint32_t
    dims = [u64(int(d)) for d in reversed(shape)]
    byte_strides = [u64(elem * int(s)) for s in reversed(strides[:-1])]
    box = [u32(int(b)) for b in reversed(meta["block_size"])]
    fill = driver.CUtensorMapFloatOOBfill(1 if padding == "nan" else 0)
    tensor_map = _check(driver.cuTensorMapEncodeTiled(
        driver.CUtensorMapDataType(_TMA_HOST_DTYPE[int(meta["elem_type"])]), u32(rank), address, dims, byte_strides,
        box, [u32(1)] * rank, driver.CUtensorMapInterleave(0), driver.CUtensorMapSwizzle(int(meta["swizzle"])),
        driver.CUtensorMapL2promotion(_CU_TENSOR_MAP_L2_PROMOTION_128B), fill), "cuTensorMapEncodeTiled")
    return ctypes.string_at(tensor_map.getPtr(), 128)


class _RecipeMap:
    """A TileLang kernel's ``CUtensorMap`` param: encoded from the live tensor's address with the recipe the builder
    read off TileLang's host code (dims may name a scalar param: a dynamic row count), cached per address and dims."""

    __slots__ = ("recipe", "storage", "_map", "_cache")

    def __init__(self, recipe: dict[str, Any]):
        self.recipe = recipe
        self._map = (ctypes.c_uint8 * 128)()
        self.storage: list[Any] = [self._map]
        self._cache: dict[tuple[int, ...], bytes] = {}

    def fill(self, tensor: torch.Tensor, args: Mapping[str, Any]) -> None:
        r = self.recipe
        dims = [int(args[d]) if isinstance(d, str) else int(d) for d in r["dims"]]
        key = (tensor.data_ptr(), *dims)
        encoded = self._cache.get(key)
        if encoded is None:
            encoded = self._cache[key] = encode_recipe(tensor.data_ptr(), dims, r)
        ctypes.memmove(self._map, encoded, 128)


def encode_recipe(address: int, dims: Sequence[int], recipe: Mapping[str, Any]) -> bytes:
    """``cuTensorMapEncodeTiled`` as TileLang's ``__tvm_tensormap_create_tiled`` calls it: dims innermost first,
    the byte strides of the outer dims, the box, element strides, and the driver's enum values as recorded."""
    driver = _driver()
    u64, u32 = driver.cuuint64_t, driver.cuuint32_t
    rank = len(dims)
    tensor_map = _check(driver.cuTensorMapEncodeTiled(
        driver.CUtensorMapDataType(int(recipe["dtype"])), u32(rank), address, [u64(d) for d in dims],
        [u64(int(s)) for s in recipe["strides"]], [u32(int(b)) for b in recipe["box"]],
        [u32(int(e)) for e in recipe["elem_strides"]], driver.CUtensorMapInterleave(int(recipe["interleave"])),
        driver.CUtensorMapSwizzle(int(recipe["swizzle"])), driver.CUtensorMapL2promotion(int(recipe["l2"])),
        driver.CUtensorMapFloatOOBfill(int(recipe["oob"]))), "cuTensorMapEncodeTiled")
    return ctypes.string_at(tensor_map.getPtr(), 128)
