"""The load-time check of the V4.1 renderer against a checkpoint's ``encoding/tests`` vectors (``chat/vectors.py``).

``tests/fixtures/chat_v41/encoding/tests`` holds our own vectors in the released layout (a case with tools and
thinking mode, a bare message list, a case continuing a context), their expected prompts written out by hand.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from deepinfer.chat import ChatError, DeepseekV41Format, select_chat_format
from deepinfer.chat.vectors import check_checkpoint_vectors, check_vectors

VECTORS = Path(__file__).parents[2] / "fixtures" / "chat_v41" / "encoding" / "tests"


def _checkpoint(tmp_path: Path, tamper: bool = False) -> Path:
    shutil.copytree(VECTORS, tmp_path / "encoding" / "tests")
    if tamper:
        out = tmp_path / "encoding" / "tests" / "test_output_2.txt"
        out.write_text(out.read_text().replace("Tell me a joke.", "Tell me a joke!"))
    return tmp_path


def test_our_vectors_pass():
    assert check_vectors(VECTORS) == (None, 3)


def test_a_tampered_vector_is_refused_with_where_it_differs(tmp_path):
    refusal = check_checkpoint_vectors(_checkpoint(tmp_path, tamper=True))
    assert refusal is not None and "test_output_2.txt" in refusal and "chat is refused" in refusal
    assert "Tell me a joke!" in refusal and "never runs the checkpoint's encoding.py" in refusal


def test_a_case_without_a_mode_passes_in_either_mode(tmp_path):
    folder = _checkpoint(tmp_path) / "encoding" / "tests"
    assert "thinking_mode" not in (folder / "test_input_2.json").read_text()
    effort = "Reasoning Effort: 75 (range 1-100, the higher the value, the more thorough the reasoning)\n\n"
    (folder / "test_output_2.txt").write_text(  # the same conversation as the thinking-mode prompt
        "<｜begin▁of▁sentence｜><｜System｜>" + effort + "<｜User｜>Hello<｜Assistant｜></think>Hi! How can I help?"
        "<｜end▁of▁sentence｜><｜User｜>Tell me a joke.<｜Assistant｜><think>")
    assert check_vectors(folder) == (None, 3)


def test_the_engine_refuses_chat_for_a_checkpoint_whose_vectors_disagree(tmp_path):
    fmt = select_chat_format(None, "deepseek_v41", checkpoint=_checkpoint(tmp_path / "good"))
    assert isinstance(fmt, DeepseekV41Format) and fmt.refusal is None
    bad = select_chat_format(None, "deepseek_v41", checkpoint=_checkpoint(tmp_path / "bad", tamper=True))
    with pytest.raises(ChatError, match="chat is refused"):
        bad.render([{"role": "user", "content": "Hi"}], None, True, {})
    assert select_chat_format(None, "deepseek_v41", checkpoint=tmp_path).refusal is None  # no vectors: no check


def test_llm_loads_and_refuses_chat_only(tmp_path):
    from deepinfer import LLM, SamplingParams
    from tests.support.tiny_assets import TINY_V41_DIR

    if not (TINY_V41_DIR / "model.safetensors").is_file():
        pytest.skip("tiny_v41 asset not built")
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    for f in TINY_V41_DIR.iterdir():
        (ckpt / f.name).symlink_to(f)
    _checkpoint(ckpt, tamper=True)
    llm = LLM(str(ckpt), dtype="float32", max_model_len=64, max_num_seqs=1)
    assert llm.generate("Once", SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs  # plain text still runs
    with pytest.raises(ChatError, match="test_output_2.txt"):
        llm.chat([{"role": "user", "content": "Hi"}])
