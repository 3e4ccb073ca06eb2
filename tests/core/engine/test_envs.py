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
        ("DEEPINFER_USE_NEXTN_DECODE", "0", r"DEEPINFER_USE_NEXTN_DECODE=0: must be in \[1, 16\]"),
        ("DEEPINFER_USE_NEXTN_DECODE", "five", r"expected an integer in \[1, 16\]"),
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
