"""Request bodies -> ``SamplingParams``: defaults, response_format, refusals naming the field."""

from __future__ import annotations

import pytest

from deepinfer.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, RequestFieldError
from deepinfer.sampling_params import RequestOutputKind


def test_completion_defaults_and_prompts():
    body = CompletionRequest(prompt="hi")
    params = body.sampling_params(body.max_tokens, body.logprobs)
    assert params.max_tokens == 16 and params.temperature == 1.0 and params.top_p == 1.0 and params.n == 1
    assert params.output_kind is RequestOutputKind.DELTA and params.so_args is None
    assert CompletionRequest(prompt=[1, 2]).prompts() == [[1, 2]]
    assert CompletionRequest(prompt=[[1], [2]]).prompts() == [[1], [2]]
    assert CompletionRequest(prompt=["a", "b"]).prompts() == ["a", "b"]
    with pytest.raises(RequestFieldError) as info:
        CompletionRequest(prompt=[]).prompts()
    assert info.value.param == "prompt"


def test_response_format_becomes_so_args():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    body = ChatCompletionRequest(messages=[], response_format={"type": "json_schema",
                                                                "json_schema": {"name": "x", "schema": schema}})
    assert body.sampling_params(None, None).so_args == {"json_schema": schema}
    body = ChatCompletionRequest(messages=[], response_format={"type": "json_object"})
    assert body.sampling_params(None, None).so_args == {"json_schema": {"type": "object"}}
    assert ChatCompletionRequest(messages=[], response_format={"type": "text"}).sampling_params(None, None).so_args \
        is None
    body = ChatCompletionRequest(messages=[], response_format={"type": "json_object"}, so_args={"regex": "a"})
    with pytest.raises(RequestFieldError) as info:
        body.sampling_params(None, None)
    assert info.value.param == "response_format"


def test_chat_limits_and_logprobs():
    body = ChatCompletionRequest(messages=[], max_completion_tokens=5, logprobs=True, top_logprobs=3)
    assert body.output_limit() == 5 and body.num_logprobs() == 3
    assert ChatCompletionRequest(messages=[], logprobs=True).num_logprobs() == 0
    assert ChatCompletionRequest(messages=[]).num_logprobs() is None
    with pytest.raises(RequestFieldError):
        ChatCompletionRequest(messages=[], max_tokens=1, max_completion_tokens=2).output_limit()


@pytest.mark.parametrize(("body", "param"), [
    (dict(suffix="x"), "suffix"), (dict(best_of=3), "best_of"),
    (dict(logit_bias={"1": 2.0}), "logit_bias"),
])
def test_unsupported_completion_fields_are_refused(body, param):
    req = CompletionRequest(prompt="x", **body)
    with pytest.raises(RequestFieldError) as info:
        req.sampling_params(req.max_tokens, req.logprobs)
    assert info.value.param == param


@pytest.mark.parametrize(("fields", "so_args"), [
    (dict(guided_json={"type": "object"}), {"json_schema": {"type": "object"}}),
    (dict(guided_regex="[a-z]+"), {"regex": "[a-z]+"}),
    (dict(guided_grammar='root ::= "a"'), {"ebnf": 'root ::= "a"'}),
    (dict(guided_choice=["yes", "no"]), {"ebnf": 'root ::= "yes" | "no"'}),
    (dict(structured_outputs={"json_object": True}), {"json_schema": {"type": "object"}}),
    (dict(structured_outputs={"choice": ["a \"b\""]}), {"ebnf": 'root ::= "a \\"b\\""'}),
])
def test_vllm_structured_output_names_become_so_args(fields, so_args):
    for request in (CompletionRequest(prompt="x", **fields), ChatCompletionRequest(messages=[], **fields)):
        assert request.sampling_params(None, None).so_args == so_args


@pytest.mark.parametrize(("fields", "param"), [
    (dict(guided_regex="a", guided_choice=["b"]), "guided_regex"),
    (dict(structured_outputs={"regex": "a", "grammar": "b"}), "structured_outputs"),
    (dict(structured_outputs={"structural_tag": "x"}), "structured_outputs"),
    (dict(guided_choice=[]), "guided_choice"),
    (dict(guided_json={"type": "object"}, response_format={"type": "json_object"}), "response_format"),
])
def test_conflicting_or_bad_structured_outputs_name_the_field(fields, param):
    with pytest.raises(RequestFieldError) as info:
        CompletionRequest(prompt="x", **fields).sampling_params(None, None)
    assert info.value.param == param


def test_offline_structured_outputs_params():
    from deepinfer import SamplingParams, StructuredOutputsParams

    params = SamplingParams(structured_outputs=StructuredOutputsParams(choice=["x", "y"]))
    assert params.so_args == {"ebnf": 'root ::= "x" | "y"'}
    with pytest.raises(ValueError, match="exactly one of"):
        SamplingParams(structured_outputs=StructuredOutputsParams(regex="a", json={}))
    with pytest.raises(ValueError, match="two forms of one setting"):
        SamplingParams(structured_outputs=StructuredOutputsParams(regex="a"), so_args={"regex": "b"})


def test_chat_request_takes_tools_and_reasoning_effort():
    body = ChatCompletionRequest(messages=[], tools=[{"type": "function", "function": {"name": "f"}}],
                                 tool_choice="required", parallel_tool_calls=False, reasoning_effort="high",
                                 chat_template_kwargs={"thinking": True})
    assert body.sampling_params(None, None).so_args is None  # the tool grammar is added by the chat layer
