"""Bad requests fail alone: an error output for the bad one, normal results for the rest of the call."""

from __future__ import annotations

import pytest

from deepinfer import LLM, SamplingParams
from tests.support.toy_model import ToyCausalLM, toy_tokenizer

GOOD = ["Once upon a time", "The quick brown fox"]
MAX_MODEL_LEN = 64


@pytest.fixture(scope="module")
def tokenizer():
    return toy_tokenizer()


@pytest.fixture(scope="module")
def llm(tokenizer):
    model = ToyCausalLM(len(tokenizer), seed=5)
    return LLM.from_model(model, tokenizer, max_model_len=MAX_MODEL_LEN, max_num_seqs=4, max_logprobs=5,
                          state_cache_bytes=model.state_bytes(MAX_MODEL_LEN) * 8)


@pytest.fixture(scope="module")
def reference(llm):
    return llm.generate(GOOD, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)


def _mutated(**fields):
    sp = SamplingParams(temperature=0, max_tokens=8)
    for k, v in fields.items():
        setattr(sp, k, v)
    return sp


CASES = {
    "empty text": ("", None, "prompt is empty"),
    "empty token list": ([], None, "prompt is empty"),
    "too long": ([5] * MAX_MODEL_LEN, None, f"max_model_len={MAX_MODEL_LEN}"),
    "token id too large": ([5, 400, 6], None, "outside the vocabulary [0, 400)"),
    "negative token id": ([5, -1], None, "outside the vocabulary"),
    "non-integer token": ([5, "a"], None, "not an integer token id"),
    "wrong prompt type": (3.5, None, "a prompt must be"),
    "params mutated to invalid": ("hello", _mutated(temperature=-1.0), "temperature must be"),
    "logprobs above max_logprobs": ("hello", SamplingParams(logprobs=6), "max_logprobs=5"),
    "stop token outside vocab": ("hello", SamplingParams(stop_token_ids=[1000]), "stop_token_ids [1000]"),
    "n above max_num_seqs": ("hello", SamplingParams(n=5), "max_num_seqs=4"),
    "invalid grammar": ("hello", SamplingParams(so_args={"regex": "a("}), "so_args['regex']: invalid regular"),
    "not a SamplingParams": ("hello", {"temperature": 0}, "must be a SamplingParams"),
    "unencodable text": ("lone \ud800 surrogate", None, "could not be encoded by the tokenizer"),
    "None prompt": (None, None, "a prompt must be"),
    "bool token": ([5, True], None, "not an integer token id"),
    "float token": ([5, 6.0], None, "not an integer token id"),
    "nested token list": ([5, [6, 7]], None, "not an integer token id"),
    "dict: token ids as text": ({"prompt_token_ids": "abc"}, None, "'prompt_token_ids' must be a list"),
    "dict: text as token ids": ({"prompt": [35, 36]}, None, "'prompt' must be a string"),
    "dict: None text": ({"prompt": None}, None, "'prompt' must be a string"),
    "dict: None token ids": ({"prompt_token_ids": None}, None, "'prompt_token_ids' must be a list"),
    "dict: bool token": ({"prompt_token_ids": [5, False]}, None, "not an integer token id"),
    "dict: nested token ids": ({"prompt_token_ids": [[5, 6]]}, None, "not an integer token id"),
    "dict: unknown key": ({"prompt": "hello", "multi_modal_data": {}}, None, "unknown key(s) ['multi_modal_data']"),
    "dict: misspelt key": ({"promt": "hello"}, None, "unknown key(s) ['promt']"),
    "dict: no key": ({}, None, "needs a 'prompt' (text) or 'prompt_token_ids' key"),
    "dict: text of wrong type": ({"prompt_token_ids": [5, 6], "prompt": 3}, None, "'prompt' must be a string"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_request_fails_alone(llm, reference, case, caplog):
    prompt, params, message = CASES[case]
    good = SamplingParams(temperature=0, max_tokens=8)
    prompts = [GOOD[0], prompt, GOOD[1]]
    outs = llm.generate(prompts, [good, params if params is not None else good, good], use_tqdm=False)
    assert len(outs) == 3
    bad = outs[1]
    assert bad.error is not None and message in bad.error
    assert bad.finished and bad.outputs == []
    assert any("rejected" in r.message for r in caplog.records)
    for out, ref in zip((outs[0], outs[2]), reference, strict=True):
        assert out.error is None and out.finished
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    assert not llm.engine.has_unfinished()


def test_sampling_params_list_of_wrong_length_raises(llm):
    with pytest.raises(ValueError, match="2 entries for 3 prompts"):
        llm.generate(GOOD + ["x"], [SamplingParams(), SamplingParams()], use_tqdm=False)


def test_prompt_forms(llm, tokenizer, reference):
    ids = tokenizer.encode(GOOD[0])
    forms = (GOOD[0], ids, tuple(ids), {"prompt": GOOD[0]}, {"prompt_token_ids": ids}, [ids],
             {"prompt_token_ids": ids, "prompt": GOOD[0]})  # vLLM's TokensPrompt may carry its text
    for form in forms:
        (out,) = llm.generate(form, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
        assert out.error is None, out.error
        assert out.prompt_token_ids == ids
        assert out.outputs[0].token_ids == reference[0].outputs[0].token_ids
    assert llm.generate({"prompt_token_ids": ids, "prompt": GOOD[0]}, use_tqdm=False)[0].prompt == GOOD[0]
    assert llm.generate([], use_tqdm=False) == []


def test_n_copies_that_cannot_fit_the_state_cache_fail_alone(tokenizer):
    model = ToyCausalLM(len(tokenizer), seed=5)
    small = LLM.from_model(model, tokenizer, max_model_len=32, state_cache_bytes=model.state_bytes(32) * 2)
    prompt = [5] * 25
    outs = small.generate([prompt, prompt], [SamplingParams(n=3), SamplingParams(n=2, max_tokens=4)], use_tqdm=False)
    assert "n=3 copies of a 25-token prompt" in outs[0].error
    assert outs[1].error is None and [len(c.token_ids) for c in outs[1].outputs] == [4, 4]


def test_engine_limits_are_validated(tokenizer):
    model = ToyCausalLM(len(tokenizer), seed=5)
    with pytest.raises(ValueError, match="max_num_seqs must be an integer >= 1"):
        LLM.from_model(model, tokenizer, max_num_seqs=0)
    with pytest.raises(ValueError, match="max_model_len must be an integer in"):
        LLM.from_model(model, tokenizer, max_model_len=10**9)
    with pytest.raises(ValueError, match="lower max_model_len or raise state_cache_bytes to at least 25600 "):
        LLM.from_model(model, tokenizer, max_model_len=100, state_cache_bytes=model.state_bytes(50))
    fitted = LLM.from_model(model, tokenizer, state_cache_bytes=model.state_bytes(50))
    assert fitted.engine.config.max_model_len == 50  # default lowered to what one sequence fits
