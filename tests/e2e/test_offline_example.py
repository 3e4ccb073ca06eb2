"""``python examples/offline_inference.py`` runs offline on the embedded tiny model and prints text: completions and
chat replies (the DeepSeek-V4.1 chat format, which the toy was trained on)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.tiny_assets import known_words

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "offline_inference.py"


def test_offline_example_prints_completions(tmp_path):
    from deepinfer.engine.model_source import EMBEDDED_MODEL_DIR

    if not (EMBEDDED_MODEL_DIR / "model.safetensors").is_file():
        pytest.skip("the embedded tiny_v41 checkpoint is not in this checkout yet")
    env = {k: v for k, v in os.environ.items() if k != "DEEPINFER_HF_MODEL_DIR"}
    # Offline, with an empty HF cache: the fresh-machine case.
    env.update(HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"), DEEPINFER_ACCELERATOR="cpu")
    result = subprocess.run([sys.executable, str(EXAMPLE), "--max-tokens", "24"], env=env, cwd=tmp_path,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "embedded tiny DeepSeek-V4.1 checkpoint" in result.stderr  # the one log line
    outputs = [line for line in result.stdout.splitlines() if line.startswith("Output: ")]
    assert len(outputs) == 4
    texts = [line[len("Output: "):].rsplit("  [", 1)[0].strip("'\"") for line in outputs]
    assert all(len(t.strip()) > 0 for t in texts), outputs
    words = " ".join(texts).split()  # sampled (temperature 0.8), yet story words: the model is trained
    assert sum(w in known_words() for w in words) >= 0.8 * len(words), texts
    replies = [line[len("Reply: "):].strip("'\"") for line in result.stdout.splitlines() if line.startswith("Reply: ")]
    assert len(replies) == 2 and all(len(r.split()) >= 10 for r in replies), replies
    words = " ".join(replies).split()  # a story back, not chat markup
    assert sum(w in known_words() for w in words) >= 0.8 * len(words), replies


@pytest.mark.slow  # starts 2 ranks with torchrun (~15 s); tests/core/parallel runs the same paths in forked ranks
def test_offline_example_under_torchrun_prints_what_one_process_prints(tmp_path):
    from deepinfer.engine.model_source import EMBEDDED_MODEL_DIR

    if not (EMBEDDED_MODEL_DIR / "model.safetensors").is_file():
        pytest.skip("the embedded checkpoint is not in this checkout yet")
    env = {k: v for k, v in os.environ.items() if k not in ("DEEPINFER_HF_MODEL_DIR", "WORLD_SIZE")}
    env.update(HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"), DEEPINFER_ACCELERATOR="cpu")
    args = [str(EXAMPLE), "--max-tokens", "12"]
    one = subprocess.run([sys.executable, *args], env=env, cwd=tmp_path, capture_output=True, text=True,
                         timeout=300)
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", *args,
                          "--data-parallel-size", "2", "--expert-parallel-size", "2"], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert one.returncode == 0 and two.returncode == 0, two.stderr[-3000:]
    outputs = [line for line in two.stdout.splitlines() if line.startswith("Output: ")]
    assert len(outputs) == 4  # rank 0 prints, once
    assert outputs == [line for line in one.stdout.splitlines() if line.startswith("Output: ")]
    replies = [line for line in two.stdout.splitlines() if line.startswith("Reply: ")]
    assert len(replies) == 2 and replies == [line for line in one.stdout.splitlines() if line.startswith("Reply: ")]
