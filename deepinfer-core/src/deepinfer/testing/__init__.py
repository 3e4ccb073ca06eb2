"""Test helpers that ship with core so backend packages (first- and third-party) can prove themselves."""

from deepinfer.testing.conformance import assert_close, check_backend, check_op, conformance_params, samples

__all__ = ["assert_close", "check_backend", "check_op", "conformance_params", "samples"]
