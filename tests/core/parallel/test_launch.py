"""Who a process is among the ranks: torchrun's variables, or none (LLM starts its own)."""

from __future__ import annotations

import pytest

from deepinfer import LLM
from deepinfer.engine.rank_launch import RankEnv
from tests.support.toy_model import ToyCausalLM, toy_tokenizer


def test_torchrun_variables(monkeypatch):
    for name, value in dict(WORLD_SIZE="4", RANK="2", LOCAL_RANK="0", MASTER_ADDR="h", MASTER_PORT="1").items():
        monkeypatch.setenv(name, value)
    assert RankEnv.from_environ() == RankEnv(4, 2, 0, "env://")


def test_no_torchrun_means_self_launched(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert RankEnv.from_environ() is None


def test_half_a_torchrun_environment_is_refused(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    with pytest.raises(ValueError, match="MASTER_ADDR"):
        RankEnv.from_environ()


def test_from_model_refuses_parallel_sizes():
    tok = toy_tokenizer()
    with pytest.raises(TypeError, match="does not take data_parallel_size: ranks are started"):
        LLM.from_model(ToyCausalLM(len(tok), seed=1), tok, data_parallel_size=2)


def test_only_rank_zero_serves_and_only_the_others_follow():
    from types import SimpleNamespace

    from deepinfer.engine.async_llm import AsyncLLM

    tok = toy_tokenizer()
    llm = LLM.from_model(ToyCausalLM(len(tok), seed=1), tok)
    with pytest.raises(RuntimeError, match="runs on the ranks other than 0"):
        llm.follow()  # one process
    llm.parallel = SimpleNamespace(context=SimpleNamespace(plan=SimpleNamespace(rank=1)))  # type: ignore[assignment]
    with pytest.raises(ValueError, match="runs on rank 0; the other ranks run LLM.follow"):
        AsyncLLM(llm)


def test_streaming_refuses_several_ranks():
    tok = toy_tokenizer()
    llm = LLM.from_model(ToyCausalLM(len(tok), seed=1), tok)
    llm.parallel = object()  # type: ignore[assignment]
    with pytest.raises(NotImplementedError, match="with several ranks"):
        next(llm.generate_stream([[5, 6]]))
