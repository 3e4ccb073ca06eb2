"""lm-evaluation-harness scores a loglikelihood task through ``deepinfer serve`` (``/v1/completions`` with ``echo``
and ``logprobs``: the prompt's token logprobs), as ``lm_eval --model local-completions`` runs against vLLM.

Slow (lm_eval starts in ~20 s and scores each choice as one request); its fast sibling is
``test_serve_chat_tools.py::test_echo_gives_prompt_logprobs_as_lm_eval_reads_them``.  lm-eval is heavy (datasets,
pandas, scikit-learn), so it is not in the test extra: ``pip install 'lm-eval[api]'`` and run
``pytest -m slow tests/e2e/test_lm_eval.py``; without it the test skips.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from deepinfer.engine.model_source import EMBEDDED_MODEL_DIR

pytestmark = pytest.mark.slow

#: A story context, its right ending first, then an ending no story of the toy's corpus has.
DOCS = [
    ("Once upon a time, there was a little cat named", " Mia.", " tomorrow blue."),
    ("Lily and her mom went to the", " park.", " seven."),
    ("Tom had a big red", " ball.", " asked."),
    ('"Can you help me?" asked', " Max.", " very."),
    ("They played together until the sun went", " down.", " ball."),
    ("One day, Ben found a shiny key under a", " tree.", " happy."),
]
TASK = """task: tiny_story_endings
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: 0
metric_list:
  - metric: acc
"""


def test_lm_eval_local_completions_scores_a_multiple_choice_task(server_url, tmp_path):
    pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install 'lm-eval[api]')")
    pytest.importorskip("tenacity", reason="lm-eval's API models need its [api] extra")
    data = tmp_path / "endings.jsonl"
    data.write_text("".join(json.dumps({"context": c, "choices": [a, b]}) + "\n" for c, a, b in DOCS))
    (tmp_path / "tiny_story_endings.yaml").write_text(TASK.format(data=data))
    out = tmp_path / "results"
    model_args = (f"model=tiny,base_url={server_url}/v1/completions,tokenizer={EMBEDDED_MODEL_DIR},"
                  "tokenizer_backend=huggingface,num_concurrent=2,max_retries=1")
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    result = subprocess.run([sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args",
                             model_args, "--tasks", "tiny_story_endings", "--include_path", str(tmp_path),
                             "--output_path", str(out)], capture_output=True, text=True, env=env, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    (path,) = [p for p in Path(out).rglob("results*.json")]
    acc = json.loads(path.read_text())["results"]["tiny_story_endings"]["acc,none"]
    assert acc >= 5 / 6, acc  # the toy knows how its stories go
