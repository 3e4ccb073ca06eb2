"""One ``deepinfer serve`` on the embedded model for all end-to-end server tests (it takes seconds to start)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def server_url(tmp_path_factory):
    from deepinfer.engine.model_source import EMBEDDED_MODEL_DIR
    from tests.support.server import running_server

    if not (EMBEDDED_MODEL_DIR / "model.safetensors").is_file():
        pytest.skip("the embedded checkpoint is not in this checkout")
    log = tmp_path_factory.mktemp("serve") / "server.log"
    with running_server("--dtype", "float32", "--max-num-seqs", "16", "--served-model-name", "tiny", log=log) as url:
        yield url
