"""vLLM engine keywords for features DeepInfer has not built: what each asks for, and what to use instead.

A script written for vLLM often spells out defaults (``tensor_parallel_size=1``); those values ask for what
DeepInfer does anyway and are accepted.  Any other value raises ``ValueError`` with the message below, rather
than running something other than what was asked for.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

_PARALLEL = ("DeepInfer has no {what} yet: attention is data-parallel (each rank owns whole requests) and MoE experts "
             "are expert-parallel; use data_parallel_size=, expert_parallel_size= (and context_parallel_size= for "
             "long prefills) instead (docs/parallel.md). Leave {name} at 1")


@dataclass(slots=True, frozen=True)
class NotBuilt:
    #: Values that ask for what DeepInfer does anyway (vLLM's defaults or "off"); accepted silently.
    neutral: tuple[Any, ...]
    #: What DeepInfer offers instead.
    instead: str


NOT_BUILT: dict[str, NotBuilt] = {
    "tensor_parallel_size": NotBuilt((1,), _PARALLEL.format(what="tensor parallelism", name="tensor_parallel_size")),
    "pipeline_parallel_size": NotBuilt((1,), _PARALLEL.format(what="pipeline parallelism",
                                                              name="pipeline_parallel_size")),
    "enable_expert_parallel": NotBuilt((False,), "experts are split by expert_parallel_size=N (N ranks hold "
                                       "the experts between them); this vLLM switch is not read"),
    "enable_chunked_prefill": NotBuilt((True, None), "chunked prefill is always on; to prefill prompts whole, set "
                                       "max_num_batched_tokens >= max_model_len"),
    "quantization": NotBuilt((None,), "weights are used in the format the checkpoint stores (FP8 / MXFP4 as its "
                             "config.json's quantization_config says, else dtype); there is no on-the-fly "
                             "quantization"),
    "kv_cache_dtype": NotBuilt(("auto", None), "the state cache is kept in the model's dtype (set dtype=...), or, "
                               "for DeepSeek-V4.1, in the model's own FP8 / FP4 formats with DEEPINFER_QUANTIZED_KV=1 "
                               "(docs/models/deepseek_v41.md); there is no other cache format"),
    "speculative_config": NotBuilt((None,), "speculative decoding uses the checkpoint's own drafter (DSpark for "
                                   "DeepSeek-V4.1) and is configured by environment variables, not by this keyword: "
                                   "DEEPINFER_USE_NEXTN_DECODE=<max draft length> (0: off) and "
                                   "DEEPINFER_ENABLE_MTP_VARLEN=1 for confidence-scheduled verification "
                                   "(docs/spec_decode.md)"),
    "num_speculative_tokens": NotBuilt((None, 0), "the draft length is DEEPINFER_USE_NEXTN_DECODE=<max draft length> "
                                       "(0: off; docs/spec_decode.md)"),
    "trust_remote_code": NotBuilt((False,), "DeepInfer runs its own implementation of each supported model_type "
                                  "and never runs code shipped with a checkpoint"),
    "swap_space": NotBuilt((0, None), "preempted sequences are recomputed, never swapped to host memory; size the "
                           "state cache with state_cache_bytes or gpu_memory_utilization"),
    "cpu_offload_gb": NotBuilt((0, None), "DeepInfer keeps all weights on the device; there is no CPU offload"),
    "enable_lora": NotBuilt((False, None), "DeepInfer has no LoRA adapters yet"),
    "max_lora_rank": NotBuilt((None,), "DeepInfer has no LoRA adapters yet"),
    "max_loras": NotBuilt((None,), "DeepInfer has no LoRA adapters yet"),
    "block_size": NotBuilt((None,), "the state cache's page size is fixed by the model (16 compressed entries per "
                           "page for DeepSeek-V4); size the cache with state_cache_bytes or gpu_memory_utilization"),
    "download_dir": NotBuilt((None,), "weights download into the standard Hugging Face cache (set HF_HOME or "
                             "HF_HUB_CACHE to move it), or pass model='/path/to/checkpoint' for local weights"),
}


def _same(a: Any, b: Any) -> bool:
    """Equal and of the same type (so ``True`` is not taken for ``1``)."""
    return a is b or (type(a) is type(b) and a == b)


def refusal(name: str, value: Any) -> str | None:
    """Why ``name=value`` cannot be honoured, or None when it is not a not-built vLLM keyword or asks for nothing
    DeepInfer does not do already."""
    entry = NOT_BUILT.get(name)
    if entry is None or any(_same(value, n) for n in entry.neutral):
        return None
    return f"{name}={value!r} is a vLLM option DeepInfer does not support: {entry.instead}"
