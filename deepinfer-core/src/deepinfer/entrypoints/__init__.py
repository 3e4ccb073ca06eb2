"""Ways in: the ``deepinfer`` command line and the OpenAI-compatible HTTP server."""
