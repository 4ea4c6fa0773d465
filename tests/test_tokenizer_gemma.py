"""GGUFTokenizer on a SentencePiece vocabulary (Gemma 3) against transformers' and llama.cpp's ids.

The fixture comes from tests/reference/make_gemma_tokenizer_fixtures.py; these tests need neither.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import pytest
from conftest import FIXTURES
from test_tokenizer import stream, write_variant

from inferno.file.reader import open_gguf
from inferno.text.tokenizer import GGUFTokenizer
from inferno.text.vocabulary import merges_as_strings

FIXTURE = json.loads((FIXTURES / "tokenizer_gemma3.json").read_text(encoding="utf-8"))
CASES = FIXTURE["cases"]
# Where the two references part, on Gemma's runs-of-spaces tokens, which the file spells with real spaces:
# llama.cpp matches them whole in the text, longest first (31 + 9 spaces), and never from a typed "▁";
# transformers respells them "▁▁..." and merges them like any token (16 + 24). We give transformers' ids.
REFERENCES_DIFFER = ["\u2581\u2581hello", "\u2581 \u2581", " " * 40 + "x"]


@pytest.fixture(scope="module")
def reader(gemma_path: Path) -> gguf.GGUFReader:
    return open_gguf(gemma_path)


@pytest.fixture(scope="module")
def tok(reader: gguf.GGUFReader) -> GGUFTokenizer:
    return GGUFTokenizer.from_gguf(reader)


def mismatches(expected: list[Any], actual: list[Any]) -> str:
    bad = [(case["text"], e, a) for case, e, a in zip(CASES, expected, actual, strict=True) if e != a]
    shown = "\n".join(f"{text!r}: expected {e!r}, got {a!r}" for text, e, a in bad[:5])
    return f"{len(bad)} of {len(expected)} differ:\n{shown}"


def test_fixture_has_a_broad_corpus_and_the_references_agree_but_on_runs_of_spaces() -> None:
    assert len(CASES) >= 300
    assert FIXTURE["transformers_and_llama_cpp_differ_on"] == REFERENCES_DIFFER


def test_encode_matches_transformers_and_llama_cpp(tok: GGUFTokenizer) -> None:
    actual = [tok.encode(case["text"]) for case in CASES]
    expected = [case["ids"] for case in CASES]
    assert actual == expected, mismatches(expected, actual)
    agreed = [case["ids"] if case["text"] in REFERENCES_DIFFER else case["llama_cpp_ids"] for case in CASES]
    assert actual == agreed, "llama.cpp: " + mismatches(agreed, actual)


def test_decode_and_stream_decode_match_transformers(tok: GGUFTokenizer) -> None:
    expected = [case["decoded"] for case in CASES]
    assert [tok.decode(case["ids"]) for case in CASES] == expected
    assert ["".join(stream(tok, case["ids"])) for case in CASES] == expected


def test_gemma3_properties(tok: GGUFTokenizer) -> None:
    assert (tok.bos_id, tok.eos_id, tok.add_bos, tok.vocab_size) == (2, 1, True, 262144)
    assert tok.encode("") == [2]
    assert tok.is_stop(1) and tok.is_stop(106)  # <eos>, <end_of_turn>
    assert tok.token_text(tok.encode(" capital")[1]) == " capital"


def test_byte_fallback_and_split_characters(tok: GGUFTokenizer) -> None:
    ids = tok.encode("\U0010ffff")  # in no vocabulary: four <0xNN> byte tokens
    assert [tok.token_text(i) for i in ids[1:]] == ["\\xf4", "\\x8f", "\\xbf", "\\xbf"]
    pieces = stream(tok, ids)
    assert pieces[1:4] == ["", "", ""] and pieces[4] == "\U0010ffff"


def test_a_llama_sentencepiece_file_matches_transformers(reader: gguf.GGUFReader, tmp_path: Path) -> None:
    """The same vocabulary as a llama file: merges ranked by score, and with add_space_prefix a ▁ first."""
    [variant] = FIXTURE["variants"]
    path = tmp_path / "variant.gguf"
    write_variant(reader, path, variant["overrides"])
    tokenizer = GGUFTokenizer.from_gguf(open_gguf(path))
    actual = [tokenizer.encode(case["text"]) for case in CASES]
    assert actual == variant["ids"], mismatches(variant["ids"], actual)
    assert [tokenizer.decode(ids) for ids in variant["ids"]] == variant["decoded"]


def test_the_prepared_models_tokenizer_is_the_same_tokenizer(tok: GGUFTokenizer) -> None:
    """Rebuilt from its state (as the prepared-model cache stores it): transformers' ids and text."""
    again = GGUFTokenizer.from_state(*tok.to_state())
    expected = [case["ids"] for case in CASES]
    actual = [again.encode(case["text"]) for case in CASES]
    assert actual == expected, mismatches(expected, actual)
    assert [again.decode(case["ids"]) for case in CASES] == [case["decoded"] for case in CASES]
    assert [again.token_bytes(i) for i in range(0, tok.vocab_size, 97)] == [
        tok.token_bytes(i) for i in range(0, tok.vocab_size, 97)]


def test_the_stored_json_is_what_tokenizers_writes(tok: GGUFTokenizer) -> None:
    """A SentencePiece tokenizer is built from the JSON to_state stores, as a byte-level one is: it holds
    what `tokenizers` itself writes for the tokenizer (merges "left right"), added tokens and ids too."""
    assert json.loads(tok.to_state()[1]) == json.loads(merges_as_strings(tok._tokenizer.to_str()))
