"""``deepinfer bench``: offline throughput / latency and a serving benchmark (``docs/serving.md``)."""
