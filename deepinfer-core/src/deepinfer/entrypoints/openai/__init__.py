"""The OpenAI-compatible API over ``AsyncLLM`` (``docs/serving.md``)."""
