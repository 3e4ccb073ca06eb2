"""Benchmarks: kernels against core's reference ops, the V4 / V4.1-Flash slices, engine features."""
