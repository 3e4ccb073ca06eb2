"""The embedded tiny V4.1's trained DSpark drafter (``tools/train/tiny_dspark.py``): it loads, and its drafts are
accepted: offline speculative steps against the target's own greedy tokens on held-out sequences (the target
samples a prompt from BOS with a seed the training never used, then continues greedily)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deepinfer.models import load_model
from deepinfer.models.deepseek_v41.dspark import DSparkDrafter
from deepinfer.ops import OpTable
from tools.train.dspark_accept import generate, measure

ASSET = Path(__file__).parents[4] / "deepinfer-core" / "src" / "deepinfer" / "assets" / "tiny_v41"
#: Measured 4.92 on these 4 sequences (4.45 on the tool's 24 held-out ones; the most is dspark_block_size + 1 = 5).
MIN_ACCEPTANCE_LENGTH = 3.5

@pytest.fixture(scope="module")
def model():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield load_model(ASSET, ops=OpTable(), dtype=torch.float32, device=torch.device("cpu"))
    torch.set_num_threads(threads)


def test_the_embedded_drafter_loads(model):
    drafter = DSparkDrafter.from_model(model, num_slots=2)
    cfg = model.config
    assert drafter.max_draft_len == cfg.dspark_block_size and len(drafter.layers) == cfg.num_nextn_predict_layers


def test_the_embedded_drafter_is_accepted(model):
    heldout = generate(model, 4, 80, 8, 24, seed=4242, bos=model.config.bos_token_id or 0)
    result = measure(model, heldout, model.config.dspark_block_size)
    assert result["acceptance_length"] >= MIN_ACCEPTANCE_LENGTH, result
    confidence, accepted = result["mean_confidence"], result["per_position"]
    assert abs(confidence[0] - accepted[0]) <= 0.25, result  # the confidence head is roughly calibrated
