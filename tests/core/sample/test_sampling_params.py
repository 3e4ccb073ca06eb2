"""SamplingParams validation: every invalid value raises ValueError naming the field and its range."""

from __future__ import annotations

import pytest

from deepinfer import SamplingParams
from deepinfer.sampling_params import MAX_LOGPROBS


def test_defaults_are_valid_and_vllm_like():
    sp = SamplingParams()
    assert sp.n == 1 and sp.temperature == 1.0 and sp.max_tokens == 16 and not sp.greedy
    assert SamplingParams(temperature=0).greedy


@pytest.mark.parametrize(
    "kwargs, field, allowed",
    [
        (dict(n=0), "n", ">= 1"),
        (dict(n=1.5), "n", ">= 1"),
        (dict(temperature=-0.1), "temperature", ">= 0"),
        (dict(temperature=float("nan")), "temperature", ">= 0"),
        (dict(top_p=0.0), "top_p", "(0, 1]"),
        (dict(top_p=1.1), "top_p", "(0, 1]"),
        (dict(top_k=-2), "top_k", ">= 1"),
        (dict(top_k=2.0), "top_k", ">= 1"),
        (dict(min_p=1.5), "min_p", "[0, 1]"),
        (dict(presence_penalty=2.5), "presence_penalty", "[-2, 2]"),
        (dict(frequency_penalty=-3), "frequency_penalty", "[-2, 2]"),
        (dict(repetition_penalty=0), "repetition_penalty", "> 0"),
        (dict(max_tokens=0), "max_tokens", ">= 1"),
        (dict(min_tokens=-1), "min_tokens", ">= 0"),
        (dict(min_tokens=5, max_tokens=4), "min_tokens", "max_tokens=4"),
        (dict(stop=""), "stop", "non-empty"),
        (dict(stop=["a", 3]), "stop", "non-empty"),
        (dict(stop_token_ids=[1, -1]), "stop_token_ids", ">= 0"),
        (dict(logprobs=MAX_LOGPROBS + 1), "logprobs", f"[0, {MAX_LOGPROBS}]"),
        (dict(prompt_logprobs=-1), "prompt_logprobs", f"[0, {MAX_LOGPROBS}]"),
        (dict(seed=2**64), "seed", "[-2**63, 2**64)"),
        (dict(seq_seed="1"), "seq_seed", "[-2**63, 2**64)"),
        (dict(seed=1, seq_seed=2), "seed", "alias"),
        (dict(ignore_eos=1), "ignore_eos", "bool"),
        (dict(skip_special_tokens=None), "skip_special_tokens", "bool"),
        (dict(so_args={"regex": "a", "ebnf": "b"}), "so_args", "exactly one of 'regex'"),
        (dict(so_args={"grammar": "x"}), "so_args", "exactly one of 'regex'"),
        (dict(so_args="a+"), "so_args", "exactly one of 'regex'"),
        (dict(so_args={"regex": 3}), "so_args['regex']", "non-empty string"),
        (dict(so_args={"json_schema": 3}), "so_args['json_schema']", "a dict or a JSON string"),
    ],
)
def test_invalid_values_name_field_and_range(kwargs, field, allowed):
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    message = str(info.value)
    assert message.startswith(field) and allowed in message


def test_seed_alias_and_stop_normalisation():
    assert SamplingParams(seed=5).seq_seed == 5
    assert SamplingParams(seq_seed=6).seed == 6
    assert SamplingParams(seed=7, seq_seed=7).seq_seed == 7
    assert SamplingParams(stop="ab").stop_strings == ("ab",)
    assert SamplingParams(stop=["a", "b"]).stop_strings == ("a", "b")
    assert SamplingParams(top_k=-1).top_k == -1  # vLLM's "off"


def test_so_args_kept_verbatim():
    so = {"json_schema": {"type": "object"}}
    assert SamplingParams(so_args=so).so_args is so
