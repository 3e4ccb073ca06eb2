"""Reading DeepSeek-V4-family checkpoint tensors by their released names: a tensor's name as stored, its
quantized form (``X.weight`` + ``X.scale``: FP8 e4m3 with block scales, or MXFP4, e2m1 packed in int8/uint8 with
one e8m0 scale per 32 columns), its shape and dtype checked from the headers, then loaded and its values checked.
Both models read their checkpoints through :class:`WeightReader` (V4.1's subclass adds its formats); each model's
``weights.py`` says which tensors there are.

A ``model.`` prefix is accepted, and so are the few top-level names transformers writes differently
(``embed_tokens.weight``, ``hc_head.hc_fn``, ...).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable

import torch

from deepinfer.models.checkpoint import CheckpointError, SafetensorsCheckpoint
from deepinfer.models.tensor_checks import (
    FLOAT_DTYPES,
    FP4_DTYPES,
    FP8_DTYPES,
    FP8_SCALE_DTYPES,
    INT_DTYPES,
    MXFP4_SCALE_DTYPES,
    check_finite,
    check_ids,
    dtype_problem,
)
from deepinfer.ops.quant import scale_values
from deepinfer.quant import FP8_BLOCK, MXFP4, QuantizedTensor

#: A tensor as the model receives it: dense, or quantized as stored.
Stored = torch.Tensor | QuantizedTensor
#: The FP8 block when a checkpoint's config names none.
DEFAULT_BLOCK = (128, 128)

_ALIASES = {
    "embed_tokens.weight": "embed.weight",
    "lm_head.weight": "head.weight",
    "hc_head.hc_fn": "hc_head_fn",
    "hc_head.hc_base": "hc_head_base",
    "hc_head.hc_scale": "hc_head_scale",
}
#: Kept in fp32 whatever the model dtype (mHC, sinks, position biases, router bias, norms), as the reference does.
_FP32 = re.compile(r"(^|\.)(hc_\w+|attn_sink|ape|gate\.bias|\w*norm\.weight)$")


def canonical_name(name: str) -> str:
    """The released checkpoint's name for a tensor name as found on disk."""
    name = name.removeprefix("model.")
    return _ALIASES.get(name, name)


def keeps_fp32(name: str) -> bool:
    return _FP32.search(name) is not None


def _mismatch(name: str, expected: tuple[int, ...], actual: tuple[int, ...]) -> str:
    return f"{name}: expected shape {tuple(expected)}, checkpoint has {tuple(actual)}"


def is_id_table(name: str) -> bool:
    """Hash-routing tables hold expert ids (integers); every other tensor holds real numbers."""
    return name.endswith(".tid2eid")


class WeightReader:
    """Pairs ``X.weight`` with ``X.scale``, checks shapes and dtypes against the expected dense shapes, loads and
    converts tensors, checking their values (finite; expert ids below ``n_routed_experts``) as they arrive.
    ``block``: the FP8 block of every FP8 weight (V4's config gives one; V4.1 overrides :meth:`block_of`)."""

    #: A table is read (:meth:`read_rows`) this many bytes at a time: the largest transient its load makes.
    CHUNK_BYTES = 64 << 20

    def __init__(self, ckpt: SafetensorsCheckpoint, dtype: torch.dtype, device: torch.device, n_routed_experts: int,
                 block: tuple[int, int] = DEFAULT_BLOCK):
        self.ckpt, self.dtype, self.device = ckpt, dtype, device
        self.n_routed_experts, self.block = n_routed_experts, block
        #: ``dense(q)``: a quantized tensor in the compute dtype, for :meth:`load_kept`; None: keep them as stored.
        self.dense: Callable[[QuantizedTensor], torch.Tensor] | None = None
        self.on_disk: dict[str, str] = {}
        for raw in ckpt.names():
            name = self.canonical(raw)
            if name in self.on_disk:
                raise CheckpointError(f"{name}: stored twice, as {self.on_disk[name]!r} and {raw!r}")
            self.on_disk[name] = raw

    def where(self, name: str, full: bool = False) -> str:
        """``<file>: <name>`` for messages (the shard's name, or its whole path when ``full``)."""
        raw = self.on_disk[name]
        path = self.ckpt.file_of(raw)
        stored = f" (stored as {raw!r})" if full and raw != name else ""
        return f"{path if full else path.name}: {name}{stored}"

    def canonical(self, raw: str) -> str:
        """The model's name for a tensor stored as ``raw`` (a model's reader may accept more spellings)."""
        return canonical_name(raw)

    def quant_format(self, weight: str) -> str | None:
        """``weight``'s quantized format: FP8 or MXFP4 data with a ``.scale`` beside it; None: a float weight
        (:meth:`dtype_problems` reports a ``.scale`` beside one)."""
        scale = weight.removesuffix(".weight") + ".scale"
        if not weight.endswith(".weight") or scale not in self.on_disk or weight not in self.on_disk:
            return None
        dtype = self.ckpt.dtype_name(self.on_disk[weight])
        return FP8_BLOCK if dtype in FP8_DTYPES else MXFP4 if dtype in FP4_DTYPES else None

    def ignores_scale(self, weight: str) -> bool:
        """Whether a float ``weight`` may carry a ``.scale`` that is not read (V4.1's float Engram tables)."""
        return False

    def dtype_problems(self, name: str) -> list[str]:
        """The stored dtype against the tensor's role: float weight, id table, quantized data and scale."""
        found = self.ckpt.dtype_name(self.on_disk[name])
        fmt = self.quant_format(name)
        scale = name.removesuffix(".weight") + ".scale"
        if fmt is None and name.endswith(".weight") and scale in self.on_disk and not self.ignores_scale(name):
            problem: str | None = (f"has a .scale beside it but dtype {found}: a scale belongs to FP8 e4m3 "
                                   f"({'/'.join(FP8_DTYPES)}) or packed FP4 ({'/'.join(FP4_DTYPES)}) data")
        elif is_id_table(name):
            problem = dtype_problem(found, INT_DTYPES, "expert ids")
        elif fmt is None and found in FP8_DTYPES:
            problem = f"expected dtype {'/'.join(FLOAT_DTYPES)}, found {found} without a .scale beside it"
        elif fmt is None:
            problem = dtype_problem(found, FLOAT_DTYPES, "a floating-point tensor")
        else:
            allowed = self.scale_dtypes(name, fmt)
            problem = dtype_problem(self.ckpt.dtype_name(self.on_disk[scale]), allowed, f"{fmt} scales")
            return [] if problem is None else [f"{self.where(scale)}: {problem}"]
        return [] if problem is None else [f"{self.where(name)}: {problem}"]

    def scale_dtypes(self, name: str, fmt: str) -> tuple[str, ...]:
        """The dtypes weight ``name``'s scales may have in format ``fmt``."""
        return FP8_SCALE_DTYPES if fmt == FP8_BLOCK else MXFP4_SCALE_DTYPES

    def block_of(self, name: str, shape: tuple[int, ...]) -> tuple[int, int]:
        """The FP8 block of weight ``name``: :attr:`block` (V4 uses one block size throughout)."""
        return self.block

    def fp8_blocks(self, name: str) -> tuple[tuple[int, int], ...]:
        """The FP8 blocks weight ``name``'s role may use (its scale grid must be one of theirs)."""
        return (self.block,)

    def layout_problems(self, expected: dict[str, tuple[int, ...]], ignored: Callable[[str], bool]) -> list[str]:
        """Every problem of the checkpoint against the model's ``expected`` tensors (dense shapes), from the
        headers alone: a missing tensor, an unexpected one (not ``ignored``), a ``.scale`` with no weight of the
        model beside it, and each tensor's :meth:`check`."""
        problems = [f"{n}: missing (expected shape {s})" for n, s in expected.items() if n not in self.on_disk]
        for name in sorted(set(self.on_disk) - set(expected)):
            weight = name.removesuffix(".scale") + ".weight"
            if ignored(name) or (name.endswith(".scale") and weight in expected and weight in self.on_disk):
                continue  # (a scale is checked with its weight)
            shape = self.ckpt.shape(self.on_disk[name])
            what = (f"a .scale with no weight {weight!r} of this model beside it" if name.endswith(".scale")
                    else "unexpected tensor")
            problems.append(f"{self.where(name)}: {what} of shape {shape}")
        for name, shape in expected.items():
            if name in self.on_disk:
                problems += self.check(name, shape)
        return problems

    def check(self, name: str, shape: tuple[int, ...]) -> list[str]:
        """Problems with tensor ``name`` (and its scale) against its dense ``shape`` and its role's layout."""
        problems = self.dtype_problems(name)
        actual = self.ckpt.shape(self.on_disk[name])
        fmt = self.quant_format(name)
        if fmt is None:
            return problems + ([] if actual == shape else [_mismatch(self.where(name), shape, actual)])
        if len(shape) != 2:
            return [f"{self.where(name)}: only 2-D weights can be quantized, expected dense shape {shape}"]
        scale = self.ckpt.shape(self.on_disk[name.removesuffix(".weight") + ".scale"])
        layout = _fp8_layout if fmt == FP8_BLOCK else _mxfp4_layout
        problem = layout(name, shape, actual, scale, self)
        return problems + ([f"{self.where(name)}: {problem}"] if problem else [])

    def load(self, name: str, shape: tuple[int, ...] | None, rows: slice | None = None,
             device: torch.device | None = None) -> Stored:
        """``rows``: only these rows are read (a table whose scales are per row: an expert-parallel rank's shard,
        or all of it), :attr:`CHUNK_BYTES` at a time from the memory-mapped file, their values checked per chunk:
        no transient the size of the table.  ``device``: where the tensor goes (default: the reader's device)."""
        fmt = self.quant_format(name)
        device = self.device if device is None else device
        if fmt is not None:
            return self._load_quantized(name, fmt, shape, rows, device)
        if rows is not None and not is_id_table(name):
            where = self.where(name, full=True)
            dtype = torch.float32 if keeps_fp32(name) else self.dtype
            return self.read_rows(name, rows, device, dtype, lambda value, read: check_finite(where, value, read))
        stored = self.ckpt.get(self.on_disk[name], rows).to(device)
        if is_id_table(name):
            ids = stored.long()
            check_ids(self.where(name, full=True), ids, self.n_routed_experts, "n_routed_experts")
            return ids
        tensor = stored.to(torch.float32 if keeps_fp32(name) else self.dtype)
        check_finite(self.where(name, full=True), tensor, stored)
        return tensor

    def _load_quantized(self, name: str, fmt: str, shape: tuple[int, ...] | None, rows: slice | None,
                        device: torch.device) -> QuantizedTensor:
        scale_name = name.removesuffix(".weight") + ".scale"
        dims = self.ckpt.shape(self.on_disk[name])
        logical = shape or (dims[0], dims[1] * (2 if fmt == MXFP4 else 1))
        block = self.block_of(name, tuple(logical)) if fmt == FP8_BLOCK else (1, 32)  # the whole tensor's grid
        where = self.where(scale_name, full=True)

        def check(scale: torch.Tensor, _: torch.Tensor) -> None:
            check_finite(where, scale_values(scale))

        if rows is None:
            stored = self.ckpt.get(self.on_disk[name]).to(device)
            scale = self.ckpt.get(self.on_disk[scale_name]).to(device)
            check(scale, scale)
            return QuantizedTensor(fmt, stored, scale, tuple(logical), block)
        if block[0] != 1:
            raise CheckpointError(f"{self.where(name)}: a row shard of a weight with {block} blocks")
        stored = self.read_rows(name, rows, device)
        scale = self.read_rows(scale_name, rows, device, check=check)
        return QuantizedTensor(fmt, stored, scale, (stored.shape[0], *logical[1:]), block)

    def read_rows(self, name: str, rows: slice, device: torch.device, dtype: torch.dtype | None = None,
                  check: Callable[[torch.Tensor, torch.Tensor], None] | None = None) -> torch.Tensor:
        """Rows ``rows`` of tensor ``name`` on ``device``, in ``dtype`` (None: as stored), read from the
        memory-mapped file :attr:`CHUNK_BYTES` at a time; ``check(chunk in dtype, chunk as read)`` sees each chunk
        on the host before it is copied."""
        raw = self.on_disk[name]
        dims = self.ckpt.shape(raw)
        start, stop, _ = rows.indices(dims[0])
        probe = self.ckpt.get(raw, slice(start, start))  # no rows: the stored dtype
        out = torch.empty((max(0, stop - start), *dims[1:]), dtype=dtype or probe.dtype, device=device)
        step = max(1, self.CHUNK_BYTES // max(1, math.prod(dims[1:]) * probe.element_size()))
        for first in range(start, stop, step):
            read = self.ckpt.get(raw, slice(first, min(first + step, stop)))
            value = read.to(out.dtype)
            if check is not None:
                check(value, read)
            part = out[first - start : first - start + read.shape[0]]
            if value.dtype == read.dtype:  # as stored: bytes (every device copies them, whatever the dtype)
                part, value = part.view(torch.uint8), value.view(torch.uint8)
            part.copy_(value)
        return out

    def load_kept(self, name: str, shape: tuple[int, ...] | None, rows: slice | None = None,
                  device: torch.device | None = None) -> Stored:
        """:meth:`load`, then, when :attr:`dense` is set (the model keeps weights in the compute dtype), a
        quantized tensor dequantized at once: its stored form is dropped as soon as it is read, never held beside
        the dense one (except those the model reads as stored either way: :meth:`stays_stored`)."""
        tensor = self.load(name, shape, rows, device)
        if self.dense is None or not isinstance(tensor, QuantizedTensor) or self.stays_stored(name):
            return tensor
        return self.dense(tensor)

    def stays_stored(self, name: str) -> bool:
        """Whether the model reads quantized tensor ``name`` as stored in ``dequantize`` mode too."""
        return False

def role_of(name: str) -> str:
    """What a quantized weight is, for messages: a routed expert's, an Engram table, or a dense projection."""
    if ".ffn.experts." in name:
        return "routed expert"
    return "Engram table" if name.endswith("engram.embed.weight") else "dense projection"


def _grid(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    return -(-shape[0] // block[0]), -(-shape[1] // block[1])


def _fp8_layout(name: str, shape: tuple[int, ...], data: tuple[int, ...], scale: tuple[int, ...],
                reader: WeightReader) -> str | None:
    """FP8 e4m3 data of the dense shape, one scale per block of a block size the role allows."""
    blocks = reader.fp8_blocks(name)
    if data == shape and any(scale == _grid(shape, b) for b in blocks):
        return None
    needs = " or ".join(f"{_grid(shape, b)} ({b[0]}x{b[1]} blocks)" for b in blocks)
    return (f"FP8 {role_of(name)} of dense shape {shape} stored as data {data} with scales {scale}; the role "
            f"needs data {shape} and scales {needs}")


def _mxfp4_layout(name: str, shape: tuple[int, ...], data: tuple[int, ...], scale: tuple[int, ...],
                  reader: WeightReader) -> str | None:
    """Packed e2m1 (two a byte) [rows, K/2] with one e8m0 scale per 32 elements [rows, K/32]: routed experts only
    (16-element scales, NVFP4's block, must not pass as MXFP4)."""
    rows, cols = shape
    if role_of(name) != "routed expert":
        return (f"packed FP4 (MXFP4) data {data} with scales {scale}: the {role_of(name)} role is read as FP8 or "
                "float, MXFP4 only for routed experts")
    if cols % 32 == 0 and data == (rows, cols // 2) and scale == (rows, cols // 32):
        return None
    return (f"MXFP4 routed expert of dense shape {shape} stored as data {data} with scales {scale}; the role needs "
            f"data {(rows, cols // 2)} (two e2m1 a byte) and scales {(rows, cols // 32)} (one per 32 elements)")
