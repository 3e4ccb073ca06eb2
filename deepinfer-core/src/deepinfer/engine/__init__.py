"""The offline engine: ``LLM`` → ``Engine`` (schedule → execute → process) over a ``CausalLM``."""
