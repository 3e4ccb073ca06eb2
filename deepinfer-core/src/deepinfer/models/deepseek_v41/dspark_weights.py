"""The DSpark drafter's tensors (``mtp.*``, shipped in the target checkpoint): names and shapes.

Names as released and as vLLM's ``DSparkDeepseekV4ForCausalLM.load_weights`` reads them (``_remap_dspark_name``):

- draft layer i (``mtp.{i}.``, i < ``num_nextn_predict_layers``): a V4.1 block under the backbone's names
  (``attn_norm``, ``ffn_norm``, ``hc_attn_*`` / ``hc_ffn_*``, ``attn.wq_a`` ... ``attn.attn_sink``, ``ffn.gate``,
  ``ffn.experts.{e}.w1|w2|w3`` for ``dspark_n_routed_experts`` experts, ``ffn.shared_experts``), sliding-only
  (no compressor or indexer);
- the context combiner on the first stage: ``mtp.0.main_proj.weight`` [D, len(targets)*D] and
  ``mtp.0.main_norm.weight`` [D];
- the head stack on the last stage: ``mtp.{n-1}.norm.weight`` [D], the Markov head ``markov_head.embed.weight``
  [V, r] (the previous token's rank-r code) and ``markov_head.head.weight`` [V, r] (code -> logit bias), and the
  confidence head ``confidence_head.proj.weight`` [1, D + r] (fp32, no bias: vLLM builds it with ``bias=False``).

The drafter has no embedding or head of its own: it reads the target's (vLLM and TensorRT-LLM alias them).
``ffn.gate.bias_vl`` (image tokens) may be present and is ignored, as in the backbone.
"""

from __future__ import annotations

from deepinfer.models.deepseek_v41.config import DeepseekV41Config
from deepinfer.models.layer_shapes import mlp_shapes, shared_layer_shapes

#: Optional tensors a released draft layer may carry that the text drafter does not read.
OPTIONAL_SUFFIXES = ("ffn.gate.bias_vl",)


def layer_prefix(i: int) -> str:
    return f"mtp.{i}."


def expected_mtp_shapes(cfg: DeepseekV41Config) -> dict[str, tuple[int, ...]]:
    """Every tensor the drafter reads, with its dense shape (empty without draft layers)."""
    n = cfg.num_nextn_predict_layers
    if n == 0:
        return {}
    d, inter, experts = cfg.hidden_size, cfg.moe_intermediate_size, cfg.dspark_n_routed_experts
    shapes: dict[str, tuple[int, ...]] = {}
    for i in range(n):
        p = layer_prefix(i)
        shapes.update(shared_layer_shapes(p, cfg, kv_norm="kv_norm"))
        f = p + "ffn."
        shapes.update({f + "gate.weight": (experts, d), f + "gate.bias": (experts,)})
        for e in [f"{f}experts.{e}." for e in range(experts)] + [f + "shared_experts."]:
            shapes.update(mlp_shapes(e, d, inter))
    first, last, r = layer_prefix(0), layer_prefix(n - 1), cfg.dspark_markov_rank
    shapes.update({
        first + "main_proj.weight": (d, len(cfg.dspark_target_layer_ids) * d),
        first + "main_norm.weight": (d,),
        last + "norm.weight": (d,),
        last + "markov_head.embed.weight": (cfg.vocab_size, r),
        last + "markov_head.head.weight": (cfg.vocab_size, r),
        last + "confidence_head.proj.weight": (1, d + r),
    })
    return shapes


def check_mtp(cfg: DeepseekV41Config, shapes: dict[str, tuple[int, ...]], source: str) -> None:
    """Raise ValueError listing every missing, unexpected or mis-shaped ``mtp.*`` tensor (``shapes``: what the
    checkpoint holds, dense shapes)."""
    expected = expected_mtp_shapes(cfg)
    problems = [f"{k}: missing (expected shape {v})" for k, v in expected.items() if k not in shapes]
    problems += [f"{k}: shape {shapes[k]}, expected {v}" for k, v in expected.items()
                 if k in shapes and tuple(shapes[k]) != v]
    problems += [f"{k}: unexpected tensor" for k in sorted(shapes)
                 if k not in expected and not k.endswith(OPTIONAL_SUFFIXES)]
    if problems:
        raise ValueError(f"{source}: the DSpark drafter's mtp.* tensors do not match the config "
                         f"(num_nextn_predict_layers={cfg.num_nextn_predict_layers}, "
                         f"{len(problems)} problems):\n  " + "\n  ".join(problems))
