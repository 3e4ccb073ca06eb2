"""Triton kernels of the CUDA backend, one module per core op they replace (plus helpers some of them share);
importing a module imports Triton.  Each op's wrapper registers itself with ``@override``
(:mod:`deepinfer_cuda.override`); :mod:`deepinfer_cuda.ops` imports every module here to collect them.
"""
