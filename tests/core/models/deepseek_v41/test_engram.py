"""Engram: the tokenizer-derived token map, the bucket layout and the hash ids against the fixtures' aux data;
look-back rows of a ragged, chunked step equal the whole sequence's; the module against a plain-torch formula."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from deepinfer.models.deepseek_v41 import ConfigError, DeepseekV41Config
from deepinfer.models.deepseek_v41.engram import EngramWeights, engram, engram_embed, local_rows
from deepinfer.models.deepseek_v41.engram_hash import EngramLayout, engram_lookback, history_after, is_prime
from deepinfer.models.deepseek_v41.token_map import CompressedTokenMap
from deepinfer.ops import OpTable

FIXTURES = Path(__file__).parents[3] / "fixtures" / "deepseek_v41"
OPS = OpTable()


def _fixture(name: str):
    path = FIXTURES / name
    cfg = DeepseekV41Config.from_file(path)
    aux = json.loads((path / "aux_engram_hashes.json").read_text())
    sequences = json.loads((path / "tokens.json").read_text())["sequences"]
    return path, cfg, aux, sequences


@pytest.fixture(scope="module", params=["tiny_a", "tiny_b"])
def fixture(request):
    path, cfg, aux, sequences = _fixture(request.param)
    token_map = CompressedTokenMap.from_file(path, cfg.engram_compressed_vocab_size)
    return cfg, aux, sequences, token_map


def _whole_lookback(ids: torch.Tensor, lookup: torch.Tensor, pad: int, n: int) -> torch.Tensor:
    rows = ids.shape[0]
    return engram_lookback(lookup[ids], torch.arange(rows), torch.zeros(rows, dtype=torch.int64),
                           torch.zeros(rows, n - 1, dtype=torch.int64), pad)


def test_token_map_is_the_references(fixture):
    cfg, aux, _, token_map = fixture
    assert list(token_map.ids) == aux["compressed_token_map"]
    assert token_map.size == aux["compressed_vocab_size"] == cfg.engram_compressed_vocab_size
    assert token_map.ids[cfg.engram_pad_id] == aux["pad_compressed_id"]


def test_token_map_from_a_transformers_tokenizer():
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    path = FIXTURES / "tiny_b" / "tokenizer.json"
    wrapped = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_file(str(path)))
    assert CompressedTokenMap.from_tokenizer(wrapped) == CompressedTokenMap.from_file(path)


def test_token_map_of_another_size_names_both_numbers():
    with pytest.raises(ConfigError, match="compressed vocabulary of 318 ids but engram_compressed_vocab_size is 99092"):
        CompressedTokenMap.from_file(FIXTURES / "tiny_b", 99092)


def test_lookup_pads_ids_the_tokenizer_lacks():
    token_map = CompressedTokenMap(ids=(0, 1, 2, 1, 3), size=4)
    assert token_map.lookup(8, pad_id=2).tolist() == [0, 1, 2, 1, 3, 2, 2, 2]
    assert token_map.lookup(3, pad_id=4).tolist() == [0, 1, 2, 1, 3]  # never shorter than the tokenizer
    with pytest.raises(ConfigError, match="engram_pad_id 5 is not a token id"):
        token_map.lookup(8, pad_id=5)


def test_layout_is_the_references(fixture):
    cfg, aux, _, _ = fixture
    layout = EngramLayout.from_config(cfg)
    assert [list(p) for p in layout.primes] == [sum(layer, []) for layer in aux["primes_per_layer_ngram_head"]]
    assert [list(o) for o in layout.offsets] == aux["bucket_offsets_per_layer"]
    assert [list(m) for m in layout.multipliers] == aux["hash_multipliers_per_layer"]


def test_released_table_sizes_are_the_sums_of_consecutive_primes():
    """48 consecutive primes from 16000000, 24 per layer: exactly the released engram_num_embeddings."""
    cfg = DeepseekV41Config.from_dict({"model_type": "deepseek_v41_text", "engram_layer_ids": [1, 14],
                                       "engram_num_embeddings": [384006168, 384016682]})
    layout = EngramLayout.from_config(cfg)
    primes = sum((list(p) for p in layout.primes), [])
    assert primes[0] == 16000057 and len(set(primes)) == 48 and primes == sorted(primes)
    assert not any(is_prime(c) for c in range(16000000, primes[-1]) if c not in primes)
    wrong = DeepseekV41Config.from_dict({"model_type": "deepseek_v41_text", "engram_layer_ids": [1, 14],
                                         "engram_num_embeddings": [384006168, 384016683]})
    with pytest.raises(ConfigError, match="gives layer 14 384016683 rows but its hash buckets need 384016682"):
        EngramLayout.from_config(wrong)


def test_is_prime():
    small = [n for n in range(200) if all(n % d for d in range(2, int(math.isqrt(n)) + 1)) and n > 1]
    assert [n for n in range(200) if is_prime(n)] == small
    assert is_prime(2**61 - 1) and not is_prime(3215031751)  # a strong pseudoprime to bases 2, 3, 5, 7


def test_hash_ids_of_sequence_2_are_the_references(fixture):
    cfg, aux, sequences, token_map = fixture
    layout = EngramLayout.from_config(cfg)
    lookup = token_map.lookup(cfg.vocab_size, cfg.engram_pad_id)
    lookback = _whole_lookback(torch.tensor(sequences[aux["sequence_index"]]), lookup,
                               token_map.ids[cfg.engram_pad_id], cfg.engram_max_ngram_size)
    ids = torch.stack([OPS.engram_hash(lookback, *layout.hash_tensors(i)) for i in range(len(cfg.engram_layer_ids))], 1)
    assert ids.tolist() == aux["hash_ids"]


def test_ragged_chunked_steps_carry_the_history(fixture):
    """Sequences split into chunks, each step a ragged batch of one chunk per sequence, the history carried by
    history_after: the same look-back rows as each sequence whole."""
    cfg, _, sequences, token_map = fixture
    n = cfg.engram_max_ngram_size
    lookup = token_map.lookup(cfg.vocab_size, cfg.engram_pad_id)
    pad = token_map.ids[cfg.engram_pad_id]
    chunks = [[37, 64, 1, 1, 1, 100, 96], [1, 2, 30, 31], [5, 1, 11], [60, 1, 1, 68]]  # sums: 300, 64, 17, 130
    whole = [_whole_lookback(torch.tensor(s), lookup, pad, n) for s in sequences]
    history = torch.full((len(sequences), n - 1), -7)  # a new sequence's history may hold anything
    done = [0] * len(sequences)
    got: list[list[torch.Tensor]] = [[] for _ in sequences]
    for step in range(max(len(c) for c in chunks)):
        live = [i for i, c in enumerate(chunks) if step < len(c)]
        lens = [chunks[i][step] for i in live]
        ids = torch.cat([torch.tensor(sequences[i][done[i] : done[i] + k]) for i, k in zip(live, lens, strict=True)])
        starts = torch.tensor([done[i] for i in live]).repeat_interleave(torch.tensor(lens))
        row_in_chunk = torch.cat([torch.arange(k) for k in lens])
        seq_rows = torch.tensor(live).repeat_interleave(torch.tensor(lens))
        lookback = engram_lookback(lookup[ids], starts + row_in_chunk, starts, history[seq_rows], pad)
        last_rows = torch.cumsum(torch.tensor(lens), 0) - 1
        history[live] = history_after(lookback, last_rows)
        for part, i in zip(lookback.split(lens), live, strict=True):
            got[i].append(part)
        for i, k in zip(live, lens, strict=True):
            done[i] += k
    for i, parts in enumerate(got):
        assert torch.equal(torch.cat(parts), whole[i]), f"sequence {i}"


def _quantized_table(rows: int, dim: int, gen: torch.Generator):
    """A table as FP8 with ue8m0 scales per 32 columns, and its exact dequantized twin."""
    table = torch.randn(rows, dim // 32, 32, generator=gen) * torch.exp2(torch.randint(-4, 4, (rows, dim // 32, 1),
                                                                                        generator=gen).float())
    exponent = torch.ceil(torch.log2(table.abs().amax(-1) / 448))
    fp8 = (table / torch.exp2(exponent)[..., None]).to(torch.float8_e4m3fn)
    twin = (fp8.float() * torch.exp2(exponent)[..., None]).view(rows, dim)
    return fp8.view(rows, dim), (exponent + 127).to(torch.uint8), twin


def test_engram_module_equals_the_formula():
    gen = torch.Generator().manual_seed(0)
    tokens, streams_n, dim, cols, head_dim, rows = 5, 3, 16, 4, 32, 50
    fp8, scale, table = _quantized_table(rows, head_dim, gen)
    wkv = torch.randn((streams_n + 1) * dim, cols * head_dim, generator=gen) / math.sqrt(cols * head_dim)
    q_w, k_w = 1 + 0.3 * torch.randn(2, streams_n, dim, generator=gen)
    streams = torch.randn(tokens, streams_n, dim, generator=gen)
    hash_ids = torch.randint(0, rows, (tokens, cols), generator=gen)
    out = engram(OPS, EngramWeights(table, None, wkv, q_w, k_w), streams, hash_ids, 1e-20)

    kv = table[hash_ids].flatten(1).double() @ wkv.double().T
    key, value = kv[:, : streams_n * dim].view(tokens, streams_n, dim), kv[:, streams_n * dim :]
    h = streams.double()
    dot = (h * (q_w * k_w).double() * key).sum(-1) / dim**0.5
    dot = dot / h.pow(2).mean(-1).add(1e-20).sqrt() / key.pow(2).mean(-1).add(1e-20).sqrt()
    gate = torch.sigmoid(dot.sign() * dot.abs().clamp(min=1e-6).sqrt())
    torch.testing.assert_close(out.double(), h + gate[..., None] * value[:, None, :], atol=1e-5, rtol=1e-5)

    # the same table stored as FP8 with its scales (raw e8m0 bytes or float8_e8m0fnu) gives the same bits
    for s in (scale, torch.exp2(scale.float() - 127).to(torch.float8_e8m0fnu)):
        assert torch.equal(engram(OPS, EngramWeights(fp8, s, wkv, q_w, k_w), streams, hash_ids, 1e-20), out)
    with pytest.raises(ValueError, match="FP8 Engram table needs its embed.scale"):
        engram(OPS, EngramWeights(fp8, None, wkv, q_w, k_w), streams, hash_ids, 1e-20)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_table_lookup_in_one_op_equals_gather_then_dequantize(dtype):
    """The local lookup (``ops.embedding_fp8``) and the stored-rows path a shard exchange takes (gather codes and
    scales, then ``dequant_fp8_block``) give the same bits, for e8m0 and fp32 scales."""
    gen = torch.Generator().manual_seed(1)
    fp8, scale, _ = _quantized_table(40, 64, gen)
    ids = torch.randint(0, 40, (6, 3), generator=gen)
    wkv = torch.zeros(1, 1, dtype=dtype)
    for s in (scale, scale.view(torch.float8_e8m0fnu), torch.rand(scale.shape, generator=gen)):
        weights = EngramWeights(fp8, s, wkv, wkv, wkv)
        one_op = engram_embed(OPS, weights, ids)
        assert one_op.dtype == dtype and one_op.shape == (6, 3 * 64)
        assert torch.equal(one_op.view(torch.uint8), engram_embed(OPS, weights, ids, local_rows).view(torch.uint8))
