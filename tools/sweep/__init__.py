"""Kernel sweeps: candidate tiles of one kernel timed on the GPU; the winners go into ``deepinfer_cuda/arch.py``."""
