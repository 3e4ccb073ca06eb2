"""The V4.1-Flash slice of ``tools.bench.v41_slice`` served by an engine (``LLM.from_model``), optionally with a
DSpark drafter of random weights at the slice's dims: engine-level benchmarks (prefix caching, speculative
decoding) on a GPU that holds no checkpoint.  ``tiny``: the same on the CPU at toy dims, with core's reference ops
(it tests the scripts).

The drafter has V4.1-Flash's DSpark fields (``DRAFTER``): 3 sliding-only draft layers reading the target's last
three layers, blocks of 5, Markov rank 256, 128 routed experts top-3 + 1 shared.  Like the target's layers, the draft
layers route over one shared stack of experts (:func:`slice_drafter`): built from the config they hold only a few.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tools.bench.steps import backend_for, jit_launches
from tools.bench.v41_slice import (
    FULL,
    SMALL,
    Shape,
    build_model,
    expert_stack,
    new_router,
    op_table,
    random_generator,
    read_stack,
)

#: V4.1-Flash's DSpark config fields at the slice's 8 layers (the released model: ``mtp.0..2`` reading layers
#: 37-39 of 40); ``dspark_n_routed_experts`` is what the config builds, :data:`DRAFT_EXPERTS` what they route over.
DRAFTER: dict[str, Any] = dict(
    num_nextn_predict_layers=3, compress_ratios=[*FULL.config["compress_ratios"], 0, 0, 0],
    dspark_target_layer_ids=[5, 6, 7], dspark_block_size=5, dspark_noise_token_id=128799, dspark_markov_rank=256,
    dspark_n_routed_experts=8, dspark_num_experts_per_tok=3,
)
#: The tiny CPU drafter: the tiny slice's vocabulary and toy Markov rank (as the embedded tiny V4.1's).
TINY_DRAFTER: dict[str, Any] = dict(DRAFTER, dspark_noise_token_id=3, dspark_markov_rank=32)
#: Routed experts of each draft layer: V4.1-Flash's 128, the tiny drafter's 8.
DRAFT_EXPERTS = {False: 128, True: 8}


def slice_shape(tiny: bool, drafter: bool = False) -> Shape:
    """The slice's shape (``tiny``: the CPU toy), with the DSpark draft layers in its config if ``drafter``."""
    shape = SMALL if tiny else FULL
    if drafter:
        shape = dataclasses.replace(shape, config={**shape.config, **(TINY_DRAFTER if tiny else DRAFTER)})
    return shape


def build_slice(tiny: bool, drafter: bool = False) -> Any:
    """The slice's model in bf16 with random weights (its ``mtp.*`` too if ``drafter``), on the shape's device."""
    return build_model(slice_shape(tiny, drafter), op_table(tiny))


def slice_llm(model: Any, **engine_args: Any) -> Any:
    """An engine over the built slice: its op table, and the backend of its device (CUDA graphs for decode steps
    on the GPU).  Prompts are token ids: no tokenizer.  ``engine_args``: ``LLM.from_model``'s."""
    from deepinfer import LLM

    return LLM.from_model(model, None, ops=model.ops, backend=backend_for(model.device.type), **engine_args)


def slice_drafter(model: Any, tiny: bool) -> Any:
    """The slice's DSpark drafter (``model.make_drafter()``: the engine's state pool must be configured), its
    draft layers routing over one shared stack of :data:`DRAFT_EXPERTS` experts + the shared one."""
    drafter = model.make_drafter()
    if drafter is None:
        raise ValueError("this slice was built without draft layers (build_slice(..., drafter=True))")
    cfg, experts = model.config, DRAFT_EXPERTS[tiny]
    rand, gen = random_generator(model.device.type, seed=1)
    stack = expert_stack(experts, cfg.hidden_size, cfg.moe_intermediate_size, rand)
    for layer in drafter.layers:
        new_router(layer.ffn, experts, rand, gen)
        read_stack(layer.ffn, stack)
    return drafter


def describe(model: Any) -> str:
    """The slice that runs, in words."""
    cfg = model.config
    return (f"V4.1-Flash slice ({cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
            f"{model.layers[0].ffn.spec.n_routed_experts} routed experts in one shared stack, window "
            f"{cfg.sliding_window}, random weights, {str(model.dtype).removeprefix('torch.')}) on {model.device}")


def describe_drafter(drafter: Any) -> str:
    """The slice's DSpark drafter, in words."""
    cfg = drafter.config
    return (f"DSpark drafter with random weights at the slice's dims ({len(drafter.layers)} draft layers reading "
            f"layers {list(cfg.dspark_target_layer_ids)}, {drafter.layers[0].ffn.spec.n_routed_experts} routed "
            f"experts top-{cfg.dspark_num_experts_per_tok} in one shared stack, block {cfg.dspark_block_size}, "
            f"Markov rank {cfg.dspark_markov_rank})")


def check_shared_stack(model: Any) -> str:
    """Raise if a layer no longer reads the shared expert stack (say the engine rebuilt its MoE); else say what
    every layer reads."""
    stacks = {id(layer.ffn.w13) for layer in model.layers}
    routed = {layer.ffn.spec.n_routed_experts for layer in model.layers}
    if len(stacks) != 1 or len(routed) != 1:
        raise RuntimeError(f"the slice's layers read {len(stacks)} expert stacks over {sorted(routed)} experts; "
                           "expected one shared stack")
    return f"every layer read the one stack of {model.layers[0].ffn.w13.shape[0]} experts (checked after the run)"


def jit_line(model: Any) -> str:
    """On the GPU, the kernels that ran through Triton JIT (no cubin in the kernel set); else empty."""
    if model.device.type != "cuda":
        return ""
    return f"kernel launches through Triton JIT (no cubin in the kernel set): {jit_launches() or 'none'}"
