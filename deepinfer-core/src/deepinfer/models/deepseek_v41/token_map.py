"""Engram's compressed token map: token ids that normalise to the same text share one compressed id.

Derived from the tokenizer at load, as the reference does (spec §9.1): every id ``0 .. len(tokenizer) - 1``
(added and special tokens included) is decoded alone; a partial UTF-8 byte token (its text holds U+FFFD) is
keyed by its raw token string, any other by its normalised text (or the text itself if that normalises to
nothing).  Keys get compressed ids in order of first appearance.  The Engram tables are hashed over these ids,
so the map must have exactly the checkpoint's ``engram_compressed_vocab_size`` entries.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from deepinfer.models.config_fields import ConfigError

_SENTINEL = "\ue000"  # a private-use character: a token that is exactly one space survives Strip()


def _normalizer() -> Any:
    """NFKC, NFD, strip accents, lowercase, whitespace runs -> one space, strip both ends (a lone space kept)."""
    from tokenizers import Regex, normalizers

    return normalizers.Sequence([
        normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "), normalizers.Replace(Regex(r"^ $"), _SENTINEL),
        normalizers.Strip(), normalizers.Replace(_SENTINEL, " "),
    ])


@dataclass(slots=True, frozen=True)
class CompressedTokenMap:
    ids: tuple[int, ...]  # compressed id of every tokenizer id (len(tokenizer) entries)
    size: int  # number of distinct compressed ids

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, expected_size: int | None = None) -> CompressedTokenMap:
        """From a ``tokenizers.Tokenizer`` or a transformers tokenizer (its ``backend_tokenizer`` is used).
        ``expected_size``: the config's ``engram_compressed_vocab_size``; a map of another size raises."""
        backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
        normalize = _normalizer().normalize_str
        keys: dict[str, int] = {}
        ids = []
        count = backend.get_vocab_size(with_added_tokens=True) if backend is tokenizer else len(tokenizer)
        for token_id in range(count):
            text = backend.decode([token_id], skip_special_tokens=False)
            key = backend.id_to_token(token_id) if "\ufffd" in text else (normalize(text) or text)
            ids.append(keys.setdefault(key, len(keys)))
        token_map = cls(tuple(ids), len(keys))
        if expected_size is not None and token_map.size != expected_size:
            raise ConfigError(
                f"the tokenizer gives an Engram compressed vocabulary of {token_map.size} ids but "
                f"engram_compressed_vocab_size is {expected_size}: the Engram tables were hashed with another "
                "tokenizer (use the checkpoint's own tokenizer.json)")
        return token_map

    @classmethod
    def from_file(cls, path: str | Path, expected_size: int | None = None) -> CompressedTokenMap:
        """From ``tokenizer.json`` (a file, or the checkpoint directory holding it)."""
        from tokenizers import Tokenizer

        path = Path(path)
        return cls.from_tokenizer(Tokenizer.from_file(str(path / "tokenizer.json" if path.is_dir() else path)),
                                  expected_size)

    def lookup(self, vocab_size: int, pad_id: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """[max(vocab_size, len(tokenizer))] int64: the compressed id of every token id the model can see.

        Ids the tokenizer does not have (``len(tokenizer) <= id < vocab_size``: never produced from text, but
        possible in random-token tests) map to the compressed id of ``pad_id``, i.e. an n-gram through them hashes
        like one that starts before the sequence (the reference fails on them with an index error)."""
        if not 0 <= pad_id < len(self.ids):
            raise ConfigError(f"engram_pad_id {pad_id} is not a token id of the tokenizer ({len(self.ids)} ids)")
        table = torch.full((max(vocab_size, len(self.ids)),), self.ids[pad_id], dtype=torch.int64)
        table[: len(self.ids)] = torch.tensor(self.ids, dtype=torch.int64)
        return table.to(device)
