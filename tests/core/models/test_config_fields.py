"""The shared field reader: what each read accepts, and one-line errors naming the file, the field (with its
section), what it takes and what was found.  JSON files are read with the file named, and never block."""

from __future__ import annotations

import os

import pytest

from deepinfer.models import CheckpointError, ConfigError
from deepinfer.models.checkpoint_files import check_json_files, read_json_object, regular_file
from deepinfer.models.config_fields import Fields

RAW = {"n": 4, "f": 4.0, "x": 0.5, "flag": True, "name": "yarn", "ids": [1, 2, 3], "words": ["a", "b"],
       "nothing": None, "sub": {"k": 2, "deeper": {"z": "q"}}}
F = Fields.of(RAW, "/ckpt/config.json")


def _error(read) -> str:
    with pytest.raises(ConfigError) as err:
        read()
    assert "\n" not in str(err.value)
    return str(err.value)


def test_values_that_fit_are_returned_typed():
    assert F.integer("n", lo=1, hi=4) == 4 and F.integer("f") == 4 and isinstance(F.integer("f"), int)
    assert F.number("x", lo=0, lo_open=True, hi=1) == 0.5 and F.number("n") == 4.0
    assert F.boolean("flag") is True and F.string("name", choices=("default", "yarn")) == "yarn"
    assert F.integers("ids", lengths=(3,), lo=1, hi=3) == (1, 2, 3) and F.strings("words", choices="ab") == ("a", "b")
    sub = F.section("sub")
    assert sub is not None and sub.integer("k") == 2 and sub.section("deeper").string("z") == "q"


def test_absent_and_null():
    assert F.integer("absent", 7) == 7 and F.number("absent", 1e-6) == 1e-6 and F.string("absent", "s") == "s"
    assert F.optional_integer("nothing") is None and F.optional_integer("nothing", 3) == 3
    assert F.optional_number("absent") is None and F.optional_string("nothing") is None
    assert F.optional_integers("nothing") is None and F.optional_strings("absent", ("d",)) == ("d",)
    assert F.section("nothing") is None and F.section("absent") is None
    assert not F.has("nothing") and not F.has("absent") and F.has("n")
    assert _error(lambda: F.integer("absent")) == "/ckpt/config.json: absent is missing; it must be an integer"
    assert _error(lambda: F.integer("nothing", 7, lo=0)) == (
        "/ckpt/config.json: nothing must be an integer >= 0, found null")  # a default does not cover null


@pytest.mark.parametrize(
    "read, message",
    [
        (lambda: F.integer("x"), "x must be an integer, found 0.5"),
        (lambda: F.integer("flag"), "flag must be an integer, found true"),
        (lambda: F.integer("name"), 'name must be an integer, found "yarn"'),
        (lambda: F.integer("n", lo=5), "n must be an integer >= 5, found 4"),
        (lambda: F.integer("n", lo=0, hi=3), "n must be an integer >= 0 and <= 3, found 4"),
        (lambda: F.number("name"), 'name must be a finite number, found "yarn"'),
        (lambda: F.number("x", lo=0.5, lo_open=True), "x must be a finite number > 0.5, found 0.5"),
        (lambda: F.number("n", hi=4, hi_open=True), "n must be a finite number < 4, found 4"),
        (lambda: F.boolean("n"), "n must be true or false, found 4"),
        (lambda: F.string("n"), "n must be a string, found 4"),
        (lambda: F.string("name", choices=("default",)), "name must be one of ['default'], found \"yarn\""),
        (lambda: F.integers("ids", lengths=(2, 4)),
         "ids must be a list of 2 or 4 entries of integers, found [1, 2, 3]"),
        (lambda: F.integers("ids", hi=2), "ids[2] must be an integer <= 2, found 3"),
        (lambda: F.integers("name"), 'name must be a list of integers, found "yarn"'),
        (lambda: F.strings("words", choices=("a",)), "words[1] must be one of ['a'], found \"b\""),
        (lambda: F.section("n"), "n must be a JSON object, found 4"),
        (lambda: F.section("sub").integer("k", lo=3), "sub.k must be an integer >= 3, found 2"),
        (lambda: F.section("sub").section("deeper").integer("z"), 'sub.deeper.z must be an integer, found "q"'),
        (lambda: F.section("sub").integer("gone"), "sub.gone is missing; it must be an integer"),
    ],
)
def test_errors_name_file_field_expectation_and_value(read, message):
    assert _error(read) == f"/ckpt/config.json: {message}"


def test_numbers_must_be_finite_and_long_values_are_cut():
    fields = Fields.of({"eps": float("inf"), "big": list(range(100))}, "c.json")
    assert _error(lambda: fields.number("eps")) == "c.json: eps must be a finite number, found Infinity"
    message = _error(lambda: fields.integers("big", lengths=(2,)))
    assert message.endswith("...") and len(message) < 160
    assert _error(lambda: Fields.of([1], "c.json")) == "c.json: must be a JSON object, found [1]"
    assert issubclass(ConfigError, CheckpointError) and issubclass(CheckpointError, ValueError)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this platform")
def test_json_files_are_regular_valid_and_objects_where_expected(tmp_path):
    (tmp_path / "config.json").write_text('{"a": 1}')
    (tmp_path / "tokenizer.json").write_text("[1]")  # any JSON value is fine here
    check_json_files(tmp_path)
    assert read_json_object(tmp_path / "config.json") == {"a": 1}
    (tmp_path / "generation_config.json").write_text("[1]")
    with pytest.raises(CheckpointError, match="generation_config.json: expected a JSON object at the top level"):
        check_json_files(tmp_path)
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": 1,,}')
    with pytest.raises(CheckpointError, match=r"generation_config.json: invalid JSON: .* at line 1 column 20"):
        check_json_files(tmp_path)
    (tmp_path / "generation_config.json").unlink()
    os.mkfifo(tmp_path / "tokenizer_config.json")  # reading it would block forever
    with pytest.raises(CheckpointError, match="tokenizer_config.json: expected a regular file, found a FIFO"):
        check_json_files(tmp_path)
    (tmp_path / "x.json").symlink_to(tmp_path / "missing")
    with pytest.raises(CheckpointError, match="x.json: does not exist \\(a broken symlink\\)"):
        regular_file(tmp_path / "x.json")
    (tmp_path / "bytes.json").write_bytes(b"\xff\xfe{")
    with pytest.raises(CheckpointError, match="bytes.json: cannot be read as UTF-8 text"):
        read_json_object(tmp_path / "bytes.json")
