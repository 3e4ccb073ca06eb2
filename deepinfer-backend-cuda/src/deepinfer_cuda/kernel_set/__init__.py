"""Kernel sets: Triton kernels compiled ahead of time into cubins, a manifest, and their launcher.

``manifest`` (plain data), ``specialize`` (Triton's argument specialization, mirrored),
``compile`` (AOT, needs Triton but no GPU), ``cubin`` (cuda-python loader/launcher),
``dispatch`` (pick the cubin or fall back to Triton JIT).  See docs/cuda_backend.md.
"""
