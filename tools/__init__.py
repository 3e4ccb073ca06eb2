"""Developer tools, run from the repository root as modules: ``python -m tools.bench.kernels``, ...

``bench/`` (benchmarks), ``sweep/`` (kernel tile sweeps), ``train/`` (the embedded tiny models and their training
references), ``fixtures/`` (tiny checkpoints for experiments), ``eval/`` (accuracy measurements for the docs);
``timing`` and ``ceilings`` are how every one of them measures.  Tests may import tools, never the reverse.
"""
