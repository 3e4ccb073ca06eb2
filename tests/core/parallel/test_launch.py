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


def test_serving_refuses_several_ranks(capsys):
    from deepinfer.engine.async_llm import AsyncLLM
    from deepinfer.entrypoints.cli import main

    with pytest.raises(SystemExit) as info:
        main(["serve", "--data-parallel-size", "2"])
    assert info.value.code == 2 and "deepinfer serve runs one rank" in capsys.readouterr().err

    class Parallel:  # an LLM whose engine runs on several ranks
        parallel = object()

    with pytest.raises(ValueError, match="serves LLM.generate only"):
        AsyncLLM(Parallel())  # type: ignore[arg-type]


def test_streaming_refuses_several_ranks():
    tok = toy_tokenizer()
    llm = LLM.from_model(ToyCausalLM(len(tok), seed=1), tok)
    llm.parallel = object()  # type: ignore[assignment]
    with pytest.raises(NotImplementedError, match="with several ranks"):
        next(llm.generate_stream([[5, 6]]))
