"""A dense DSpark drafter (DeepSeek-V4.1's ``mtp.*``) in plain PyTorch: the oracle for DeepInfer's drafter and the
model the training tool optimises.

Written from the description (docs/spec_decode.md, drafter section), with no import from deepinfer; the blocks
(norms, mHC mixes, RoPE, the FP8 fake-quantizer, the MoE) are the dense V4.1 reference's
(``tools.train.v41_dense``).  Its ``state_dict`` has the released names (``mtp.{i}.attn.wq_a.weight``,
``mtp.0.main_proj.weight``, ``mtp.{n-1}.markov_head.embed.weight`` ...), so saving it into a checkpoint gives
what DeepInfer loads.

    features  = concat over target layers of mean_streams(layer output)       # [S, F], per target position
    main_x    = main_norm(main_proj(features))
    context_i = fp8(rope_main(kv_norm_i(wkv_i(main_x))))                        # per draft layer, per position
    a block anchored at position P (the anchor token sits there): rows P .. P+k-1 = [anchor, noise x (k-1)];
    each draft layer = single-pass mHC + attention + MoE, the attention's keys being context_i at positions
    [P - W, P) and the block's own latents (every block row sees every block row);
    hidden = collapse(streams, last FFN pre);  base logits = head(norm(hidden))
    step j: code = markov.embed[prev_j];  logits_j = base_j + markov.head @ code;  conf_j = sigmoid(w.[hidden_j, code])

Batched over blocks: ``contexts`` are one sequence's (or a batch of equal-length sequences') per-position
latents and ``anchors`` pick the blocks, so training runs many blocks per forward.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from tools.train import v41_dense as vd


@dataclass
class DSparkSpec:
    """The drafter's config fields (released names, without the ``dspark_`` prefix where it has one)."""

    num_layers: int = 3  # num_nextn_predict_layers
    block_size: int = 5
    noise_token_id: int = 128799
    target_layer_ids: list[int] = dataclasses.field(default_factory=lambda: [37, 38, 39])
    markov_rank: int = 256
    n_routed_experts: int = 128
    num_experts_per_tok: int = 3

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> DSparkSpec:
        d = (raw.get("text_config") or {}) if raw.get("model_type") == "deepseek_v41" else raw
        return cls(d["num_nextn_predict_layers"], d["dspark_block_size"], d["dspark_noise_token_id"],
                   list(d["dspark_target_layer_ids"]), d["dspark_markov_rank"], d["dspark_n_routed_experts"],
                   d["dspark_num_experts_per_tok"])

    def to_dict(self) -> dict[str, Any]:
        return {"num_nextn_predict_layers": self.num_layers, "dspark_block_size": self.block_size,
                "dspark_noise_token_id": self.noise_token_id, "dspark_target_layer_ids": list(self.target_layer_ids),
                "dspark_markov_rank": self.markov_rank, "dspark_n_routed_experts": self.n_routed_experts,
                "dspark_num_experts_per_tok": self.num_experts_per_tok}


class DraftAttention(nn.Module):
    """The backbone's sliding-window attention tensors; keys = the context window and the whole block."""

    def __init__(self, cfg: vd.V41Config):
        super().__init__()
        self.cfg = cfg
        D, H, Dh = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
        self.wq_a, self.q_norm = vd._linear(D, cfg.q_lora_rank), vd.RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.wq_b = vd._linear(cfg.q_lora_rank, H * Dh)
        self.wkv, self.kv_norm = vd._linear(D, Dh), vd.RMSNorm(Dh, cfg.rms_norm_eps)
        self.wo_a = vd._linear(H * Dh // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank)
        self.wo_b = vd._linear(cfg.o_groups * cfg.o_lora_rank, D)
        self.attn_sink = nn.Parameter(torch.zeros(H))

    def latents(self, x: Tensor, pos: Tensor, table, fake_quant: bool) -> Tensor:
        """K=V latents of rows ``x`` [..., S, D] at positions ``pos`` [S]: rotated (main RoPE), FP8."""
        return vd._fake(vd.rope(self.kv_norm(self.wkv(x)), pos, table), vd.fp8_e4m3_block32, fake_quant)

    def forward(self, x: Tensor, pos: Tensor, context: Tensor, visible: Tensor, table, fake_quant: bool) -> Tensor:
        """x [B, k, D] block rows at positions ``pos`` [B, k]; context [B, C, Dh] with ``visible`` [B, C]."""
        cfg = self.cfg
        B, k, _ = x.shape
        H, Dh = cfg.num_attention_heads, cfg.head_dim
        flat_pos = pos.flatten()
        q = self.wq_b(self.q_norm(self.wq_a(x))).flatten(0, 1).unflatten(-1, (H, Dh))[None]  # [1, B*k, H, Dh]
        q = vd.rope(q, flat_pos, table)
        own = self.latents(x.flatten(0, 1)[None], flat_pos, table, fake_quant)[0].view(B, k, Dh)
        keys = torch.cat([context, own], dim=1)  # [B, C + k, Dh]
        bias = torch.cat([torch.zeros_like(visible, dtype=vd._F32).masked_fill(~visible, -math.inf),
                          torch.zeros(B, k)], dim=1)  # the block is fully visible to itself
        q = q.view(B, k, H, Dh)
        scores = torch.einsum("bshd,btd->bhst", q.float(), keys.float()) * Dh**-0.5 + bias[:, None, None, :]
        sink = self.attn_sink.float().view(1, H, 1, 1).expand(B, H, k, 1)
        probs = torch.cat((scores, sink), -1).softmax(-1)[..., :-1]
        o = torch.einsum("bhst,btd->bshd", probs, keys.float()).to(x.dtype)
        o = vd.rope(o.flatten(0, 1)[None], flat_pos, table, inverse=True).view(B, k, H, Dh)
        G = cfg.o_groups
        o = torch.einsum("bsgi,goi->bsgo", o.reshape(B, k, G, -1), self.wo_a.weight.view(G, cfg.o_lora_rank, -1))
        return self.wo_b(o.flatten(2))


class MarkovHead(nn.Module):
    def __init__(self, vocab: int, rank: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, rank)  # the previous token's code
        self.head = vd._linear(rank, vocab)  # code -> logit bias


class ConfidenceHead(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.proj = vd._linear(width, 1)


class Stage(nn.Module):
    """``mtp.{i}``: one draft layer, plus the context combiner (first stage) and the heads (last stage)."""

    def __init__(self, cfg: vd.V41Config, draft_cfg: vd.V41Config, spec: DSparkSpec, first: bool, last: bool):
        super().__init__()
        D, hc, eps = cfg.hidden_size, cfg.hc_mult, cfg.rms_norm_eps
        self.cfg, self.attn_norm, self.ffn_norm = cfg, vd.RMSNorm(D, eps), vd.RMSNorm(D, eps)
        for site in ("attn", "ffn"):
            self.register_parameter(f"hc_{site}_fn", nn.Parameter(torch.zeros((2 + hc) * hc, hc * D)))
            self.register_parameter(f"hc_{site}_base", nn.Parameter(torch.zeros((2 + hc) * hc)))
            self.register_parameter(f"hc_{site}_scale", nn.Parameter(torch.ones(3)))
        self.attn, self.ffn = DraftAttention(cfg), vd.MoE(draft_cfg)
        if first:
            self.main_proj = vd._linear(len(spec.target_layer_ids) * D, D)
            self.main_norm = vd.RMSNorm(D, eps)
        if last:
            self.norm = vd.RMSNorm(D, eps)
            self.markov_head = MarkovHead(cfg.vocab_size, spec.markov_rank)
            self.confidence_head = ConfidenceHead(D + spec.markov_rank)

    def forward(self, streams: Tensor, pre_mix: Tensor, pos: Tensor, context: Tensor, visible: Tensor, table,
                fake_quant: bool) -> tuple[Tensor, Tensor]:
        cfg = self.cfg
        a_pre, a_post, a_comb = vd.hc_mixes(streams, self.hc_attn_fn, self.hc_attn_scale, self.hc_attn_base, cfg)
        y = self.attn(self.attn_norm(vd.collapse(streams, pre_mix)), pos, context, visible, table, fake_quant)
        streams = vd.expand(y, streams, a_post, a_comb)
        f_pre, f_post, f_comb = vd.hc_mixes(streams, self.hc_ffn_fn, self.hc_ffn_scale, self.hc_ffn_base, cfg)
        streams = vd.expand(self.ffn(self.ffn_norm(vd.collapse(streams, a_pre))), streams, f_post, f_comb)
        return streams, f_pre


class DSparkDense(nn.Module):
    """The drafter of a :class:`~tools.train.v41_dense.V41Model` (whose embedding and head it reads)."""

    def __init__(self, cfg: vd.V41Config, spec: DSparkSpec):
        super().__init__()
        self.cfg, self.spec = cfg, spec
        draft_cfg = dataclasses.replace(cfg, n_routed_experts=spec.n_routed_experts,
                                        num_experts_per_tok=spec.num_experts_per_tok)
        n = spec.num_layers
        self.mtp = nn.ModuleList(Stage(cfg, draft_cfg, spec, i == 0, i == n - 1) for i in range(n))
        self.table = vd.rope_table(cfg.rope_parameters["main"], cfg.head_dim)  # type: ignore[index]
        self.fake_quant = True

    # --- target side --------------------------------------------------------------------------------------
    @staticmethod
    def target_features(target: vd.V41Model, ids: Tensor, layer_ids: list[int]) -> tuple[Tensor, Tensor]:
        """(target logits [B, S, V], features [B, S, F]) of ``ids`` [B, S]: each target layer's output streams
        averaged over the mHC streams, concatenated in ``layer_ids`` order."""
        taken: dict[int, Tensor] = {}
        hooks = [target.layers[i].register_forward_hook(
            lambda _m, _a, out, i=i: taken.__setitem__(i, out[0].float().mean(2).to(out[0].dtype)))
            for i in layer_ids]
        try:
            logits = target(ids)
        finally:
            for h in hooks:
                h.remove()
        return logits, torch.cat([taken[i] for i in layer_ids], dim=-1)

    # --- drafter --------------------------------------------------------------------------------------------
    def contexts(self, features: Tensor) -> list[Tensor]:
        """Per draft layer, the context latents [B, S, Dh] of features [B, S, F] at positions 0..S-1."""
        first = self.mtp[0]
        main_x = first.main_norm(first.main_proj(features))
        pos = torch.arange(features.shape[1])
        return [stage.attn.latents(main_x, pos, self.table, self.fake_quant) for stage in self.mtp]

    def block(self, contexts: list[Tensor], seq: Tensor, anchors: Tensor, anchor_ids: Tensor, k: int,
              embed: Tensor, head: Tensor, visible: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """(hidden before the final norm [N, k, D], base logits [N, k, V] fp32) of N blocks: block n reads
        sequence ``seq[n]``'s contexts, its anchor token ``anchor_ids[n]`` sits at position ``anchors[n]``;
        ``visible`` [N, S] overrides which context positions a block sees (default: ``[P - W, P)``)."""
        cfg, W = self.cfg, self.cfg.sliding_window
        N = anchors.shape[0]
        ids = torch.full((N, k), self.spec.noise_token_id, dtype=torch.long)
        ids[:, 0] = anchor_ids
        pos = anchors[:, None] + torch.arange(k)
        S = contexts[0].shape[1]
        at = torch.arange(S)[None]
        if visible is None:
            visible = (at < anchors[:, None]) & (at >= anchors[:, None] - W)  # positions [P - W, P)
        streams = nn.functional.embedding(ids, embed)[:, :, None].expand(N, k, cfg.hc_mult, cfg.hidden_size)
        pre_mix = nn.functional.one_hot(torch.zeros(N, k, dtype=torch.long), cfg.hc_mult).to(vd._F32)
        for stage, ctx in zip(self.mtp, contexts, strict=True):
            streams, pre_mix = stage(streams, pre_mix, pos, ctx[seq], visible, self.table, self.fake_quant)
        hidden = vd.collapse(streams, pre_mix)
        last = self.mtp[-1]
        return hidden, nn.functional.linear(last.norm(hidden), head).float()

    def heads(self, hidden: Tensor, logits: Tensor, prev: Tensor) -> tuple[Tensor, Tensor]:
        """(step logits [.., V] = base + Markov bias of ``prev``, confidence logits [..] before the sigmoid)."""
        last = self.mtp[-1]
        code = last.markov_head.embed(prev)
        step = logits + last.markov_head.head(code).float()
        conf = last.confidence_head.proj(torch.cat([hidden.float(), code.float()], -1))[..., 0]
        return step, conf

    @torch.no_grad()
    def draft_greedy(self, hidden: Tensor, logits: Tensor, anchor_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Left to right at temperature 0: (tokens [N, k], confidence [N, k], step logits [N, k, V])."""
        prev, tokens, confs, steps = anchor_ids, [], [], []
        for j in range(logits.shape[1]):
            step, conf = self.heads(hidden[:, j], logits[:, j], prev)
            prev = step.argmax(-1)
            tokens.append(prev)
            confs.append(torch.sigmoid(conf))
            steps.append(step)
        return torch.stack(tokens, 1), torch.stack(confs, 1), torch.stack(steps, 1)


def init_random(drafter: DSparkDense, seed: int, scale: float = 0.3) -> None:
    """Random weights that make every path matter (non-trivial mHC, sinks, router bias)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith("_scale"):
                p.copy_(0.5 + torch.rand(p.shape, generator=gen))
            else:
                fan_in = p.shape[-1] if p.dim() > 1 else 1
                p.copy_(torch.randn(p.shape, generator=gen) * scale / math.sqrt(fan_in) * (4 if p.dim() > 1 else 1))


def mtp_state(drafter: DSparkDense) -> dict[str, Tensor]:
    """The ``mtp.*`` tensors (released names) to save into a checkpoint."""
    return {k: v.detach().contiguous() for k, v in drafter.state_dict().items() if k.startswith("mtp.")}


def write_drafter_checkpoint(folder: Path, source: Path, spec: DSparkSpec, seed: int
                             ) -> tuple[vd.V41Model, DSparkDense]:
    """A copy of the float checkpoint ``source`` with random ``mtp.*`` tensors (added to its
    ``model.safetensors``) and the drafter's config fields; returns the dense target and drafter it holds."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(spec.to_dict())
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    target = vd.load(folder)
    drafter = DSparkDense(target.cfg, spec)
    init_random(drafter, seed)
    tensors = load_file(str(folder / "model.safetensors"))
    save_file({**tensors, **mtp_state(drafter)}, str(folder / "model.safetensors"))
    return target, drafter.eval()
