"""EngineArgs: one place for LLM's knobs; wrong types, unknown names and vLLM features not built are refused with
messages naming the argument, before any weights load."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from deepinfer import LLM, EngineArgs, SamplingParams
from deepinfer.engine import llm as llm_module
from deepinfer.engine.model_source import EMBEDDED_MODEL_DIR
from deepinfer.engine.unsupported import NOT_BUILT
from deepinfer.models import load_model
from deepinfer.ops import OpTable
from tests.support.toy_model import ToyCausalLM, toy_tokenizer


def test_defaults_are_written_once_and_reach_the_engine():
    args = EngineArgs()
    assert (args.max_num_seqs, args.max_num_batched_tokens, args.gpu_memory_utilization, args.seed) == (256, 8192,
                                                                                                        0.9, 0)
    tok = toy_tokenizer()
    llm = LLM.from_model(ToyCausalLM(len(tok), seed=1), tok)
    config = llm.engine.config
    assert (config.max_num_seqs, config.max_num_batched_tokens, config.seed, config.max_logprobs,
            config.enforce_eager, config.async_scheduling) == (args.max_num_seqs, args.max_num_batched_tokens,
                                                              args.seed, args.max_logprobs, args.enforce_eager,
                                                              args.async_scheduling)


@pytest.mark.parametrize(
    "kwargs, error, pattern",
    [
        # integers: floats, strings and bools are refused, not truncated or read as 0/1
        (dict(state_cache_bytes=1.5e9), TypeError, r"state_cache_bytes must be None or an integer >= 1, got float"),
        (dict(state_cache_bytes=4e9), TypeError, r"int\(4000000000.0\) if you meant 4000000000"),
        (dict(state_cache_bytes="1GB"), TypeError, "state_cache_bytes must be None or an integer >= 1, got str"),
        (dict(state_cache_bytes=0), ValueError, "state_cache_bytes must be None or an integer >= 1, got 0"),
        (dict(max_model_len="512"), TypeError, "max_model_len must be None or an integer >= 2, got str '512'"),
        (dict(max_model_len=1), ValueError, "max_model_len must be None or an integer >= 2, got 1"),
        (dict(seed=1.5), TypeError, "seed must be an integer, got float 1.5"),
        (dict(seed=True), TypeError, "seed must be an integer, got bool True"),
        (dict(max_logprobs=2.5), TypeError, r"max_logprobs must be an integer in \[0, 20\], got float"),
        (dict(max_logprobs=21), ValueError, r"max_logprobs must be an integer in \[0, 20\], got 21"),
        (dict(max_num_seqs=True), TypeError, "max_num_seqs must be an integer >= 1, got bool"),
        (dict(max_num_seqs=0), ValueError, "max_num_seqs must be an integer >= 1, got 0"),
        (dict(max_num_batched_tokens=None), TypeError, "max_num_batched_tokens must be an integer >= 1, got NoneType"),
        # flags: 'no' is truthy, 0/1 are not what a flag means
        (dict(enforce_eager="no"), TypeError, "enforce_eager must be True or False, got str 'no'"),
        (dict(async_scheduling=0), TypeError, "async_scheduling must be True or False, got int 0"),
        # fractions
        (dict(gpu_memory_utilization="0.5"), TypeError, r"gpu_memory_utilization must be a number in \(0, 1\]"),
        (dict(gpu_memory_utilization=1.5), ValueError, r"gpu_memory_utilization must be a number in \(0, 1\], got 1.5"),
        (dict(gpu_memory_utilization=0), ValueError, r"gpu_memory_utilization must be a number in \(0, 1\], got 0"),
        (dict(gpu_memory_utilization=float("nan")), ValueError, "gpu_memory_utilization must be a number"),
        # names and paths
        (dict(model=3), TypeError, r"model must be a path or name \(str or os.PathLike\) or None, got int"),
        (dict(tokenizer=""), ValueError, "tokenizer must not be empty"),
        (dict(revision=1), TypeError, "revision must be a string or None, got int"),
        # dtypes
        (dict(dtype="float8"), ValueError, r"dtype must be 'auto', one of \["),
        (dict(dtype=torch.int32), ValueError, "dtype must be 'auto'"),
        (dict(dtype=32), TypeError, "dtype must be 'auto'"),
    ],
)
def test_wrong_types_and_values_name_the_argument(kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        EngineArgs(**kwargs)


def test_values_are_normalised():
    args = EngineArgs(max_num_seqs=np.int64(4), gpu_memory_utilization=1, dtype=torch.bfloat16)
    assert type(args.max_num_seqs) is int and args.max_num_seqs == 4
    assert type(args.gpu_memory_utilization) is float
    assert args.dtype is torch.bfloat16


@pytest.mark.parametrize(
    "name, hint",
    [("max_num_seq", "max_num_seqs"), ("memory_utilization", "gpu_memory_utilization"),
     ("max_model_length", "max_model_len"), ("enforce_eagre", "enforce_eager")],
)
def test_unknown_keyword_names_the_closest_valid_one(name, hint):
    with pytest.raises(TypeError, match=rf"LLM\(\) got an unexpected keyword argument '{name}'; did you mean '{hint}'"):
        EngineArgs.from_kwargs({name: 1})


def test_unknown_keyword_without_a_close_name_lists_the_valid_ones():
    with pytest.raises(TypeError) as info:
        EngineArgs.from_kwargs({"frobnicate": 1})
    assert "did you mean" not in str(info.value) and "max_num_seqs" in str(info.value)


@pytest.mark.parametrize(
    "kwargs, says",
    [
        (dict(tensor_parallel_size=2), "no tensor parallelism yet"),
        (dict(pipeline_parallel_size=2), "no pipeline parallelism yet"),
        (dict(quantization="fp8"), "format the checkpoint stores"),
        (dict(speculative_config={"method": "mtp"}), "DEEPINFER_USE_NEXTN_DECODE=<max draft length>"),
        (dict(trust_remote_code=True), "never runs code shipped with a checkpoint"),
        (dict(kv_cache_dtype="fp8"), "model's dtype"),
        (dict(swap_space=4), "recomputed, never swapped"),
        (dict(enable_lora=True), "no LoRA"),
        (dict(enable_chunked_prefill=False), "max_num_batched_tokens >= max_model_len"),
    ],
)
def test_vllm_keywords_not_built_say_what_to_use(kwargs, says):
    ((name, value),) = kwargs.items()
    with pytest.raises(ValueError, match=rf"{name}={re.escape(repr(value))} is a vLLM option DeepInfer does not "
                                         rf"support: .*{re.escape(says)}"):
        EngineArgs.from_kwargs(kwargs)


def test_tensor_parallelism_points_at_the_parallel_sizes():
    with pytest.raises(ValueError, match="use data_parallel_size=, expert_parallel_size="):
        EngineArgs.from_kwargs({"tensor_parallel_size": 4})
    with pytest.raises(ValueError, match="expert_parallel_size=N"):
        EngineArgs.from_kwargs({"enable_expert_parallel": True})
    assert EngineArgs.from_kwargs({"data_parallel_size": 2}).data_parallel_size == 2


def test_vllm_keywords_asking_for_nothing_new_are_accepted():
    neutral = dict(tensor_parallel_size=1, trust_remote_code=False, quantization=None,
                   kv_cache_dtype="auto", enable_chunked_prefill=True, swap_space=0)
    assert EngineArgs.from_kwargs({**neutral, "max_num_seqs": 3}) == EngineArgs(max_num_seqs=3)
    with pytest.raises(ValueError, match="tensor_parallel_size=True"):  # True is not the neutral 1
        EngineArgs.from_kwargs({"tensor_parallel_size": True})
    assert all(entry.instead for entry in NOT_BUILT.values())


def test_enable_prefix_caching_is_a_flag():
    assert EngineArgs.from_kwargs({"enable_prefix_caching": True}).enable_prefix_caching is True
    assert EngineArgs().enable_prefix_caching is None  # resolved by LLM: on where exact (test_prefix_cache.py)
    assert EngineArgs.from_kwargs({"enable_prefix_caching": None}).enable_prefix_caching is None
    with pytest.raises(TypeError, match="enable_prefix_caching"):
        EngineArgs.from_kwargs({"enable_prefix_caching": "yes"})
    with pytest.raises(ValueError, match="not built for context parallelism"):
        EngineArgs(enable_prefix_caching=True, context_parallel_size=2)


def test_from_model_refuses_load_only_knobs_and_hints_its_own_keywords():
    tok = toy_tokenizer()
    model = ToyCausalLM(len(tok), seed=1)
    with pytest.raises(TypeError, match="LLM.from_model\\(\\) does not take dtype: the model is already built"):
        LLM.from_model(model, tok, dtype="float32")
    with pytest.raises(TypeError, match="did you mean 'backend'"):
        LLM.from_model(model, tok, backnd=None)
    with pytest.raises(ValueError, match="no tensor parallelism"):
        LLM.from_model(model, tok, tensor_parallel_size=2)
    with pytest.raises(TypeError, match="seed must be an integer"):
        LLM.from_model(model, tok, seed="1")


@pytest.fixture
def no_weights(monkeypatch):
    """``LLM(...)`` fails the test if it reaches the weights."""

    def refuse(*args, **kwargs):
        raise AssertionError("the weights were loaded before the arguments were checked")

    monkeypatch.setattr(llm_module, "load_model", refuse)


@pytest.mark.parametrize(
    "kwargs, error, pattern",
    [
        (dict(max_model_len=10**9), ValueError, r"max_model_len must be an integer in \[2, 1048576\] for this model"),
        (dict(max_model_len="512"), TypeError, "max_model_len must be None or an integer"),
        (dict(seed=1.5), TypeError, "seed must be an integer"),
        (dict(tensor_parallel_size=2), ValueError, "no tensor parallelism yet"),
        (dict(max_num_seq=4), TypeError, "did you mean 'max_num_seqs'"),
    ],
)
def test_llm_checks_arguments_before_loading_weights(no_weights, kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        LLM(str(EMBEDDED_MODEL_DIR), **kwargs)


def test_llm_takes_vllms_memory_fraction(monkeypatch):
    free = {}

    def memory_info(self, device):
        free["asked"] = True
        return 64 << 20, 128 << 20  # 64 MiB free: the default budget is capped by the fraction of it

    from deepinfer.backends import current_backend

    monkeypatch.setattr(type(current_backend()), "memory_info", memory_info)
    llm = LLM(str(EMBEDDED_MODEL_DIR), dtype="float32", gpu_memory_utilization=0.5)
    assert free["asked"] and llm.engine_args.gpu_memory_utilization == 0.5
    assert llm.engine.config.state_cache_bytes <= 32 << 20
    (out,) = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 4


@pytest.fixture(scope="module")
def embedded():
    model = load_model(EMBEDDED_MODEL_DIR, ops=OpTable(), dtype=torch.float32, device=torch.device("cpu"))
    return model, toy_tokenizer()


@pytest.mark.parametrize("max_num_seqs", [256, 1])
def test_the_minimum_state_budget_named_is_accepted(embedded, max_num_seqs):
    model, tok = embedded
    with pytest.raises(ValueError, match="raise state_cache_bytes to at least") as info:
        LLM.from_model(model, None, state_cache_bytes=1000, max_num_seqs=max_num_seqs)
    least = int(re.search(r"at least (\d+)", str(info.value)).group(1))
    llm = LLM.from_model(model, None, state_cache_bytes=least, max_num_seqs=max_num_seqs)
    assert llm.engine.config.max_model_len >= 2
    (out,) = llm.generate([[5]], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    assert out.error is None and len(out.outputs[0].token_ids) == 1
    with pytest.raises(ValueError):  # and it is the minimum: a byte less is refused
        LLM.from_model(model, None, state_cache_bytes=least - 1, max_num_seqs=max_num_seqs)
