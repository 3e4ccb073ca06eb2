"""Every architecture-specific choice of the CUDA backend, in one place.

The kernel set is compiled for the architectures in :data:`ARCHS`; a kernel's launch configuration
(warps, pipeline stages, tile sizes) comes from a function here, keyed by architecture, so moving to a
new SM means editing this module only.  Pure Python: importing it loads no CUDA library.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar


@dataclass(slots=True, frozen=True)
class CudaArch:
    """One compilation target: the name cubins are filed under and the capability that runs them."""

    name: str  #: "sm_90a": what ptxas targets (the "a" enables wgmma / tcgen05 instructions)
    capability: tuple[int, int]  #: torch.cuda.get_device_capability() of a GPU that runs it
    triton_arch: int  #: Triton's GPUTarget arch number (capability major * 10 + minor)


SM90A = CudaArch("sm_90a", (9, 0), 90)  # Hopper: H100, H200
SM100A = CudaArch("sm_100a", (10, 0), 100)  # Blackwell: B200, GB200

#: Architectures the kernel set is built for, in preference order.
ARCHS: tuple[CudaArch, ...] = (SM90A, SM100A)

#: Compute capabilities the backend accepts (the plugin's availability check uses this).
SUPPORTED_CAPABILITIES: tuple[tuple[int, int], ...] = tuple(a.capability for a in ARCHS)


def arch_by_name(name: str) -> CudaArch:
    for arch in ARCHS:
        if arch.name == name:
            return arch
    raise ValueError(f"unknown CUDA architecture {name!r}; known: {[a.name for a in ARCHS]}")


def arch_for_capability(capability: tuple[int, int]) -> CudaArch | None:
    """The kernel-set architecture for a GPU of ``capability``, or None when the set has none."""
    for arch in ARCHS:
        if arch.capability == tuple(capability):
            return arch
    return None


@dataclass(slots=True, frozen=True)
class LaunchConfig:
    """Triton compile options plus the tile sizes a kernel's wrapper passes as constexprs."""

    num_warps: int
    num_stages: int = 1
    block_rows: int = 1


def rms_norm_config(arch: CudaArch, dim: int) -> LaunchConfig:
    """RMSNorm over rows of ``dim`` elements: memory-bound, one pass, row held in registers.

    Short rows (per-head norms at 128 / 512) are packed several to a program so each program moves
    ~8-16 KiB; long rows (hidden 4096, mHC's flattened 4 x 4096) get more warps so that each thread
    holds at most ~64 elements.  SM100 has the same register file per SM, so the same shape works;
    it is listed separately to be tuned there.
    """
    block = max(16, 1 << (dim - 1).bit_length())
    if arch.triton_arch in (90, 100):
        if block <= 1024:
            rows = max(1, 4096 // block)
            return LaunchConfig(num_warps=4 if block * rows <= 4096 else 8, block_rows=rows)
        return LaunchConfig(num_warps=min(16, max(4, block // 512)))
    raise ValueError(f"no RMSNorm configuration for {arch.name}")


def rope_config(arch: CudaArch, dim: int) -> LaunchConfig:
    """Partial RoPE over rows of ``dim`` (head_dim 512 or index_head_dim 128): ~4K elements per program."""
    block = max(16, 1 << (dim - 1).bit_length())
    if arch.triton_arch in (90, 100):
        return LaunchConfig(num_warps=4, block_rows=max(1, 4096 // (1 << (max(block, 1) - 1).bit_length())))
    raise ValueError(f"no RoPE configuration for {arch.name}")


def rms_norm_rope_config(arch: CudaArch, dim: int) -> LaunchConfig:
    """RMSNorm + RoPE over rows of ``dim``: rms_norm's tile exactly.  The row's fp32 sum of squares is reduced in
    an order fixed by the tile shape and warps, so the same tile is what makes the fused kernel's bits equal to
    the composed rms_norm and rope kernels' (tune the two together, or not at all)."""
    return rms_norm_config(arch, dim)


def hc_post_config(arch: CudaArch, dim: int) -> tuple[LaunchConfig, int]:
    """mHC post: each program writes all streams of one token for a ``block_d`` slice of the hidden dim.

    Returns (config, block_d).  1024 columns x 4 streams keeps 16 fp32 accumulators per thread at 8 warps.
    """
    if arch.triton_arch in (90, 100):
        block_d = min(1024, max(16, 1 << (dim - 1).bit_length()))
        return LaunchConfig(num_warps=4 if block_d <= 512 else 8), block_d
    raise ValueError(f"no mHC post configuration for {arch.name}")


@dataclass(slots=True, frozen=True)
class HcPreTier:
    """The projection's token tile for calls of up to ``max_tokens`` tokens.  Changing it never changes a token's
    bits as long as every tier's dots lower to the same instruction (see kernels/hc_pre.py): each mix is one chain
    over its slice's columns in order, whatever the tile's other rows."""

    max_tokens: int
    block_t: int  #: tokens per projection program (each slice of fn is read once per block_t tokens)
    config: LaunchConfig


@dataclass(slots=True, frozen=True)
class HcPreTiles:
    """Tiles of mHC pre's two kernels.  The K slices, the term count and every finishing tile are functions of the
    model dims only: a token's partial sums and their reduction order must not depend on the batch."""

    slice: int  #: columns of the flattened streams (n * dim) per projection program
    block_k: int  #: columns per step of a projection program (bf16 terms: each step adds hi, mid, lo in turn)
    tiers: tuple[HcPreTier, ...]  #: by increasing max_tokens; the last one takes any count
    finish: LaunchConfig  #: sums of the slices, gates, Sinkhorn and collapse
    block_d: int  #: hidden columns collapsed per finishing program
    #: bf16 streams: fn as this many bf16 terms on tensor cores (3: exact products, all of fn's bits); 0: IEEE
    #: fp32 FMAs on CUDA cores (always so for fp32 streams)
    terms: int = 3
    #: hidden columns a finishing program collapses per loop step (0: its whole block_d at once)
    step_d: int = 0

    def tier(self, tokens: int) -> HcPreTier:
        return next((t for t in self.tiers if tokens <= t.max_tokens), self.tiers[-1])


def hc_pre_config(arch: CudaArch, n: int, dim: int) -> HcPreTiles:
    """mHC pre: split-K projection over 256-column slices, then one finishing program per (token, 1024 columns).

    The projection's (2+n)*n = 24 rows of fn are 1.5 MB for V4 (4 x 4096); slices of 256 columns give 64 programs
    per token tile, enough to spread a decode step's read of fn over the GPU.  bf16 streams: fn is split in the
    kernel into three bf16 terms and projected with tensor-core dots (the fp32 FMAs on CUDA cores they replaced were
    far slower at prefill).  Every tier keeps 4+ warps and a multiple of 64 tokens,
    so on Hopper every tier's dots are the same wgmma m64nNk16 (a 16-row mma.sync tile could round differently):
    decode takes one 64-token tile (rows past the call masked, so not read), prefill 128-token tiles (fp32 streams:
    IEEE fp32 FMAs).  The finishing kernel runs one
    warp per program: its slice sums are then shuffles, no barriers; it collapses its 1024 columns at once
    (``step_d`` 256 would hold 60 registers a thread instead of 168, but was slower).  The tiers, ``step_d`` and
    the slice width are the winners of ``tools/sweep/hc_pre.py`` (timings: docs/performance/log/2026-11-29.md).
    """
    if arch.triton_arch in (90, 100):
        flat = n * dim
        tiers = (HcPreTier(64, 64, LaunchConfig(num_warps=4, num_stages=2)),
                 HcPreTier(1 << 30, 128, LaunchConfig(num_warps=4, num_stages=2)))
        return HcPreTiles(slice=min(256, max(16, 1 << (flat - 1).bit_length())), block_k=64, tiers=tiers,
                          finish=LaunchConfig(num_warps=1),
                          block_d=min(1024, max(16, 1 << (dim - 1).bit_length())), terms=3, step_d=0)
    raise ValueError(f"no mHC pre configuration for {arch.name}")


@dataclass(slots=True, frozen=True)
class MoeTiles:
    """Tiles of the two MoE expert GEMMs: ``block_m`` slots of one expert per program, column / reduction tiles."""

    block_m: int
    up: LaunchConfig
    up_block_n: int
    up_block_k: int
    down: LaunchConfig
    down_block_n: int
    down_block_k: int
    #: program order: False launches one column tile of every block together (block index fastest), True all
    #: column tiles of one block together (column index fastest: the block's x rows are reused from L2 at once)
    cols_inner: bool = False


def moe_experts_config(arch: CudaArch, slots_per_expert: int, hidden: int, inter: int,
                       element_bytes: int = 2) -> MoeTiles:
    """Tiles for ``slots_per_expert`` = T*k // E, the mean number of token slots an expert receives.

    Weight tiles arrive by TMA (the kernels' weight descriptors).  Every decode tier streams each hit expert's
    weights once through 16-row tiles (the read is the roofline term):
    - fewer slots than experts (0: decode b1..b10 at 64 experts, ..b42 at 256): few experts are hit, so the
      programs per expert must fill the GPU.  32 gate + 32 up columns (up) and 64 columns (down) per program over
      256-deep reduction tiles, 3 stages: b1's 7 slots (6 experts + the shared one) make 448 + 448 programs
      (faster than 16 + 16 columns, with or without TMA: docs/performance/log/2026-12-01.md);
    - 1..31: 32 gate + 32 up / 64 down columns, 4 stages (near the copy ceiling at b16 / b64);
    - prefill (>= 32): 128-row tiles over 128 gate + 128 up (up) / 256 (down) columns, 64-deep reduction tiles,
      8 warps = two warpgroups stacked in M, so each issues m64n128 (up, twice) / m64n256 (down) wgmmas: wide
      enough that shared memory feeds the tensor cores (m64n64 cannot), 4 stages of 48 KiB.  At 1024 tokens
      (~96 slots an expert) an expert is one block, so each weight tile leaves L2 once.  TMA weight tiles and
      4 stages beat pointer loads and 3 stages, and these tiles the old 64-row ones (docs/performance/log/).
      ``tools/sweep/moe_prefill.py`` times the alternatives.
    fp32 inputs (tests) halve the reduction tile and the pipeline depth to fit shared memory.  Tiles never exceed
    the padded problem dims.
    """
    if arch.triton_arch not in (90, 100):
        raise ValueError(f"no MoE configuration for {arch.name}")

    def fit(block: int, dim: int) -> int:
        return max(16, min(block, 1 << (max(dim, 1) - 1).bit_length()))

    wide = 2 if element_bytes > 2 else 1
    if slots_per_expert < 1:
        narrow = LaunchConfig(num_warps=4, num_stages=3)
        return MoeTiles(16, narrow, fit(32, inter), fit(256 // wide, hidden),
                        narrow, fit(64, hidden), fit(256 // wide, inter))
    stages = LaunchConfig(num_warps=4, num_stages=4 // wide)
    if slots_per_expert < 32:
        return MoeTiles(16, stages, fit(32, inter), fit(256 // wide, hidden),
                        stages, fit(64, hidden), fit(256 // wide, inter))
    wgmma = LaunchConfig(num_warps=8, num_stages=4 if wide == 1 else 2)
    return MoeTiles(128, wgmma, fit(128, inter), fit(64 // wide, hidden), wgmma, fit(256, hidden),
                    fit(64 // wide, inter),
                    cols_inner=True)


def moe_batch_invariant_config(arch: CudaArch, hidden: int, inter: int, element_bytes: int = 2) -> MoeTiles:
    """One set of tiles whatever the batch (``DEEPINFER_BATCH_INVARIANT=1``): a slot's output is its own rows of
    tiles reduced in one order, so it cannot depend on how many other slots the call holds.  The 16-row tier
    (decode's, where the flag matters most: prefill pays for narrower tiles)."""
    return moe_experts_config(arch, 1, hidden, inter, element_bytes)


@dataclass(slots=True, frozen=True)
class Mxfp4Tiles:
    """Tiles of the MXFP4 expert GEMMs (``kernels/moe_experts_mxfp4.py``): ``moe_experts``' tiles, and whether
    each program walks its block's slots one at a time with FMAs (``row_loop``; ``tiles.block_m`` is then the plan's
    block size) instead of one tl.dot tile over them."""

    tiles: MoeTiles
    row_loop: bool = False
    #: row loop only: the weight byte tiles come by TMA (descriptors over the packed weights), each kernel's K loop
    #: pipelined its ``num_stages`` deep, instead of pointer loads; the same math
    tma: bool = False
    #: row tiles only: "" decodes the weights in the tile (SM90: no FP4 tensor cores); else the activation operand of
    #: ``tl.dot_scaled`` over the packed weights (``kernels/moe_experts_mxfp4_scaled.py``): "e4m3" (MXFP8, quantized
    #: in the tile: SM100's block-scaled MMA) or "bf16" (the weights upcast by Triton: the reference's arithmetic)
    dot_scaled: str = ""


#: Measured MXFP4 decode tiles below one slot per expert, (hidden, inter) -> tiles; a shape not listed gets
#: :func:`mxfp4_decode_default`.  Paste ``tools/sweep/quant_decode.py``'s "best" line here (H200, bf16).
MXFP4_DECODE_TILES: dict[tuple[int, int], Mxfp4Tiles] = {
    (5120, 2304): Mxfp4Tiles(MoeTiles(16, LaunchConfig(num_warps=4, num_stages=3), 16, 1024,
                                      LaunchConfig(num_warps=4, num_stages=3), 64, 256), row_loop=True, tma=True),
}  # the winners of tools/sweep_quant_decode.py (docs/performance/log/2026-12-02.md): TMA weight tiles, 3 stages


def mxfp4_decode_default(hidden: int, inter: int) -> Mxfp4Tiles:
    """Untuned row-loop tiles: 16 gate + 16 up columns (up) and 32 columns (down) a program over 512-column steps
    (256 bytes of each weight row), 4 warps, 2 stages; V4.1-Flash b1 (6 experts) runs 864 + 960 programs."""

    def fit(block: int, dim: int) -> int:
        return max(16, min(block, 1 << (max(dim, 1) - 1).bit_length()))

    cfg = LaunchConfig(num_warps=4, num_stages=2)
    return Mxfp4Tiles(MoeTiles(16, cfg, fit(16, inter), fit(512, hidden), cfg, fit(32, hidden), fit(512, inter)),
                      row_loop=True)


def moe_mxfp4_config(arch: CudaArch, slots_per_expert: int, hidden: int, inter: int,
                     element_bytes: int = 2) -> Mxfp4Tiles:
    """Tiles for ``slots_per_expert`` = T*k // E:
    - below one (decode at V4.1-Flash's 384 experts up to b63): the row loop, :data:`MXFP4_DECODE_TILES` or
      :func:`mxfp4_decode_default`: an expert mostly gets one slot, so a 16-row tl.dot would multiply 15 rows of
      padding, and FMAs over each decoded weight once suffice; a block's further slots re-read its weights (L2);
    - otherwise ``moe_experts_config``'s tiers (tl.dot tiles of 16 / 128 slots);
    - SM100, bf16, the prefill tier (32 slots and more an expert): :func:`mxfp4_block_scaled_tiles`."""
    if slots_per_expert < 1:
        if arch.triton_arch not in (90, 100):
            raise ValueError(f"no MoE configuration for {arch.name}")
        return MXFP4_DECODE_TILES.get((hidden, inter)) or mxfp4_decode_default(hidden, inter)
    if arch.triton_arch == 100 and slots_per_expert >= 32 and element_bytes == 2:
        return mxfp4_block_scaled_tiles(hidden, inter, MXFP4_SM100_ACTIVATION)
    return Mxfp4Tiles(moe_experts_config(arch, slots_per_expert, hidden, inter, element_bytes))


#: SM100's MXFP4 prefill activation operand (:attr:`Mxfp4Tiles.dot_scaled`).  "bf16" keeps ``moe_experts_mxfp4``'s
#: reference arithmetic (Triton upcasts the e2m1 tile: ``tcgen05.mma kind::f16``).  "e4m3" is Blackwell's
#: block-scaled FP8 x FP4 MMA (``kind::mxf8f6f4.block_scale``) at twice the rate, but rounding both GEMMs'
#: activations to MXFP8 around SwiGLU moves the output by ~5.7% RMS on core's 33-row sample, outside the op's
#: declared tolerance (which, unlike the FP8 GEMMs', allows no activation rounding): switch once that is accepted.
MXFP4_SM100_ACTIVATION = "bf16"


def mxfp4_block_scaled_tiles(hidden: int, inter: int, activation: str) -> Mxfp4Tiles:
    """SM100's prefill MXFP4 tiles: ``tl.dot_scaled`` over the packed weights (``activation``: see
    :data:`MXFP4_SM100_ACTIVATION`), accumulators in tensor memory.  128 slots x (128 gate + 128 up) columns as one
    256-wide product (up) / 256 columns (down), 128-deep reduction steps (64 bytes of each weight row, 4 e8m0
    scales), 8 warps (an e4m3 activation tile is quantized in registers: 64 values a thread), 3 stages.  Compiled
    for sm_100a, never run on a Blackwell GPU: untuned."""

    def fit(block: int, dim: int) -> int:
        return max(32, min(block, 1 << (max(dim, 1) - 1).bit_length()))

    cfg = LaunchConfig(num_warps=8, num_stages=3)
    return Mxfp4Tiles(MoeTiles(128, cfg, fit(128, inter), fit(128, hidden), cfg, fit(256, hidden), fit(128, inter),
                               cols_inner=True), dot_scaled=activation)


@dataclass(slots=True, frozen=True)
class Mxfp4TileLang:
    """Tiles of the TileLang MXFP4 expert GEMMs (``kernels/moe_experts_mxfp4_tl.py``): ``block_m`` slots of a plan
    block (the wgmma's N), ``block_k`` columns a pipeline stage, ``stages`` TMA stages in flight, ``occupancy``
    programs an SM (2: nvcc keeps to 80 registers a thread so that two fit)."""

    block_m: int
    block_k: int
    stages: int
    occupancy: int = 1
    #: the launcher's config: 12 warps (one producer and two consumer warpgroups); the cubin fixes the rest
    LAUNCH: ClassVar[LaunchConfig]


Mxfp4TileLang.LAUNCH = LaunchConfig(num_warps=12, num_stages=0)

def mxfp4_tilelang_tier(slots: int, experts: int) -> str:
    """The MXFP4 tier of a call by its token slots (tokens x top-k) and experts (at V4.1-Flash's 384 experts,
    top-6): "few" below one slot for every 16 experts (up to 3 tokens: a few experts, one slot each), "decode" below
    one an expert (below 64 tokens), "batch" below 12 an expert (below 768 tokens), "chunk" below 32 (up to the
    1024-token prefill chunk: an expert's slots fill one wider block), "prefill" from 32."""
    if slots * 16 < experts:
        return "few"
    if slots < experts:
        return "decode"
    return "batch" if slots < 12 * experts else "chunk" if slots < 32 * experts else "prefill"


#: The TileLang MXFP4 forms built into the kernel set (SM90 only): per :func:`mxfp4_tilelang_tier`, the candidates.
#: ``occupancy`` 2 forms need the weight-stage release after the wgmma (``release_weights_after_mma``; without it
#: they raced, docs/performance/log/2026-12-06.md).  Each has its one-program sibling, which the GPU test compares.
MXFP4_TILELANG_CANDIDATES: dict[str, tuple[Mxfp4TileLang, ...]] = {
    "few": (Mxfp4TileLang(16, 128, 4, 2),),
    "decode": (Mxfp4TileLang(16, 128, 4, 2), Mxfp4TileLang(16, 128, 4)),
    "batch": (Mxfp4TileLang(16, 128, 4, 2), Mxfp4TileLang(16, 256, 4)),
    "chunk": (Mxfp4TileLang(32, 128, 4, 2), Mxfp4TileLang(32, 128, 4), Mxfp4TileLang(16, 128, 4, 2)),
    "prefill": (Mxfp4TileLang(64, 128, 3),),
}
#: Where the TileLang form replaces the Triton one, (hidden, inter) -> {tier: tiles}: the winners of
#: ``tools/sweep/mxfp4_tilelang.py`` (docs/performance.md).  A shape or tier not listed runs Triton.
MXFP4_TILELANG: dict[tuple[int, int], dict[str, Mxfp4TileLang]] = {
    (5120, 2304): {"few": Mxfp4TileLang(16, 128, 4, 2), "decode": Mxfp4TileLang(16, 128, 4, 2),
                   "batch": Mxfp4TileLang(16, 128, 4, 2),
                   "chunk": Mxfp4TileLang(32, 128, 4, 2)}}


def mxfp4_tilelang_config(arch: CudaArch, slots: int, experts: int, hidden: int, inter: int,
                          tuned: bool = True) -> Mxfp4TileLang | None:
    """The TileLang tiles for a call (None: the Triton form).  ``tuned=False`` gives the tier's first candidate
    whatever the table says (what the kernel set builds, with the other candidates, for the sweep)."""
    if arch.triton_arch != 90:
        return None
    tier = mxfp4_tilelang_tier(slots, experts)
    if tuned:
        return MXFP4_TILELANG.get((hidden, inter), {}).get(tier)
    return MXFP4_TILELANG_CANDIDATES[tier][0]


#: Whether the exact TileLang MXFP4 experts take the folded decode (one bf16x2 multiply a register, where every
#: scale byte is at most 128: ``moe_experts_mxfp4_tl.scales_fold``).  Built into the kernel set and checked on the
#: CPU (its factor's bits, ptxas: 32 fewer ``HMUL2`` a step); off until it has run on a GPU
#: (``test_moe_mxfp4_tilelang_gpu.py`` runs both decodes whatever this says; docs/performance/log/2026-12-07.md).
MXFP4_FOLDED_DECODE = False
#: The same for the TileLang FP8 GEMM (``fp8_block_linear_tl``: one multiply by 2^(e8m0 - 7) where every scale byte
#: is at most 134; ptxas: docs/performance/log/2026-12-07.md); off until it has run on a GPU.
FP8_FOLDED_DECODE = False


#: The W4A8 forms (``kernels/moe_experts_mxfp4_w4a8_tl.py``; opt-in: ``DEEPINFER_MXFP4_ACTIVATIONS=fp8``), per
#: tier: the candidates, the first the one that runs (the winner of ``tools/sweep/mxfp4_tilelang.py``, H100
#: 2026-12-07: docs/performance.md).  Each 32-column group's rescale costs ``block_m / 2`` FMAs a thread, so the
#: tiers stop at "chunk"; a prefill runs the exact forms.
MXFP4_W4A8_CANDIDATES: dict[str, tuple[Mxfp4TileLang, ...]] = {
    "few": (Mxfp4TileLang(16, 256, 4, 2), Mxfp4TileLang(16, 128, 4, 2), Mxfp4TileLang(16, 128, 4, 3)),
    "decode": (Mxfp4TileLang(16, 128, 4, 2), Mxfp4TileLang(16, 128, 4, 3), Mxfp4TileLang(16, 256, 4, 2)),
    "batch": (Mxfp4TileLang(16, 128, 4, 2), Mxfp4TileLang(16, 128, 4, 3), Mxfp4TileLang(16, 256, 4, 2)),
    "chunk": (Mxfp4TileLang(32, 128, 4, 2),),
}


def mxfp4_w4a8_config(arch: CudaArch, slots: int, experts: int) -> Mxfp4TileLang | None:
    """The W4A8 tiles for a call (None: the exact forms run)."""
    if arch.triton_arch != 90:
        return None
    tier = MXFP4_W4A8_CANDIDATES.get(mxfp4_tilelang_tier(slots, experts))
    return tier[0] if tier else None


@dataclass(slots=True, frozen=True)
class Fp8TileLang:
    """Tiles of the TileLang FP8 GEMM (``kernels/fp8_block_linear_tl.py``): ``block_m`` rows of x a program (the
    wgmma's N), ``block_k`` columns a pipeline stage, ``stages`` TMA stages in flight, ``split`` K ranges (one
    program each, fp32 partials summed in order), ``occupancy`` programs an SM."""

    block_m: int
    block_k: int
    stages: int
    split: int = 1
    occupancy: int = 1
    LAUNCH: ClassVar[LaunchConfig]


Fp8TileLang.LAUNCH = LaunchConfig(num_warps=12, num_stages=0)


def fp8_tilelang_tier(rows: int) -> str | None:
    """The FP8 TileLang tier of a call: "decode" from 2 to 16 rows, "batch" up to 64, "chunk" up to 255 (a
    speculative verify step's rows, a short prefill chunk), "prefill" above; None for one row (Triton's one-row
    FMA loop wins at every V4.1-Flash shape)."""
    if rows == 1:
        return None
    if rows <= 16:
        return "decode"
    if rows <= FP8_ACT_MIN_ROWS:
        return "batch"
    return "chunk" if rows < 256 else "prefill"


def fp8_tilelang_candidates(shape: tuple[int, int, int, int], tier: str) -> tuple[Fp8TileLang, ...]:
    """The built tiles a tier of ``shape`` (N, K, groups, block) chooses from: "chunk" shares prefill's cubins."""
    return FP8_TILELANG_CANDIDATES.get(shape, {}).get("prefill" if tier == "chunk" else tier, ())


#: The prefill (and chunk) candidates at every shape: 128 or 256 rows a program (wgmma n256: the weights decoded
#: once per 256 rows), unsplit or in two (for the narrow projections' few row tiles).
_M128, _M256, _M128_SPLIT2 = Fp8TileLang(128, 64, 4, 1, 1), Fp8TileLang(256, 64, 3, 1, 1), Fp8TileLang(128, 64, 4, 2, 1)


def _fp8_tilelang_forms(splits: tuple[int, ...]) -> dict[str, tuple[Fp8TileLang, ...]]:
    """Decode and batch tiles at the shape's K splits; the prefill candidates."""
    return {"decode": tuple(Fp8TileLang(16, 128, 4, s, 2) for s in splits),
            "batch": tuple(Fp8TileLang(64, 128, 3, s, 1) for s in splits),
            "prefill": (_M128, _M256, _M128_SPLIT2)}


#: The TileLang FP8 forms built into the kernel set (SM90 only), (N per group, K, groups, square scale block) ->
#: {tier: candidates}: V4.1-Flash's projections (wq_a | wkv, wq_b, wo_a, wo_b, shared w1 | w3, shared w2), each
#: with the K splits that give its 128-row tiles about one or two programs an SM.
FP8_TILELANG_CANDIDATES: dict[tuple[int, int, int, int], dict[str, tuple[Fp8TileLang, ...]]] = {
    (1792, 5120, 1, 32): _fp8_tilelang_forms((10, 20)), (32768, 1280, 1, 32): _fp8_tilelang_forms((1, 2)),
    (1024, 4096, 8, 32): _fp8_tilelang_forms((2, 4)), (5120, 8192, 1, 32): _fp8_tilelang_forms((4, 8)),
    (4608, 5120, 1, 32): _fp8_tilelang_forms((4, 8)), (5120, 2304, 1, 32): _fp8_tilelang_forms((3, 6)),
}
#: Where the TileLang form replaces the Triton one, (N, K, groups, block) -> {tier: tiles}: the winners of
#: ``tools/sweep/fp8_tilelang.py`` (docs/performance/log/2026-12-06.md; chunk: the 128-row winner, prefill: the
#: 1024-row one).  A shape or tier not listed runs Triton.
FP8_TILELANG: dict[tuple[int, int, int, int], dict[str, Fp8TileLang]] = {
    (1792, 5120, 1, 32): {"batch": Fp8TileLang(64, 128, 3, 10, 1), "chunk": _M128_SPLIT2, "prefill": _M128},
    (32768, 1280, 1, 32): {"decode": Fp8TileLang(16, 128, 4, 1, 2), "batch": Fp8TileLang(64, 128, 3, 1, 1),
                           "chunk": _M128, "prefill": _M256},
    (1024, 4096, 8, 32): {"decode": Fp8TileLang(16, 128, 4, 4, 2), "batch": Fp8TileLang(64, 128, 3, 2, 1),
                          "chunk": _M128_SPLIT2, "prefill": _M256},
    (5120, 8192, 1, 32): {"batch": Fp8TileLang(64, 128, 3, 4, 1), "chunk": _M128_SPLIT2, "prefill": _M256},
    (4608, 5120, 1, 32): {"batch": Fp8TileLang(64, 128, 3, 4, 1), "chunk": _M128_SPLIT2, "prefill": _M256},
    (5120, 2304, 1, 32): {"batch": Fp8TileLang(64, 128, 3, 3, 1), "chunk": _M128_SPLIT2, "prefill": _M128},
}


def fp8_tilelang_config(arch: CudaArch, rows: int, n: int, k: int, groups: int, block: int) -> Fp8TileLang | None:
    """The TileLang tiles of an FP8 GEMM call (None: the Triton form)."""
    tier = fp8_tilelang_tier(rows)
    if arch.triton_arch != 90 or tier is None:
        return None
    return FP8_TILELANG.get((n, k, groups, block), {}).get(tier)


def moe_mxfp4_batch_invariant_config(arch: CudaArch, hidden: int, inter: int, element_bytes: int = 2) -> Mxfp4Tiles:
    """One set of tiles whatever the batch: ``moe_batch_invariant_config``'s 16-row tl.dot tier (a slot's sums do
    not depend on the batch; the row loop's would not either, but it re-reads weights per slot at larger batches)."""
    return Mxfp4Tiles(moe_batch_invariant_config(arch, hidden, inter, element_bytes))


def moe_fp8_config(arch: CudaArch, slots_per_expert: int, hidden: int, inter: int,
                   element_bytes: int = 2) -> MoeTiles:
    """Tiles of the FP8 expert GEMMs (``kernels/moe_experts_fp8.py``): ``moe_experts_config``'s tiers, the weight
    tiles arriving as e4m3 bytes (half bf16's shared memory a stage) and dequantized in registers before tl.dot.
    Untuned: the bf16 kernel's tiles are the starting point (decode reads half the bytes, prefill adds a
    dequantization per weight tile); ``tools/sweep/moe_prefill.py``-style sweeps should replace them on the H200."""
    return moe_experts_config(arch, slots_per_expert, hidden, inter, element_bytes)


def moe_fp8_batch_invariant_config(arch: CudaArch, hidden: int, inter: int, element_bytes: int = 2) -> MoeTiles:
    """One set of tiles whatever the batch: :func:`moe_fp8_config`'s 16-row tier (as
    :func:`moe_batch_invariant_config`)."""
    return moe_fp8_config(arch, 1, hidden, inter, element_bytes)


def moe_plan_config(arch: CudaArch, slots: int) -> LaunchConfig:
    """The MoE plan kernel (one program sorts up to 1024 slots): more warps for the wider bitonic sorts."""
    if arch.triton_arch not in (90, 100):
        raise ValueError(f"no MoE plan configuration for {arch.name}")
    return LaunchConfig(num_warps=4 if slots <= 256 else 8)


@dataclass(slots=True, frozen=True)
class MoePlanChunks:
    """The MoE plan above one program's slots: chunk sizes and the three kernels' configs."""

    chunk: int  #: slots per counting program (a row of per-expert counts for the single-program scan)
    block_i: int  #: slots placed per scattering program (each compared with its chunk's earlier slots)
    count: LaunchConfig  #: per chunk: ids compared with every expert, summed
    scan: LaunchConfig  #: one program: prefix sums down the chunks and over the experts
    scatter: LaunchConfig  #: per (chunk, block_i slots): equal-id counts, two gathers, a store; a share of blocks


def moe_plan_chunks_config(arch: CudaArch) -> MoePlanChunks:
    """The chunked MoE plan (prefill).  512-slot chunks: a slot's rank among its expert's slots in the chunk
    costs up to 512 compares, and the scan walks 12 rows for a 1024-token top-6 call (96 at 8192 tokens);
    128-slot scatter programs, so that call is 12 counting and 48 scattering programs."""
    if arch.triton_arch not in (90, 100):
        raise ValueError(f"no MoE plan configuration for {arch.name}")
    return MoePlanChunks(512, 128, LaunchConfig(num_warps=4), LaunchConfig(num_warps=8), LaunchConfig(num_warps=8))


def moe_combine_config(arch: CudaArch, hidden: int) -> tuple[LaunchConfig, int]:
    """The MoE k-way sum, one program per (token, block of ``block_h`` hidden columns): returns (config, block_h)."""
    if arch.triton_arch not in (90, 100):
        raise ValueError(f"no MoE combine configuration for {arch.name}")
    return LaunchConfig(num_warps=4), min(1024, max(16, 1 << (max(hidden, 1) - 1).bit_length()))


@dataclass(slots=True, frozen=True)
class SparseAttentionTiles:
    """Tiles of sparse attention's two kernels (per-split partials, then their combine)."""

    split: LaunchConfig  #: the attention kernel: one program per (query, head block, split) or per (query, head block)
    block_h: int  #: heads per program (tl.dot needs >= 16 rows; fewer heads are padded and masked)
    block_n: int  #: index columns gathered per chunk
    split_n: int  #: index columns per split: fixed per (arch, head_dim), never from the batch or the width
    combine: LaunchConfig  #: the combine kernel, one program per (query, head)
    split_below: int  #: one program per split when queries x head blocks <= this (a speed choice only)
    skip_empty: bool = True  #: skip the products of chunks whose indices are all -1 (bitwise neutral, a speed choice)
    transposed: bool = False  #: products as k @ q^T and k^T @ p^T (gathered rows on the M side; other bits)


def sparse_attention_config(arch: CudaArch, heads: int, dim: int, element_bytes: int) -> SparseAttentionTiles:
    """Sparse attention over index columns in fixed splits of ``split_n`` (flash-decoding).

    The heads of a query share each gathered chunk of ``block_n`` pool rows, so more heads per program means fewer
    gathers; 32 heads x 512 dims keeps each fp32 accumulator (the split's and the running one) at 64 registers per
    thread with 8 warps.  fp32 inputs (tests) halve the chunk to fit shared memory.  ``split_n`` = 64 columns (two
    chunks): a V4 CSA decode row (128 window + 512 top-k) is 10 splits, so decode b1 runs 20 programs instead of 2.
    When queries x head blocks already fill half the SMs (decode >= b33 at 64 heads, prefill) one program walks all
    of its query's splits and merges them in registers instead: the same code and the same merge order, so the
    result is bitwise the same either way, and the choice is free to depend on the batch.
    ``skip_empty``: each program walks only the chunks from its first to its last valid index (a 1024-token CSA
    prefill row of 640 columns has ~250 valid ones on average, -1 at both ends).  ``tools/sweep/sparse_attention.py``
    times the alternatives; 64-row chunks with 2 stages were its fastest plain form in every case, 128-row
    transposed chunks close (docs/performance/log/2026-11-29.md).
    """
    if arch.triton_arch not in (90, 100):
        raise ValueError(f"no sparse attention configuration for {arch.name}")
    block_h = min(32, max(16, 1 << (max(heads, 1) - 1).bit_length()))
    wide = element_bytes > 2 or dim > 512
    sms = 132 if arch.triton_arch == 90 else 148  # H100 / H200 SXM; B200
    return SparseAttentionTiles(
        split=LaunchConfig(num_warps=8 if block_h * dim >= 8192 else 4, num_stages=1 if wide else 2),
        block_h=block_h, block_n=16 if wide else 64, split_n=64,
        combine=LaunchConfig(num_warps=max(1, min(4, dim // 128)), num_stages=2), split_below=sms // 2)


def indexer_config(arch: CudaArch, heads: int, dim: int, element_bytes: int) -> tuple[LaunchConfig, int]:
    """Lightning-indexer scores, one program per (query, chunk of entries): returns (config, block_n).

    All index heads of a query in one [heads, dim] x [dim, block_n] product (64 x 128 x 64 in V4), reduced over
    heads in registers; fp32 inputs (tests) halve the chunk.
    """
    if arch.triton_arch not in (90, 100):
        raise ValueError(f"no indexer configuration for {arch.name}")
    return LaunchConfig(num_warps=4), 32 if element_bytes > 2 else 64


def compress_pool_config(arch: CudaArch, slots: int, dim: int) -> tuple[LaunchConfig, int]:
    """Gated pooling, one program per (entry, block of channels): returns (config, block_c).

    The whole window ``[slots, block_c]`` is held in registers (score fp32 and kv), ~4K elements per program:
    CSA's 8 slots take 512 channels at once, HCA's 128 slots 32 channels.
    """
    if arch.triton_arch not in (90, 100):
        raise ValueError(f"no compress_pool configuration for {arch.name}")
    block_s = max(2, 1 << (max(slots, 1) - 1).bit_length())
    block_c = max(16, min(1 << (max(dim, 1) - 1).bit_length(), 4096 // block_s))
    return LaunchConfig(num_warps=4), block_c


def compress_entries_config(arch: CudaArch, slots: int, dim: int) -> tuple[LaunchConfig, int]:
    """The compressor's whole entry, one program per window: returns (config, block_c).

    The program pools ``[slots, block_c]`` tiles of the window (scores fp32 and kv) in turn, then norms and rotates
    the whole row.  CSA's 8 slots x 512 channels (and the indexer's 8 x 128) fit one tile of 4K elements, so the
    pooled row stays in registers; HCA's 128 slots go 64 channels a tile (8K elements, 8 warps, 8 tiles per row)
    through the output row, which the program then reads back.
    """
    if arch.triton_arch not in (90, 100):
        raise ValueError(f"no compress_entries configuration for {arch.name}")
    block_s = max(2, 1 << (max(slots, 1) - 1).bit_length())
    block_d = max(16, 1 << (max(dim, 1) - 1).bit_length())
    if block_s * block_d <= 4096:
        return LaunchConfig(num_warps=4), block_d
    return LaunchConfig(num_warps=8), max(16, min(block_d, 8192 // block_s))


def sample_tokens_config(arch: CudaArch) -> tuple[LaunchConfig, int]:
    """Token sampling, one program per (row, chunk of the vocabulary): returns (config, block_v).

    A fixed chunk (not a split count chosen from the batch) keeps rows independent; 4096 tokens per program
    gives V4's 129280-token vocabulary 32 programs per row, so a one-row decode step still fills the GPU.
    """
    if arch.triton_arch not in (90, 100):
        raise ValueError(f"no sample_tokens configuration for {arch.name}")
    return LaunchConfig(num_warps=8), 4096


def moe_router_config(arch: CudaArch, experts: int) -> LaunchConfig:
    """MoE routing after the router GEMM, one program per ``block_rows`` tokens x all experts (the row in registers).

    1024 logits a program at 4 warps, 8 a thread (one 16-byte load of bf16): 16 tokens at 64 experts, 4 at 256 (a
    warp a row), 2 at 384 (padded to 512).  A decode token's latency is the serial work of one thread -- 8 scores
    (expf, log1pf, sqrt: ~60 instructions each) and k rounds of compares and a warp reduction -- so few elements a
    thread keep it short; a 16384-token prefill is still only 4096 programs.  The tile depends on the expert count
    only, never on the batch, so a row's bits do not either (softmax's sum is the one reduction with an order).
    """
    if arch.triton_arch not in (90, 100):
        raise ValueError(f"no MoE router configuration for {arch.name}")
    block_e = max(16, 1 << (max(experts, 1) - 1).bit_length())
    return LaunchConfig(num_warps=4, block_rows=max(1, 1024 // block_e))


def fake_quant_config(arch: CudaArch, block: int) -> LaunchConfig:
    """QAT fake-quantization, one program per ``block_rows`` scale blocks of ``block`` channels (4096 elements a
    program, 8 a thread at 4 warps: one 16-byte load of bf16).  Every block is reduced by itself, so the tile
    never changes a bit (batch-invariant)."""
    if arch.triton_arch not in (90, 100):
        raise ValueError(f"no fake-quant configuration for {arch.name}")
    return LaunchConfig(num_warps=4, block_rows=max(1, 4096 // (1 << (max(block, 1) - 1).bit_length())))


def hc_collapse_config(arch: CudaArch, dim: int) -> tuple[LaunchConfig, int]:
    """V4.1's final mHC collapse, one program per (token, chunk of the hidden dim): returns (config, block_d).
    A token's N streams of one chunk are read once; 1024 columns at 4 warps (8 a thread)."""
    if arch.triton_arch not in (90, 100):
        raise ValueError(f"no hc_collapse configuration for {arch.name}")
    return LaunchConfig(num_warps=4), min(1024, max(16, 1 << (max(dim, 1) - 1).bit_length()))


def engram_gate_config(arch: CudaArch, dim: int) -> tuple[LaunchConfig, int]:
    """Engram's gate, one program per (token, stream): the stream's row and its key row [D] in registers (two
    fp32 reductions over D, then one fused update): returns (config, block_d).  8 warps up to 8192 columns
    (V4.1-Flash 5120: 32 elements a thread per row)."""
    if arch.triton_arch not in (90, 100):
        raise ValueError(f"no engram_gate configuration for {arch.name}")
    block_d = max(16, 1 << (max(dim, 1) - 1).bit_length())
    return LaunchConfig(num_warps=8 if block_d >= 2048 else 4), block_d


def embedding_fp8_config(arch: CudaArch, dim: int) -> tuple[LaunchConfig, int]:
    """FP8 table rows gathered and scaled: a [block_rows, block_d] tile of looked-up rows per program, ~4096
    values (4 KiB of codes) in, so that a prefill's many ids fill the SMs and a decode step's few still split;
    returns (config, block_d).  (V4.1-Flash: 256 columns, 16 rows a program.)"""
    if arch.triton_arch not in (90, 100):
        raise ValueError(f"no embedding_fp8 configuration for {arch.name}")
    block_d = max(16, 1 << (max(dim, 1) - 1).bit_length())
    return LaunchConfig(num_warps=4, block_rows=max(1, 4096 // block_d)), block_d


def engram_hash_config(arch: CudaArch) -> LaunchConfig:
    """Engram's n-gram hash: int64 arithmetic on a [block_rows, columns] tile of tokens x hash heads."""
    if arch.triton_arch not in (90, 100):
        raise ValueError(f"no engram_hash configuration for {arch.name}")
    return LaunchConfig(num_warps=4, block_rows=64)


@dataclass(slots=True, frozen=True)
class Fp8LinearTiles:
    """Tiles of the FP8 block-scaled GEMM (``kernels/fp8_block_linear.py``); ``act_fp8``: the activation is
    quantized to FP8 per ``block_k`` channels and the product runs on FP8 tensor cores (else the weight is
    dequantized in the tile and multiplied in the activation's dtype)."""

    config: LaunchConfig
    block_m: int  #: rows of a ``tl.dot`` tile, or (``row_loop``) rows a program walks one at a time
    block_n: int
    block_k: int
    act_fp8: bool
    #: programs per column tile along K (weight-only regime): each writes fp32 partials of its share of K, a second
    #: kernel adds them in split order (deterministic; the workspace is [split_k, rows, cols] fp32)
    split_k: int = 1
    #: weight-only, no ``tl.dot``: FMAs over the program's columns for one row at a time (decode's single row)
    row_loop: bool = False
    #: weight-only: the weight tiles come by TMA (a descriptor over the codes, ``config.num_stages`` deep) instead of
    #: pointer loads; the same math (``K`` a multiple of 16 and a 16-byte aligned weight, else pointer loads)
    tma: bool = False
    #: activation regime, ue8m0 weight scales: one ``tl.dot_scaled`` a step over MXFP8 activations (quantized in
    #: the tile, an e8m0 scale per 32) and the weight with its block scales as per-32 ones (SM100's block-scaled
    #: MMA; ``kernels/fp8_block_linear_mx.py``) instead of a quantization launch and fp32-promoted FP8 dots
    mx: bool = False


@dataclass(slots=True, frozen=True)
class Fp8DecodeTile:
    """One entry of :data:`FP8_DECODE_TILES` (what ``tools/sweep/quant_decode.py`` prints)."""

    row_loop: bool  #: FMAs a row at a time (True) or 16-row ``tl.dot`` tiles (False)
    block_n: int  #: weight rows (output columns) per program; >= 16 for tl.dot tiles
    block_k: int  #: reduction columns per loop step (a power of two)
    split_k: int  #: programs along K per column tile (1: no second kernel)
    num_warps: int
    num_stages: int
    tma: bool = False  #: weight tiles by TMA, ``num_stages`` deep (:attr:`Fp8LinearTiles.tma`)


#: Rows from which a bf16 FP8 GEMM quantizes its activation (DeepGEMM's scheme): below, a step reads weights and
#: dequantizing them in the tile costs nothing; above, FP8 tensor cores double the bf16 rate.
FP8_ACT_MIN_ROWS = 64
#: Row tiers of the weight-only (decode) regime: a call of ``rows`` takes the first tier >= rows.
FP8_DECODE_ROW_TIERS = (1, FP8_ACT_MIN_ROWS - 1)
#: Measured decode tiles, (N per group, K, groups, row tier) -> tile; a shape not listed gets
#: :func:`fp8_decode_default`.  Paste ``tools/sweep/quant_decode.py``'s "best" lines here (H200, bf16 activations).
#: sweep winners: docs/performance/log/2026-12-02.md
FP8_DECODE_TILES: dict[tuple[int, int, int, int], Fp8DecodeTile] = {
    (1024, 4096, 8, 1): Fp8DecodeTile(True, 16, 2048, 1, 8, 2, tma=True),
    (1024, 4096, 8, 63): Fp8DecodeTile(False, 32, 512, 1, 4, 3, tma=True),
    (1792, 5120, 1, 1): Fp8DecodeTile(True, 8, 1024, 1, 4, 3, tma=True),
    (1792, 5120, 1, 63): Fp8DecodeTile(False, 32, 256, 4, 4, 3, tma=True),
    (4608, 5120, 1, 1): Fp8DecodeTile(True, 8, 1024, 1, 4, 3, tma=True),
    (4608, 5120, 1, 63): Fp8DecodeTile(False, 32, 256, 4, 4, 3, tma=True),
    (5120, 2304, 1, 1): Fp8DecodeTile(True, 16, 512, 1, 4, 3, tma=True),
    (5120, 2304, 1, 63): Fp8DecodeTile(False, 32, 256, 4, 4, 2, tma=True),
    (5120, 8192, 1, 1): Fp8DecodeTile(True, 8, 1024, 1, 4, 3, tma=True),
    (5120, 8192, 1, 63): Fp8DecodeTile(False, 32, 512, 4, 4, 2, tma=True),
    (32768, 1280, 1, 1): Fp8DecodeTile(True, 16, 512, 1, 4, 2, tma=True),
    (32768, 1280, 1, 63): Fp8DecodeTile(False, 64, 256, 1, 4, 3),
}


def fp8_decode_default(tier: int, n: int, k: int, groups: int) -> Fp8DecodeTile:
    """Untuned decode tiles: enough programs to give every SM (132) ~4 (row loop) or ~2 (tl.dot) of them.
    - one row: FMAs over [block_n, 512] byte tiles (4 to 16 weight rows), no split-K (no second launch);
    - up to 63 rows: 16-row tl.dot tiles of 16 to 64 columns over 256-deep steps, split-K when the columns alone
      give fewer than 264 programs (each split at least 1024 deep)."""
    cols = n * groups
    if tier <= 1:
        block_n = 16 if cols >= 16 * 528 else 8 if cols >= 8 * 528 else 4
        return Fp8DecodeTile(True, block_n, 512, 1, 4, 2)
    block_n = 64 if cols >= 64 * 264 else 32 if cols >= 32 * 264 else 16
    tiles = -(-cols // block_n)
    split = max(1, min(-(-264 // tiles), k // 1024))
    return Fp8DecodeTile(False, block_n, 256, split, 4, 3)


def fp8_linear_config(arch: CudaArch, rows: int, n: int, k: int, groups: int, block_k: int, element_bytes: int,
                      *, batch_invariant: bool = False, scale_e8m0: bool = True) -> Fp8LinearTiles:
    """Tiles of ``rows`` x [groups x (N x K)]; ``block_k``: the weight's scale block along K.
    - decode (rows < 64, or fp32): the weight-only regime, each program streaming its columns' weights once:
      :data:`FP8_DECODE_TILES` per shape and row tier, else :func:`fp8_decode_default`.  fp32 activations (tests,
      oracle runs) halve the reduction step and the pipeline of tl.dot tiles (shared memory);
    - ``batch_invariant`` (``DEEPINFER_BATCH_INVARIANT=1``): the 16-row tl.dot tier's tiles at every row count,
      without split-K (its workspace grows with the rows), so a row's result never depends on the batch;
    - prefill (bf16, rows >= 64): 128 x 128 tiles (64 rows below 128), one weight scale block deep per step
      (``block_k``: 128, or 32 for V4.1's 32x32 tensors), FP8 ``tl.dot`` (wgmma m64n128k32), the partial product
      of each step scaled by the activation's and the weight's scales in fp32 (DeepGEMM's promotion every scale
      block), 8 warps = two warpgroups stacked in M, 3 stages;
    - SM100 prefill with ue8m0 weight scales (``scale_e8m0``, as released): :attr:`Fp8LinearTiles.mx`, 128 x 128
      tiles at every row count from 64 (Triton 3.6 lowers a 64-row ``dot_scaled`` tile to bf16 MMAs), 128 deep a
      step whatever the weight's block (the scales go per 32 to the tensor cores), 8 warps, 3 stages.  Compiled for
      sm_100a, never run on a Blackwell GPU: untuned.
    Decode untuned until ``tools/sweep/quant_decode.py`` has filled the table (docs/performance.md)."""
    if arch.triton_arch not in (90, 100):
        raise ValueError(f"no FP8 GEMM configuration for {arch.name}")
    if batch_invariant or rows < FP8_ACT_MIN_ROWS or element_bytes != 2:
        tier = FP8_DECODE_ROW_TIERS[-1] if batch_invariant else next(
            (t for t in FP8_DECODE_ROW_TIERS if rows <= t), FP8_DECODE_ROW_TIERS[-1])
        tile = FP8_DECODE_TILES.get((n, k, groups, tier)) or fp8_decode_default(tier, n, k, groups)
        if batch_invariant and (tile.row_loop or tile.split_k > 1):
            tile = fp8_decode_default(FP8_DECODE_ROW_TIERS[-1], n, k, groups)
            tile = Fp8DecodeTile(False, tile.block_n, tile.block_k, 1, tile.num_warps, tile.num_stages)
        return fp8_decode_tiles(tile, element_bytes)
    block_m = 128 if rows >= 128 else 64
    if arch.triton_arch == 100 and scale_e8m0:  # Triton 3.6 lowers 64-row dot_scaled tiles to bf16 MMAs
        return Fp8LinearTiles(LaunchConfig(num_warps=8, num_stages=3), 128, 128, 128, True, mx=True)
    return Fp8LinearTiles(LaunchConfig(num_warps=8 if block_m == 128 else 4, num_stages=3), block_m, 128, block_k,
                          True)


def fp8_decode_tiles(tile: Fp8DecodeTile, element_bytes: int) -> Fp8LinearTiles:
    """The launch tiles of a decode ``tile`` (fp32 activations: tl.dot tiles half as deep, half the stages)."""
    wide = 2 if element_bytes > 2 and not tile.row_loop else 1
    return Fp8LinearTiles(LaunchConfig(num_warps=tile.num_warps, num_stages=max(1, tile.num_stages // wide)),
                          1 if tile.row_loop else 16, tile.block_n, max(16, tile.block_k // wide), False,
                          tile.split_k, tile.row_loop, tile.tma)


def fp8_act_quant_config(arch: CudaArch, group: int) -> LaunchConfig:
    """Per-token-group activation quantization: ``block_rows`` groups a program, ~4K elements."""
    if arch.triton_arch not in (90, 100):
        raise ValueError(f"no FP8 activation quantization configuration for {arch.name}")
    return LaunchConfig(num_warps=4, block_rows=max(1, 4096 // group))


def split_k_sum_config(arch: CudaArch) -> LaunchConfig:
    """The split-K sum (``kernels/split_k_sum.py``): ``block_rows`` outputs a program, 4 a thread."""
    if arch.triton_arch not in (90, 100):
        raise ValueError(f"no split-K sum configuration for {arch.name}")
    return LaunchConfig(num_warps=4, block_rows=512)
