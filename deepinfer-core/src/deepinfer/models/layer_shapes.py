"""Checkpoint shapes of the per-layer tensors V4, V4.1 and the DSpark drafter share: the norms, the mHC sites,
attention's query / KV / grouped-output projections and sinks (the released names under ``layers.N.`` or
``mtp.N.``), and the SwiGLU expert MLPs."""

from __future__ import annotations

from typing import Protocol


class _AttentionDims(Protocol):
    """The config fields read here (read-only: the configs are frozen dataclasses)."""

    @property
    def hidden_size(self) -> int: ...
    @property
    def hc_mult(self) -> int: ...
    @property
    def num_attention_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def q_lora_rank(self) -> int: ...
    @property
    def o_groups(self) -> int: ...
    @property
    def o_lora_rank(self) -> int: ...


def shared_layer_shapes(prefix: str, cfg: _AttentionDims, kv_norm: str) -> dict[str, tuple[int, ...]]:
    """Shapes of layer ``prefix`` (``layers.N.``); ``kv_norm`` names the KV norm (V4 ``norm``, V4.1 ``kv_norm``)."""
    d, n_hc, heads, hd = cfg.hidden_size, cfg.hc_mult, cfg.num_attention_heads, cfg.head_dim
    hc_out = (2 + n_hc) * n_hc
    shapes: dict[str, tuple[int, ...]] = {prefix + "attn_norm.weight": (d,), prefix + "ffn_norm.weight": (d,)}
    for site in ("attn", "ffn"):
        shapes.update({f"{prefix}hc_{site}_fn": (hc_out, n_hc * d), f"{prefix}hc_{site}_base": (hc_out,),
                       f"{prefix}hc_{site}_scale": (3,)})
    a = prefix + "attn."
    shapes.update({
        a + "wq_a.weight": (cfg.q_lora_rank, d),
        a + "q_norm.weight": (cfg.q_lora_rank,),
        a + "wq_b.weight": (heads * hd, cfg.q_lora_rank),
        a + "wkv.weight": (hd, d),
        a + f"{kv_norm}.weight": (hd,),
        a + "wo_a.weight": (cfg.o_groups * cfg.o_lora_rank, heads * hd // cfg.o_groups),
        a + "wo_b.weight": (d, cfg.o_groups * cfg.o_lora_rank),
        a + "attn_sink": (heads,),
    })
    return shapes


def mlp_shapes(prefix: str, d: int, inter: int) -> dict[str, tuple[int, ...]]:
    """A SwiGLU MLP's ``w1`` / ``w3`` (gate, up: [inter, d]) and ``w2`` (down: [d, inter]) under ``prefix``."""
    return {f"{prefix}w1.weight": (inter, d), f"{prefix}w3.weight": (inter, d), f"{prefix}w2.weight": (d, inter)}
