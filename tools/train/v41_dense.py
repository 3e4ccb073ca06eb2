"""A compact, dense DeepSeek-V4.1 forward pass in plain PyTorch: the second oracle for the engine.

Whole sequences (batch of equal-length rows, positions 0..S-1), dense masks, no caches, no op table and no
import from deepinfer. It follows the reference spec (``/work/notes/v41_reference.md``): single-pass mHC, the
causal encoder-decoder (CSA2 Full / Reindex / Reuse roles, candidate blocks), Engram, sqrt-softplus MoE and the
three QAT fake-quantizers. Group semantics are the cache path's (spec §12): a kv source's compressed entries and
index keys REPLACE the previous group's, they are never appended.

Training: every op is differentiable except the integer selections (index top-k, candidate blocks, router
top-k; the indexer weights therefore get no gradient from the LM loss). The fake-quantizers are straight-through
(forward bit-exact, backward identity); ``V41Model.fake_quant = False`` skips them, and so does any width that is
not a multiple of the block (as in ``tiny_b``).

``decoder_keep`` (decoder prefill truncation, "SWA bounded replay", engine note §3): layers up to the decoder
kv source run on all rows; at that layer the compressor (global KV + index keys) still sees every row, then its
own q / SWA / indexer / attention / MoE and all later layers run on the last KEEP rows only. Their SWA reads only
positions >= the first kept one (the floor). Rows before the floor have no decoder output: logits are returned
for the kept rows only.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

# ----------------------------------------------------------------------------------------------- config


@dataclass
class V41Config:
    """The text-model fields the forward reads (HF names, released defaults); ``None`` fields are derived."""

    vocab_size: int = 129280
    hidden_size: int = 5120
    num_hidden_layers: int = 40
    num_attention_heads: int = 64
    head_dim: int = 512
    q_lora_rank: int = 1280
    qk_rope_head_dim: int = 64
    o_groups: int = 8
    o_lora_rank: int = 1024
    sliding_window: int = 128
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_scaling: dict | None = None
    rope_parameters: dict | None = None
    compress_ratios: list[int] | None = None
    num_nextn_predict_layers: int = 3
    kv_source_layer_ids: list[int] | None = None
    index_source_layer_ids: list[int] | None = None
    candidate_source_layer_id: int | None = None
    candidate_topk_blocks: int = 2048
    candidate_block_size: int = 8
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 512
    n_routed_experts: int = 384
    num_experts_per_tok: int = 6
    moe_intermediate_size: int = 2304
    scoring_func: str = "sqrtsoftplus"
    gate_temp: float = 1.0
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    rms_norm_eps: float = 1e-20
    engram_layer_ids: list[int] = field(default_factory=list)
    engram_num_embeddings: list[int] | None = None
    engram_vocab_size: int = 16000000
    engram_max_ngram_size: int = 4
    engram_n_heads: int = 8
    engram_head_dim: int = 256
    engram_pad_id: int = 2
    engram_compressed_vocab_size: int = 99092

    def __post_init__(self) -> None:
        n = self.num_hidden_layers
        released = [0, 0] + [2] * 18 + [1] * 20
        if self.compress_ratios is None:  # the released pattern, or its shape scaled to n layers
            slide, enc = min(2, n), max(0, (n - min(2, n) + 1) // 2)
            self.compress_ratios = released if n == 40 else [0] * slide + [2] * enc + [1] * max(0, n - slide - enc)
        if not n <= len(self.compress_ratios) <= n + self.num_nextn_predict_layers:
            raise ValueError(f"compress_ratios needs {n}..{n + self.num_nextn_predict_layers} entries")
        self.compress_ratios = list(self.compress_ratios[:n])  # draft (DSpark) entries are not run here
        r = self.compress_ratios
        if self.kv_source_layer_ids is None:
            runs = [i for i in range(n) if r[i] > 0 and (i == 0 or r[i - 1] != r[i])]  # first of each same-ratio run
            self.kv_source_layer_ids = [2, 8, 14, 20] if r == released[:n] else runs
        if self.index_source_layer_ids is None:
            extra = [24, 28, 32, 36] if self.kv_source_layer_ids == [2, 8, 14, 20] else []
            self.index_source_layer_ids = list(self.kv_source_layer_ids) + extra
        if self.candidate_source_layer_id is None:
            self.candidate_source_layer_id = self.kv_source_layer_ids[-1] if self.kv_source_layer_ids else -1
        if any(r[i] > 0 and not any(s <= i for s in self.kv_source_layer_ids) for i in range(n)):
            raise ValueError("every layer with compress_ratios[i] > 0 needs a kv_source_layer_ids entry <= i")
        if self.engram_num_embeddings is None:
            self.engram_num_embeddings = [0] * len(self.engram_layer_ids)
        rp = self.rope_parameters or {}
        if not (isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict)):
            part = self.qk_rope_head_dim / self.head_dim
            scaling = {k: v for k, v in (self.rope_scaling or {}).items() if k not in ("main", "compress")}
            comp = {**scaling, "rope_theta": self.compress_rope_theta, "partial_rotary_factor": part}
            comp.setdefault("rope_type", "default")  # a legacy "type": "yarn" alone means NO YaRN (spec §1.3)
            if comp["rope_type"] == "yarn":
                comp.setdefault("attention_factor", 1.0)
            main = {"rope_type": "default", "rope_theta": self.rope_theta, "partial_rotary_factor": part}
            self.rope_parameters = {"main": main, "compress": comp}

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> V41Config:
        """Composite (``deepseek_v41``: the text model under ``text_config``) or flat (``deepseek_v41_text``)."""
        d = (raw.get("text_config") or {}) if raw.get("model_type") == "deepseek_v41" else raw
        d = dict(d)
        if "engram_pad_id" not in d and "engram_pad_token_id" in d:  # the released config.json's spelling
            d["engram_pad_id"] = d["engram_pad_token_id"]
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names and v is not None})


# --------------------------------------------------------------------------------- fake quantizers (§11)

_F32 = torch.float32
_E2M1_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
# |q| >= threshold counts one code up; ties at 0.25 / 1.25 / 2.5 / 5 go down, at 0.75 / 1.75 / 3.5 up (even code)
_E2M1_UP = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
_E2M1_THRESH = torch.where(
    torch.tensor([1, 0, 1, 0, 1, 0, 1], dtype=torch.bool), torch.nextafter(_E2M1_UP, torch.tensor(math.inf)), _E2M1_UP
)


def _pow2ceil(t: Tensor) -> Tensor:
    """2**ceil(log2 t) for positive normal fp32 t, exactly, from the bit pattern."""
    bits = t.view(torch.int32)
    k = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return ((k + 127) << 23).view(_F32)


def _e2m1(q: Tensor) -> Tensor:
    code = (q.abs().unsqueeze(-1) >= _E2M1_THRESH).sum(-1)
    v = _E2M1_GRID[code]
    return torch.where(torch.signbit(q) & (code > 0), -v, v)  # -0 dequantizes to +0


def _blocked(x: Tensor, block: int, quant) -> Tensor:
    if x.shape[-1] % block:
        return x  # shapes the reference cannot block run unquantized
    xb = x.float().unflatten(-1, (-1, block))
    return quant(xb, xb.abs().amax(-1, keepdim=True)).flatten(-2).to(x.dtype)


def fp8_e4m3_block32(x: Tensor) -> Tensor:
    """SWA K=V: ue8m0 scale 2**ceil(log2(amax/448)), e4m3 round-to-nearest-even."""

    def q(xb: Tensor, amax: Tensor) -> Tensor:
        s = _pow2ceil(amax.clamp(min=1e-4) * torch.tensor(1 / 448, dtype=_F32))
        return (xb / s).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float() * s

    return _blocked(x, 32, q)


def fp4_e2m1_e4m3scale_block16(x: Tensor) -> Tensor:
    """Compressed latents: e4m3 scale (amax/6, saturating cast), e2m1 values."""

    def q(xb: Tensor, amax: Tensor) -> Tensor:
        s = (amax.clamp(min=6.0 * 2.0**-9) / 6.0).to(torch.float8_e4m3fn).float()
        return _e2m1((xb / s).clamp(-6.0, 6.0)) * s

    return _blocked(x, 16, q)


def fp4_e2m1_ue8m0_block32(x: Tensor) -> Tensor:
    """Indexer queries and keys: ue8m0 scale 2**ceil(log2(amax/6)), e2m1 values."""

    def q(xb: Tensor, amax: Tensor) -> Tensor:
        s = _pow2ceil(amax.clamp(min=6.0 * 2.0**-126) * torch.tensor(1 / 6, dtype=_F32))
        return _e2m1((xb / s).clamp(-6.0, 6.0)) * s

    return _blocked(x, 32, q)


class _StraightThrough(torch.autograd.Function):
    """Forward: the exact quantizer; backward: identity (STE)."""

    @staticmethod
    def forward(ctx, x: Tensor, quant) -> Tensor:  # type: ignore[override]
        return quant(x)

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        return grad, None


def _fake(x: Tensor, quant, on: bool) -> Tensor:
    return _StraightThrough.apply(x, quant) if on else x


# ------------------------------------------------------------------------------------------- rope (§1.4)


def rope_table(p: dict, head_dim: int) -> tuple[Tensor, float]:
    """(inv_freq over the rotated pairs, cos/sin scaling) of one rope family: default or YaRN."""
    dim = int(head_dim * p.get("partial_rotary_factor", 1.0))
    base = float(p["rope_theta"])
    freq = base ** (torch.arange(0, dim, 2, dtype=_F32) / dim)
    if p.get("rope_type", "default") != "yarn":
        return 1.0 / freq, 1.0
    factor, orig = p.get("factor"), p["original_max_position_embeddings"]
    factor = factor if factor is not None else p["max_position_embeddings"] / orig

    def corr(rot: float) -> float:
        return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(corr(p.get("beta_fast") or 32)), 0)
    high: float = min(math.ceil(corr(p.get("beta_slow") or 1)), dim - 1)
    high = high + 0.001 if low == high else high
    extrapolate = 1 - ((torch.arange(dim // 2, dtype=_F32) - low) / (high - low)).clamp(0, 1)
    inv = 1.0 / (factor * freq) * (1 - extrapolate) + 1.0 / freq * extrapolate
    att = p.get("attention_factor")
    if att is None:
        att = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
    return inv, float(att)


def rope(t: Tensor, pos: Tensor, table: tuple[Tensor, float], inverse: bool = False) -> Tensor:
    """Rotate the last 2*len(inv_freq) channels in interleaved pairs; axis 1 of ``t`` is the position axis."""
    inv, scaling = table
    rd = 2 * inv.numel()
    ang = pos.to(_F32)[:, None] * inv[None]
    shape = (len(pos),) + (1,) * (t.dim() - 3) + (rd // 2,)
    cos, sin = (ang.cos() * scaling).view(shape).to(t.dtype), (ang.sin() * scaling).view(shape).to(t.dtype)
    sin = -sin if inverse else sin
    e, o = t[..., -rd::2].float(), t[..., -rd + 1 :: 2].float()
    rot = torch.stack((e * cos - o * sin, e * sin + o * cos), -1).flatten(-2).to(t.dtype)
    return torch.cat((t[..., :-rd], rot), -1)


# ------------------------------------------------------------------------------------------ engram (§9)


def compressed_token_map(tokenizer_json: str | Path) -> list[int]:
    """Tokens whose decoded text normalizes alike share one id (ids in order of first appearance)."""
    from tokenizers import Regex, Tokenizer
    from tokenizers import normalizers as n

    tok = Tokenizer.from_file(str(tokenizer_json))
    norm = n.Sequence([n.NFKC(), n.NFD(), n.StripAccents(), n.Lowercase(), n.Replace(Regex(r"[ \t\r\n]+"), " "),
                       n.Replace(Regex(r"^ $"), "\ue000"), n.Strip(), n.Replace("\ue000", " ")])  # fmt: skip
    keys: dict[str, int] = {}
    out = []
    for i in range(tok.get_vocab_size(with_added_tokens=True)):
        text = tok.decode([i], skip_special_tokens=False)
        key = (tok.id_to_token(i) or text) if "\ufffd" in text else (norm.normalize_str(text) or text)
        out.append(keys.setdefault(key, len(keys)))
    return out


def _next_prime(start: int, seen: set[int]) -> int:
    c = start
    while c in seen or c < 2 or any(c % d == 0 for d in range(2, math.isqrt(c) + 1)):
        c += 1
    seen.add(c)
    return c


class EngramHasher(nn.Module):
    """Token ids -> per-layer hash rows [B, S, n_engram_layers, (N-1)*heads] (spec §9.2-9.4)."""

    token_map: Tensor
    primes: Tensor
    offsets: Tensor
    mults: Tensor

    def __init__(self, cfg: V41Config, token_map: list[int]):
        super().__init__()
        if len(set(token_map)) != cfg.engram_compressed_vocab_size:
            raise ValueError(f"token map has {len(set(token_map))} compressed ids, the config says "
                             f"engram_compressed_vocab_size={cfg.engram_compressed_vocab_size}")  # fmt: skip
        n, heads, seen = cfg.engram_max_ngram_size, cfg.engram_n_heads, set[int]()
        cols = (n - 1) * heads  # the primes: consecutive, never reused, in (layer, n-gram size, head) order
        primes = [[_next_prime(cfg.engram_vocab_size, seen) for _ in range(cols)] for _ in cfg.engram_layer_ids]
        bound = max(1, (2**63 - 1) // cfg.engram_compressed_vocab_size // 2)
        mults = [np.random.default_rng(10007 * lid).integers(0, bound, size=n, dtype=np.int64) * 2 + 1
                 for lid in cfg.engram_layer_ids]  # fmt: skip
        self.n, self.heads = n, heads
        self.register_buffer("token_map", torch.tensor(token_map), persistent=False)
        self.register_buffer("primes", torch.tensor(primes), persistent=False)  # [layers, cols]
        self.register_buffer("offsets", F.pad(torch.tensor(primes).cumsum(-1)[:, :-1], (1, 0)), persistent=False)
        self.register_buffer("mults", torch.from_numpy(np.stack(mults)), persistent=False)  # [layers, n]
        self.pad = token_map[cfg.engram_pad_id]

    def forward(self, ids: Tensor) -> Tensor:
        c = self.token_map[ids]  # [B,S]; look-back s reads position p-s, the sequence start is filled with pad
        back = [F.pad(c, (s, 0), value=self.pad)[:, : c.shape[1]] for s in range(self.n)]
        prods = torch.stack(back, -1)[:, :, None, :] * self.mults  # [B,S,layers,n]
        rolling, cols = prods[..., 0], []
        for k in range(1, self.n):  # the n-gram of size k+1 ends at p
            rolling = rolling ^ prods[..., k]
            cols += [rolling[..., None]] * self.heads
        return torch.cat(cols, -1) % self.primes + self.offsets


# ------------------------------------------------------------------------------------------------ blocks


def _linear(i: int, o: int) -> nn.Linear:
    return nn.Linear(i, o, bias=False)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x: Tensor) -> Tensor:
        h = x.float()
        return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def hc_mixes(streams: Tensor, fn: Tensor, scale: Tensor, base: Tensor, cfg: V41Config) -> tuple[Tensor, ...]:
    """mHC (§4): pre [B,S,hc], post [B,S,hc], Sinkhorn-normalised comb [B,S,hc,hc], all fp32."""
    hc, eps = cfg.hc_mult, cfg.hc_eps
    flat = streams.flatten(2).float()
    flat = flat * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps)
    m = flat @ fn.float().T
    pre = torch.sigmoid(m[..., :hc] * scale[0] + base[:hc]) + eps
    post = 2 * torch.sigmoid(m[..., hc : 2 * hc] * scale[1] + base[hc : 2 * hc])
    comb = torch.softmax((m[..., 2 * hc :] * scale[2] + base[2 * hc :]).unflatten(-1, (hc, hc)), -1) + eps
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range(cfg.hc_sinkhorn_iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    return pre, post, comb


def collapse(streams: Tensor, pre: Tensor) -> Tensor:
    return (pre[..., None] * streams.float()).sum(2).to(streams.dtype)


def expand(y: Tensor, res: Tensor, post: Tensor, comb: Tensor) -> Tensor:
    mixed = torch.einsum("bsjk,bsjd->bskd", comb, res.float())
    return (post[..., None] * y.float()[:, :, None] + mixed).to(res.dtype)


class Compressor(nn.Module):
    """A kv source's global KV: softmax-gated pooling of r-token groups (r > 1) or a per-token projection."""

    def __init__(self, cfg: V41Config, ratio: int):
        super().__init__()
        self.ratio = ratio
        self.wkv = _linear(cfg.hidden_size, cfg.head_dim)
        self.wgate = _linear(cfg.hidden_size, cfg.head_dim) if ratio > 1 else None
        self.norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(self, x: Tensor) -> Tensor:
        """Pre-RoPE latents [B, S//r, Dh] of the complete groups (group g = positions g*r .. g*r+r-1)."""
        if self.wgate is None:
            return self.norm(self.wkv(x))
        r, g = self.ratio, x.shape[1] // self.ratio
        xs = x[:, : g * r].float()
        kv = (xs @ self.wkv.weight.float().T).unflatten(1, (g, r))
        gate = (xs @ self.wgate.weight.float().T).unflatten(1, (g, r))
        return self.norm((kv * gate.softmax(2)).sum(2).to(x.dtype))


class Indexer(nn.Module):
    def __init__(self, cfg: V41Config, owns_keys: bool):
        super().__init__()
        self.wq_b = _linear(cfg.q_lora_rank, cfg.index_n_heads * cfg.index_head_dim)
        self.weights_proj = _linear(cfg.hidden_size, cfg.index_n_heads)
        if owns_keys:  # a kv source that is also an index source makes the group's index keys
            self.wk = _linear(cfg.head_dim, cfg.index_head_dim)
            self.k_norm = RMSNorm(cfg.index_head_dim, cfg.rms_norm_eps)


class Attention(nn.Module):
    """Shared K=V latent attention with a private SWA, sinks, inverse RoPE, grouped O and the CSA2 branch."""

    def __init__(self, cfg: V41Config, layer: int):
        super().__init__()
        self.cfg, self.layer, self.ratio = cfg, layer, cfg.compress_ratios[layer]  # type: ignore[index]
        D, H, Dh = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
        self.wq_a, self.q_norm = _linear(D, cfg.q_lora_rank), RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.wq_b = _linear(cfg.q_lora_rank, H * Dh)
        self.wkv, self.kv_norm = _linear(D, Dh), RMSNorm(Dh, cfg.rms_norm_eps)
        self.wo_a = _linear(H * Dh // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank)
        self.wo_b = _linear(cfg.o_groups * cfg.o_lora_rank, D)
        self.attn_sink = nn.Parameter(torch.zeros(H))
        kv_src = layer in cfg.kv_source_layer_ids  # type: ignore[operator]
        self.compressor = Compressor(cfg, self.ratio) if kv_src else None
        self.indexer = Indexer(cfg, kv_src) if layer in cfg.index_source_layer_ids else None  # type: ignore[operator]
        self.rope_family = "compress" if self.ratio > 0 else "main"

    def forward(self, x: Tensor, pos: Tensor, shared: dict, q0: int = 0) -> Tensor:
        """x: attn_norm output [B,S,D] of rows ``pos``; queries are rows q0.. (the compressor sees all rows)."""
        cfg, comp, fq = self.cfg, shared["ropes"]["compress"], shared["fake_quant"]
        if self.compressor is not None:  # a kv source REPLACES the group lists (cache-path semantics)
            latent = self.compressor(x)
            gpos = torch.arange(latent.shape[1]) * self.ratio  # rope at the group's first position
            shared["kv"] = _fake(rope(latent, gpos, comp), fp4_e2m1_e4m3scale_block16, fq)
            if hasattr(self.indexer, "wk"):
                keys = self.indexer.k_norm(self.indexer.wk(latent))  # type: ignore[union-attr]
                shared["index_k"] = _fake(rope(keys, gpos, comp), fp4_e2m1_ue8m0_block32, fq)
            shared.pop("topk_bias", None)
            shared["source"] = self.layer
        if q0:  # decoder truncation: per-row publications of earlier layers follow the query rows
            x, pos = x[:, q0:], pos[q0:]
            if "candidates" in shared:
                shared["candidates"] = shared["candidates"][:, q0:]
        B, S, _ = x.shape
        H, Dh, table = cfg.num_attention_heads, cfg.head_dim, shared["ropes"][self.rope_family]
        q_res = self.q_norm(self.wq_a(x))
        q = rope(self.wq_b(q_res).unflatten(-1, (H, Dh)), pos, table)
        kv = _fake(rope(self.kv_norm(self.wkv(x)), pos, table), fp8_e4m3_block32, fq)
        d = pos[:, None] - pos[None, :]  # SWA: the W positions p-W+1..p that this call computed
        bias = torch.zeros(S, S).masked_fill((d < 0) | (d >= cfg.sliding_window), -math.inf).expand(B, 1, S, S)
        keys = kv
        if self.ratio > 0 and shared["kv"].shape[1] > 0:
            if self.indexer is not None:
                shared["topk_bias"] = self._topk_bias(x, q_res, pos, shared, comp)
            entries = shared["kv"]
            sel = shared.get("topk_bias", torch.full((B, S, entries.shape[1]), -math.inf))
            keys, bias = torch.cat((kv, entries), 1), torch.cat((bias, sel[:, None]), -1)
        scores = torch.einsum("bshd,btd->bhst", q, keys) * Dh**-0.5 + bias
        sink = self.attn_sink.float().view(1, H, 1, 1).expand(B, H, S, 1)
        probs = torch.cat((scores, sink), -1).softmax(-1)[..., :-1].to(keys.dtype)
        o = rope(torch.einsum("bhst,btd->bshd", probs, keys), pos, table, inverse=True)
        G = cfg.o_groups
        o = torch.einsum("bsgi,goi->bsgo", o.reshape(B, S, G, -1), self.wo_a.weight.view(G, cfg.o_lora_rank, -1))
        return self.wo_b(o.flatten(2))

    def _topk_bias(self, x: Tensor, q_res: Tensor, pos: Tensor, shared: dict, table) -> Tensor:
        """Index scores of this layer's queries against the group's keys -> 0 / -inf over the entries (§7.2)."""
        cfg, idx = self.cfg, self.indexer
        nI, dI = cfg.index_n_heads, cfg.index_head_dim
        qi = rope(idx.wq_b(q_res).unflatten(-1, (nI, dI)), pos, table)  # type: ignore[union-attr]
        qi = _fake(qi, fp4_e2m1_ue8m0_block32, shared["fake_quant"])
        K = shared["index_k"]
        s = torch.einsum("bshd,btd->bsht", qi.float(), K.float()).relu() * dI**-0.5
        w = idx.weights_proj(x).float() * nI**-0.5  # type: ignore[union-attr]
        score = (s * w[..., None]).sum(2).detach()  # [B,S,T]; selection only
        T = score.shape[-1]
        score = score.masked_fill(torch.arange(T)[None] >= ((pos + 1) // self.ratio)[:, None], -math.inf)
        if self.layer == cfg.candidate_source_layer_id:
            shared["candidates"] = self._candidates(score, pos)
        elif 0 <= cfg.candidate_source_layer_id < self.layer:  # type: ignore[operator]
            score = score.masked_fill(~shared["candidates"], -math.inf)
        vals, top = score.topk(min(cfg.index_topk, T), dim=-1, sorted=False)
        keep = torch.where(vals > -math.inf, 0.0, -math.inf)  # fewer eligible than k: the extra picks are dropped
        return torch.full_like(score, -math.inf).scatter(-1, top, keep)

    def _candidates(self, score: Tensor, pos: Tensor) -> Tensor:
        """Two-level pool: the top candidate_topk_blocks blocks by their best entry, newest visible block pinned."""
        bs, T = self.cfg.candidate_block_size, score.shape[-1]
        nb = -(-T // bs)
        best = F.pad(score, (0, nb * bs - T), value=-math.inf).unflatten(-1, (nb, bs)).amax(-1)
        newest = ((pos + 1) // self.ratio - 1) // bs  # -1 when nothing is visible yet: nothing pinned
        best = best.masked_fill(torch.arange(nb)[None] == newest[:, None], math.inf)
        vals, top = best.topk(min(self.cfg.candidate_topk_blocks, nb), dim=-1)
        keep = torch.zeros_like(best, dtype=torch.bool).scatter(-1, top, vals > -math.inf)
        return keep.repeat_interleave(bs, -1)[..., :T]


class Expert(nn.Module):
    def __init__(self, cfg: V41Config):
        super().__init__()
        D, inter, self.limit = cfg.hidden_size, cfg.moe_intermediate_size, cfg.swiglu_limit
        self.w1, self.w2, self.w3 = _linear(D, inter), _linear(inter, D), _linear(D, inter)

    def forward(self, x: Tensor, weight: Tensor | None = None) -> Tensor:
        g, u = self.w1(x).float(), self.w3(x).float()
        if self.limit > 0:
            g, u = g.clamp(max=self.limit), u.clamp(-self.limit, self.limit)
        y = F.silu(g) * u
        return self.w2((y if weight is None else weight * y).to(x.dtype))  # routing weight BEFORE w2


class Gate(nn.Module):
    def __init__(self, cfg: V41Config):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(cfg.n_routed_experts, cfg.hidden_size))
        self.bias = nn.Parameter(torch.zeros(cfg.n_routed_experts))  # selection only
        self.bias_vl = nn.Parameter(torch.zeros(cfg.n_routed_experts))  # image tokens; unused by text


_SCORE = {"sqrtsoftplus": lambda t: F.softplus(t).sqrt(), "sigmoid": torch.sigmoid, "softmax": lambda t: t.softmax(-1)}


class MoE(nn.Module):
    def __init__(self, cfg: V41Config):
        super().__init__()
        self.cfg, self.gate = cfg, Gate(cfg)
        self.experts = nn.ModuleList(Expert(cfg) for _ in range(cfg.n_routed_experts))
        self.shared_experts = Expert(cfg)

    def forward(self, x: Tensor) -> Tensor:
        cfg, xt = self.cfg, x.flatten(0, 1)
        scores = _SCORE[cfg.scoring_func](xt.float() @ self.gate.weight.float().T / cfg.gate_temp)
        top = (scores + self.gate.bias).topk(cfg.num_experts_per_tok, dim=-1).indices
        w = scores.gather(-1, top)
        if cfg.norm_topk_prob and cfg.num_experts_per_tok > 1:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        w = w * cfg.routed_scaling_factor
        out = torch.zeros(xt.shape, dtype=_F32)
        for e, expert in enumerate(self.experts):  # accumulated in ascending expert order, fp32
            tok, slot = (top == e).nonzero(as_tuple=True)
            if len(tok):
                out = out.index_add(0, tok, expert(xt[tok], w[tok, slot, None]).float())
        return (out + self.shared_experts(xt).float()).to(x.dtype).view_as(x)


class Engram(nn.Module):
    """Gates a hashed n-gram memory into each stream at the start of its layer (§9.5)."""

    def __init__(self, cfg: V41Config, rows: int):
        super().__init__()
        self.cfg, hd = cfg, cfg.engram_head_dim
        self.embed = nn.Embedding(rows, hd)
        self.embed.register_buffer("scale", torch.ones(rows, max(1, hd // 32)))  # fp8 tables only: see load()
        cols = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads
        self.wkv = _linear(cols * hd, (cfg.hc_mult + 1) * cfg.hidden_size)
        self.q_weight = nn.Parameter(torch.ones(cfg.hc_mult, cfg.hidden_size))
        self.k_weight = nn.Parameter(torch.ones(cfg.hc_mult, cfg.hidden_size))

    def forward(self, streams: Tensor, hashes: Tensor) -> Tensor:
        cfg, D, hc = self.cfg, self.cfg.hidden_size, self.cfg.hc_mult
        kv = self.wkv(self.embed(hashes).flatten(-2))
        key, value = kv[..., : hc * D].float().unflatten(-1, (hc, D)), kv[..., hc * D :]
        h = streams.float()
        rstd = torch.rsqrt(h.pow(2).mean(-1) + cfg.rms_norm_eps) * torch.rsqrt(key.pow(2).mean(-1) + cfg.rms_norm_eps)
        dot = (h * (self.q_weight.float() * self.k_weight.float()) * key).sum(-1) * rstd * D**-0.5
        gate = torch.sigmoid(torch.copysign(dot.abs().clamp(min=1e-6).sqrt(), dot))
        return (h + gate[..., None] * value.float()[:, :, None]).to(streams.dtype)


class Layer(nn.Module):
    def __init__(self, cfg: V41Config, i: int):
        super().__init__()
        D, hc, eps = cfg.hidden_size, cfg.hc_mult, cfg.rms_norm_eps
        self.cfg, self.attn_norm, self.ffn_norm = cfg, RMSNorm(D, eps), RMSNorm(D, eps)
        for site in ("attn", "ffn"):
            self.register_parameter(f"hc_{site}_fn", nn.Parameter(torch.zeros((2 + hc) * hc, hc * D)))
            self.register_parameter(f"hc_{site}_base", nn.Parameter(torch.zeros((2 + hc) * hc)))
            self.register_parameter(f"hc_{site}_scale", nn.Parameter(torch.ones(3)))
        self.attn, self.ffn = Attention(cfg, i), MoE(cfg)
        eids = cfg.engram_layer_ids
        self.engram_slot = eids.index(i) if i in eids else None
        self.engram = Engram(cfg, cfg.engram_num_embeddings[self.engram_slot]) if self.engram_slot is not None else None  # type: ignore[index]

    def forward(self, streams, pre_mix, pos, hashes, shared, q0=0):
        """One layer on streams [B,S,hc,D]; ``pre_mix`` is the previous site's pre (lagged single-pass mHC)."""
        if self.engram is not None:
            streams = self.engram(streams, hashes[:, :, self.engram_slot])
        a_pre, a_post, a_comb = hc_mixes(streams, self.hc_attn_fn, self.hc_attn_scale, self.hc_attn_base, self.cfg)
        y = self.attn(self.attn_norm(collapse(streams, pre_mix)), pos, shared, q0)
        if q0:  # the truncation boundary: streams, the lagged pre and positions narrow to the kept rows
            streams, a_pre, a_post, a_comb = (t[:, q0:] for t in (streams, a_pre, a_post, a_comb))
            pos, hashes = pos[q0:], None if hashes is None else hashes[:, q0:]
        streams = expand(y, streams, a_post, a_comb)
        f_pre, f_post, f_comb = hc_mixes(streams, self.hc_ffn_fn, self.hc_ffn_scale, self.hc_ffn_base, self.cfg)
        streams = expand(self.ffn(self.ffn_norm(collapse(streams, a_pre))), streams, f_post, f_comb)
        return streams, f_pre, pos, hashes


# ------------------------------------------------------------------------------------------------- model


class V41Model(nn.Module):
    """The dense reference; its state_dict uses the checkpoint's own tensor names."""

    def __init__(self, cfg: V41Config, token_map: list[int] | None = None):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Layer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.head = _linear(cfg.hidden_size, cfg.vocab_size)
        if cfg.engram_layer_ids and token_map is None:
            raise ValueError("engram layers need token_map (compressed_token_map(tokenizer.json))")
        self.hasher = EngramHasher(cfg, token_map) if cfg.engram_layer_ids else None  # type: ignore[arg-type]
        self.ropes = {k: rope_table(p, cfg.head_dim) for k, p in cfg.rope_parameters.items()}  # type: ignore[union-attr]
        self.fake_quant = True  # False: skip the QAT fake-quantizers (e.g. for training)

    def decoder_source(self) -> int:
        """The decoder's kv source: the last kv source, which must have ratio 1."""
        cfg = self.cfg
        src = cfg.kv_source_layer_ids[-1] if cfg.kv_source_layer_ids else -1
        if src < 0 or cfg.compress_ratios[src] != 1:  # type: ignore[index]
            raise ValueError(f"decoder_keep needs a ratio-1 last kv source, got kv sources {cfg.kv_source_layer_ids}")
        return src

    def forward(self, ids: Tensor, decoder_keep: int | None = None, record: dict | None = None) -> Tensor:
        """ids [B,S] (positions 0..S-1) -> fp32 logits [B,S,V], or [B,min(S,KEEP),V] for the kept rows.

        ``record``, if given, receives each kv source's entries / index keys and each index source's top-k
        bias under ``"{layer}.kv"``, ``"{layer}.index_k"``, ``"{layer}.topk_bias"``."""
        B, S = ids.shape
        cut, first = -1, 0
        if decoder_keep is not None:
            if decoder_keep < 1:
                raise ValueError(f"decoder_keep must be >= 1 (or None), got {decoder_keep}")
            cut, first = self.decoder_source(), max(0, S - decoder_keep)
        pos, hc = torch.arange(S), self.cfg.hc_mult
        streams = self.embed(ids)[:, :, None].expand(B, S, hc, self.cfg.hidden_size)
        pre_mix = F.one_hot(torch.zeros(B, S, dtype=torch.long), hc).to(_F32)  # layer 0 collapses stream 0
        hashes = self.hasher(ids) if self.hasher is not None else None
        shared: dict = {"ropes": self.ropes, "fake_quant": self.fake_quant}  # + the group publications
        for i, layer in enumerate(self.layers):
            streams, pre_mix, pos, hashes = layer(streams, pre_mix, pos, hashes, shared, first if i == cut else 0)
            if record is not None:
                for key in ("kv", "index_k") if shared.get("source") == i else ():
                    record[f"{i}.{key}"] = shared.get(key)
                if i in self.cfg.index_source_layer_ids:  # type: ignore[operator]
                    record[f"{i}.topk_bias"] = shared.get("topk_bias")
        return self.head(self.norm(collapse(streams, pre_mix))).float()


# ---------------------------------------------------------------------------------------- load, logprobs

_NOT_TEXT = ("mtp.", "vision.", "aligner.", "image_")
_KEEP_FP32 = ("_fn", "_base", "_scale", "attn_sink", "gate.bias", "gate.bias_vl")


def load(path: str | Path, dtype: torch.dtype = _F32) -> V41Model:
    """A checkpoint folder (config.json in either form, *.safetensors, tokenizer.json for Engram).

    Tensors must be float (the fixtures; a dequantized twin of the released format); only fp8 Engram tables
    are dequantized here."""
    from safetensors.torch import load_file

    path = Path(path)
    cfg = V41Config.from_dict(json.loads((path / "config.json").read_text()))
    token_map = compressed_token_map(path / "tokenizer.json") if cfg.engram_layer_ids else None
    model = V41Model(cfg, token_map)
    state = {k: v for f in sorted(path.glob("*.safetensors")) for k, v in load_file(f).items()}
    for k, v in state.items():
        if k.endswith("engram.embed.weight") and v.dtype == torch.float8_e4m3fn:  # fp8 rows * scale per 32 columns
            state[k] = v.float() * state[k[: -len("weight")] + "scale"].float().repeat_interleave(32, -1)
        elif v.dtype.itemsize == 1 and not k.endswith("engram.embed.scale"):
            raise ValueError(f"{k}: quantized {v.dtype} weights are not supported here; give dequantized tensors")
    model.load_state_dict({k: v for k, v in state.items() if not k.startswith(_NOT_TEXT)}, strict=True)
    model.to(dtype)
    for name, p in model.named_parameters():  # the reference keeps these in fp32 in any run
        if name.endswith(_KEEP_FP32):
            p.data = p.data.float()
    return model.eval()


@torch.no_grad()
def logprobs(model: V41Model, ids: list[int] | Tensor, **kw: Any) -> tuple[Tensor, Tensor, Tensor]:
    """Teacher-forced logprobs of one sequence in the fixture's format:
    (token_logprobs [S-1] = log p(ids[i+1] | ids[..i]), top5_ids [S,5], top5_logprobs [S,5])."""
    ids = torch.as_tensor(ids).view(1, -1)
    lp = torch.log_softmax(model(ids, **kw)[0].float(), -1)
    rows = ids[0, -lp.shape[0] :]  # with decoder_keep: the kept rows only
    top = lp.topk(5, dim=-1)
    return lp[:-1].gather(-1, rows[1:, None])[:, 0], top.indices, top.values
