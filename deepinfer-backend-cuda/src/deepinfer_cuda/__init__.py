"""DeepInfer backend for NVIDIA GPUs.  Importing this package imports no CUDA library."""
