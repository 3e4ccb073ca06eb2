"""DEEPINFER_* variables are validated with messages naming the variable and its range."""

import pytest

from deepinfer import envs


def test_defaults(monkeypatch):
    for var in ["DEEPINFER_ENABLE_MTP_VARLEN", "DEEPINFER_USE_NEXTN_DECODE", "DEEPINFER_BATCH_INVARIANT",
                "DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE", "DEEPINFER_YOCO_PREFILL_KEEP_TOKENS"]:
        monkeypatch.delenv(var, raising=False)
    assert envs.enable_mtp_varlen() is False
    assert envs.nextn_decode() == 5
    assert envs.batch_invariant() is False
    assert envs.yoco_prefill_truncation_mode() == "none"
    assert envs.yoco_prefill_keep_tokens() == 140


@pytest.mark.parametrize(
    "var, value, pattern",
    [
        ("DEEPINFER_BATCH_INVARIANT", "maybe", "DEEPINFER_BATCH_INVARIANT='maybe': expected one of 1/0"),
        ("DEEPINFER_USE_NEXTN_DECODE", "17", r"DEEPINFER_USE_NEXTN_DECODE=17: must be in \[0, 16\]"),
        ("DEEPINFER_USE_NEXTN_DECODE", "-1", r"DEEPINFER_USE_NEXTN_DECODE=-1: must be in \[0, 16\]"),
        ("DEEPINFER_USE_NEXTN_DECODE", "five", r"expected an integer in \[0, 16\]"),
        ("DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE", "loose", r"expected one of \('none', 'compact'\)"),
    ],
)
def test_invalid_values_name_the_variable(monkeypatch, var, value, pattern):
    monkeypatch.setenv(var, value)
    getter = {
        "DEEPINFER_BATCH_INVARIANT": envs.batch_invariant,
        "DEEPINFER_USE_NEXTN_DECODE": envs.nextn_decode,
        "DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE": envs.yoco_prefill_truncation_mode,
    }[var]
    with pytest.raises(ValueError, match=pattern):
        getter()


def test_batch_invariance_conflicts_with_mtp_varlen(monkeypatch):
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    monkeypatch.setenv("DEEPINFER_ENABLE_MTP_VARLEN", "1")
    with pytest.raises(ValueError, match="set DEEPINFER_ENABLE_MTP_VARLEN=0"):
        envs.check_consistency()
    monkeypatch.setenv("DEEPINFER_ENABLE_MTP_VARLEN", "0")
    envs.check_consistency()


def test_nextn_decode_zero_turns_drafting_off(monkeypatch):
    monkeypatch.setenv("DEEPINFER_USE_NEXTN_DECODE", "0")
    assert envs.nextn_decode() == 0


def test_spec_decode_reads_the_pair_with_whether_each_was_given(monkeypatch):
    monkeypatch.delenv("DEEPINFER_USE_NEXTN_DECODE", raising=False)
    monkeypatch.delenv("DEEPINFER_ENABLE_MTP_VARLEN", raising=False)
    assert envs.spec_decode() == envs.SpecDecodeEnv(5, False, False, False)
    monkeypatch.setenv("DEEPINFER_USE_NEXTN_DECODE", "0")
    monkeypatch.setenv("DEEPINFER_ENABLE_MTP_VARLEN", "1")
    assert envs.spec_decode() == envs.SpecDecodeEnv(0, True, True, True)


GARBAGE = {
    "DEEPINFER_ENABLE_MTP_VARLEN": ("perhaps", "DEEPINFER_ENABLE_MTP_VARLEN='perhaps': expected one of 1/0"),
    "DEEPINFER_USE_NEXTN_DECODE": ("lots", r"DEEPINFER_USE_NEXTN_DECODE='lots': expected an integer in \[0, 16\]"),
    "DEEPINFER_BATCH_INVARIANT": ("2", "DEEPINFER_BATCH_INVARIANT='2': expected one of 1/0"),
    "DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE": ("full", "DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE='full'"),
    "DEEPINFER_YOCO_PREFILL_KEEP_TOKENS": ("0", r"DEEPINFER_YOCO_PREFILL_KEEP_TOKENS=0: must be in \[1, "),
    "DEEPINFER_QUANTIZED_WEIGHTS": ("fp8", "DEEPINFER_QUANTIZED_WEIGHTS='fp8': expected one of"),
    "DEEPINFER_QUANTIZED_KV": ("fp8", "DEEPINFER_QUANTIZED_KV='fp8': expected one of 1/0"),
    "DEEPINFER_MXFP4_ACTIVATIONS": ("fp4", "DEEPINFER_MXFP4_ACTIVATIONS='fp4': expected one of"),
    "DEEPINFER_LOGGING_LEVEL": ("LOUD", "DEEPINFER_LOGGING_LEVEL='LOUD': expected one of"),
    "DEEPINFER_HF_MODEL_DIR": ("/no/such/checkpoint", "DEEPINFER_HF_MODEL_DIR='/no/such/checkpoint': not an existing"),
}


def test_every_variable_is_known_and_has_a_garbage_case():
    # (any text is a valid accelerator name, virtual environment or API key)
    assert set(GARBAGE) | {"DEEPINFER_ACCELERATOR", "DEEPINFER_VENV", "DEEPINFER_API_KEY"} == set(envs.VARIABLES)


@pytest.mark.parametrize("var", sorted(GARBAGE))
def test_garbage_fails_at_start_up_whether_or_not_the_feature_is_used(monkeypatch, var):
    from deepinfer import LLM
    from tests.support.toy_model import ToyCausalLM, toy_tokenizer

    value, pattern = GARBAGE[var]
    monkeypatch.setenv(var, value)
    with pytest.raises(ValueError, match=pattern):
        envs.validate()
    tok = toy_tokenizer()
    with pytest.raises(ValueError, match=pattern):  # e.g. no drafting in this engine, still refused
        LLM.from_model(ToyCausalLM(len(tok)), tok)


def test_logging_level_any_case(monkeypatch):
    import logging

    monkeypatch.delenv("DEEPINFER_LOGGING_LEVEL", raising=False)
    assert envs.logging_level() == logging.INFO
    monkeypatch.setenv("DEEPINFER_LOGGING_LEVEL", "debug")
    assert envs.logging_level() == logging.DEBUG
    monkeypatch.setenv("DEEPINFER_LOGGING_LEVEL", "WARNING")
    assert envs.logging_level() == logging.WARNING


def test_unknown_names_warn_with_the_closest_known_one(monkeypatch, caplog):
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIENT", "1")
    monkeypatch.setenv("DEEPINFER_SOMETHING_ELSE", "x")
    with caplog.at_level("WARNING", logger="deepinfer.envs"):
        envs.validate()
    assert envs.unknown_variables().items() >= {"DEEPINFER_BATCH_INVARIENT": "DEEPINFER_BATCH_INVARIANT",
                                                "DEEPINFER_SOMETHING_ELSE": None}.items()
    messages = [r.getMessage() for r in caplog.records]
    assert any("DEEPINFER_BATCH_INVARIENT is set" in m and "did you mean DEEPINFER_BATCH_INVARIANT?" in m
               for m in messages)
    assert any("DEEPINFER_SOMETHING_ELSE is set" in m and "did you mean" not in m for m in messages)


def test_overridden_restores_the_value_or_its_absence(monkeypatch):
    import os

    monkeypatch.delenv("DEEPINFER_MXFP4_ACTIVATIONS", raising=False)
    with envs.overridden("DEEPINFER_MXFP4_ACTIVATIONS", "fp8"):
        assert envs.mxfp4_activations() == "fp8"
    assert "DEEPINFER_MXFP4_ACTIVATIONS" not in os.environ
    monkeypatch.setenv("DEEPINFER_MXFP4_ACTIVATIONS", "bf16")
    with pytest.raises(RuntimeError), envs.overridden("DEEPINFER_MXFP4_ACTIVATIONS", "fp8"):
        raise RuntimeError
    assert os.environ["DEEPINFER_MXFP4_ACTIVATIONS"] == "bf16"
