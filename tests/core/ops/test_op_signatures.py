"""Building a table compares each override's (and coverage predicate's) signature with its reference's."""

from __future__ import annotations

import functools
import re

import pytest
import torch

from deepinfer.backends.cpu import CpuBackend
from deepinfer.ops import OpTable
from deepinfer.ops.norm import rms_norm as reference_rms_norm
from deepinfer.ops.rope import rope as reference_rope


def _rms_norm(x, weight, eps):
    return reference_rms_norm(x, weight, eps)


def test_same_names_kinds_and_defaults_are_accepted_whatever_the_annotations():
    def annotated(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
        return reference_rms_norm(x, weight, eps)

    def loosely_annotated(x: object, weight: object, eps: object) -> object:
        return reference_rms_norm(x, weight, eps)

    for impl in (_rms_norm, annotated, loosely_annotated):
        assert OpTable({"rms_norm": impl}, "ok").rms_norm is impl


@pytest.mark.parametrize("impl, shown", [
    (lambda x, w, eps: x, "(x, w, eps)"),                                       # a renamed parameter
    (lambda x, weight: x, "(x, weight)"),                                       # one missing
    (lambda x, weight, eps, out=None: x, "(x, weight, eps, out=None)"),         # one extra, even with a default
    (lambda x, weight, *, eps: x, "(x, weight, *, eps)"),                       # another kind
    (lambda x, eps, weight: x, "(x, eps, weight)"),                             # another order
])
def test_a_different_call_shape_is_rejected_naming_the_op_and_both_signatures(impl, shown):
    message = (f"backend 'bad' overrides op 'rms_norm' with signature {shown}, but the reference "
               "deepinfer.ops.norm.rms_norm takes (x, weight, eps)")
    with pytest.raises(TypeError, match=re.escape(message)):
        OpTable({"rms_norm": impl}, "bad")


def test_defaults_must_match():
    def rope_other_default(x, positions, inv_freq, attention_scaling=1.0, inverse=True):
        return reference_rope(x, positions, inv_freq, attention_scaling, inverse)

    def rope_no_default(x, positions, inv_freq, attention_scaling, inverse=False):
        return reference_rope(x, positions, inv_freq, attention_scaling, inverse)

    for impl in (rope_other_default, rope_no_default):
        with pytest.raises(TypeError, match=r"op 'rope' .* takes \(x, positions, inv_freq, attention_scaling=1\.0, "
                                            r"inverse=False\)"):
            OpTable({"rope": impl}, "bad")


def test_wrappers_are_checked_through_functools_wraps_and_refused_without_it():
    @functools.wraps(_rms_norm)
    def traced(*args, **kwargs):
        return _rms_norm(*args, **kwargs)

    def opaque(*args, **kwargs):
        return _rms_norm(*args, **kwargs)

    assert OpTable({"rms_norm": traced}, "ok").rms_norm is traced
    with pytest.raises(TypeError, match=re.escape("with signature (*args, **kwargs), but the reference")):
        OpTable({"rms_norm": opaque}, "bad")


def test_partial_and_bound_methods_are_read_through():
    class Kernels:
        def rms_norm(self, x, weight, eps):
            return reference_rms_norm(x, weight, eps)

    def tiled(tile, x, weight, eps):
        return reference_rms_norm(x, weight, eps)

    def with_tile(x, weight, eps, *, tile):
        return reference_rms_norm(x, weight, eps)

    OpTable({"rms_norm": Kernels().rms_norm}, "ok")
    OpTable({"rms_norm": functools.partial(tiled, 64)}, "ok")
    with pytest.raises(TypeError, match=r"signature \(x, weight, eps, \*, tile=64\)"):  # still an extra parameter
        OpTable({"rms_norm": functools.partial(with_tile, tile=64)}, "bad")


def test_an_unreadable_signature_is_rejected_with_a_hint():
    class NoSignature:
        __signature__ = "not a signature"  # inspect raises TypeError reading it

        def __call__(self, *args):
            return args[0]

    with pytest.raises(TypeError, match=r"op 'rms_norm' with .*whose signature cannot be read .* wrap it in a "
                                        r"Python function with the reference's signature \(x, weight, eps\)"):
        OpTable({"rms_norm": NoSignature()}, "bad")


def test_coverage_predicates_are_checked_too_and_must_belong_to_an_override():
    with pytest.raises(TypeError, match=re.escape("backend 'bad' declares op 'rms_norm''s coverage with signature "
                                                  "(x), but the reference")):
        OpTable({"rms_norm": _rms_norm}, "bad", coverage={"rms_norm": lambda x: True})
    with pytest.raises(ValueError, match=r"declares coverage of ops it does not override: \['rope'\]"):
        OpTable({"rms_norm": _rms_norm}, "bad", coverage={"rope": lambda *a: True})


class _WrongSignatureDroppedUnderTheFlag(CpuBackend):
    """An override the batch-invariant table would drop (rows, not declared invariant): still checked."""

    name = "wrong_dropped"

    def load_ops(self):
        return {"rms_norm": lambda x, w, eps: x}


@pytest.mark.parametrize("flag", ["0", "1"])
def test_for_backend_checks_every_override_the_backend_returns(flag, monkeypatch):
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", flag)
    with pytest.raises(TypeError, match=r"backend 'wrong_dropped' overrides op 'rms_norm' with signature "
                                        r"\(x, w, eps\)"):
        OpTable.for_backend(_WrongSignatureDroppedUnderTheFlag())
