"""Test helpers that ship with core so backend packages (first- and third-party) can prove themselves."""

from deepinfer.testing.conformance import (
    assert_close,
    assert_same_bits,
    batch_invariance_params,
    batch_invariant_table,
    check_backend,
    check_batch_invariance,
    check_coverage,
    check_impl_batch_invariance,
    check_op,
    conformance_params,
    coverage_params,
    samples,
)

__all__ = [
    "assert_close",
    "assert_same_bits",
    "batch_invariance_params",
    "batch_invariant_table",
    "check_backend",
    "check_batch_invariance",
    "check_coverage",
    "check_impl_batch_invariance",
    "check_op",
    "conformance_params",
    "coverage_params",
    "samples",
]
