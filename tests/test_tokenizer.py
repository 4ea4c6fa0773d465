"""GGUFTokenizer against ids, decodes and chat renderings recorded from Hugging Face transformers.

The fixture comes from tests/reference/make_tokenizer_fixtures.py; these tests need no transformers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import pytest

from inferno.errors import InfernoError
from inferno.file.reader import open_gguf
from inferno.text.tokenizer import GGUFTokenizer, StreamDecoder
from inferno.text.vocabulary import CONTROL, USER_DEFINED, merges_as_strings

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = json.loads((ROOT / "tests" / "fixtures" / "tokenizer_smollm2.json").read_text(encoding="utf-8"))
CASES = FIXTURE["cases"]

@pytest.fixture(scope="module")
def model_reader(model_path: Path) -> gguf.GGUFReader:
    return open_gguf(model_path)


@pytest.fixture(scope="module")
def tok(model_reader: gguf.GGUFReader) -> GGUFTokenizer:
    return GGUFTokenizer.from_gguf(model_reader)


def stream(tokenizer: GGUFTokenizer, ids: list[int]) -> list[str]:
    decoder = StreamDecoder(tokenizer)
    return [decoder.add(i) for i in ids] + [decoder.flush()]


def mismatches(expected: list[Any], actual: list[Any]) -> str:
    bad = [(case["text"], e, a) for case, e, a in zip(CASES, expected, actual, strict=True) if e != a]
    shown = "\n".join(f"{text!r}: expected {e!r}, got {a!r}" for text, e, a in bad[:5])
    return f"{len(bad)} of {len(expected)} differ:\n{shown}"


def test_fixture_has_a_broad_corpus() -> None:
    assert len(CASES) >= 200
    assert any(case["text"] == "" for case in CASES)


def test_encode_matches_transformers(tok: GGUFTokenizer) -> None:
    expected = [case["ids"] for case in CASES]
    actual = [tok.encode(case["text"]) for case in CASES]
    assert actual == expected, mismatches(expected, actual)


def test_the_prepared_models_tokenizer_is_the_same_tokenizer(tok: GGUFTokenizer) -> None:
    """Rebuilt from its state as the prepared-model cache stores it, merges written "left right":
    transformers' ids and text."""
    state, tokenizer_json = tok.to_state()
    assert all(isinstance(m, str) for m in json.loads(tokenizer_json)["model"]["merges"])
    again = GGUFTokenizer.from_state(state, tokenizer_json)
    expected = [case["ids"] for case in CASES]
    actual = [again.encode(case["text"]) for case in CASES]
    assert actual == expected, mismatches(expected, actual)
    assert [again.decode(case["ids"]) for case in CASES] == [case["decoded"] for case in CASES]


def test_merges_holding_a_space_stay_pairs() -> None:
    """"a b" cannot name the merge of "a b" and "c": such merges keep tokenizers' [left, right] form."""
    spaced = json.dumps({"model": {"type": "BPE", "merges": [["a", "b"], ["a b", "c"]]}})
    assert merges_as_strings(spaced) == spaced
    for odd in ([["a", ""]], [["a", 1]], [["a", "b", "c"]], {"a": "b"}, "a b"):  # left as they are
        text = json.dumps({"model": {"type": "BPE", "merges": odd}})
        assert merges_as_strings(text) == text
    plain = json.dumps({"model": {"type": "BPE", "merges": [["a", "b"], ["ab", "\n"]]}})
    assert json.loads(merges_as_strings(plain))["model"]["merges"] == ["a b", "ab \n"]


def test_the_stored_json_is_what_tokenizers_writes(tok: GGUFTokenizer) -> None:
    """The JSON a byte-level tokenizer is built from (and to_state stores) holds what `tokenizers` itself
    writes for that tokenizer, merges "left right": the same vocabulary, merges, added tokens and parts."""
    assert json.loads(tok.to_state()[1]) == json.loads(merges_as_strings(tok._tokenizer.to_str()))


def test_decode_matches_transformers(tok: GGUFTokenizer) -> None:
    expected = [case["decoded"] for case in CASES]
    actual = [tok.decode(case["ids"]) for case in CASES]
    assert actual == expected, mismatches(expected, actual)
    round_trips = [case for case in CASES if case["decoded"] == case["text"]]
    assert len(round_trips) > 0.9 * len(CASES)
    for case in round_trips:
        assert tok.decode(tok.encode(case["text"])) == case["text"]


@pytest.mark.parametrize("chat", FIXTURE["chats"], ids=lambda chat: f"{len(chat['messages'])}msg")
def test_chat_template_matches_transformers(tok: GGUFTokenizer, chat: dict[str, Any]) -> None:
    rendered = tok.apply_chat_template(chat["messages"], add_generation_prompt=chat["add_generation_prompt"])
    assert rendered == chat["rendered"]


def test_stream_decoder_reproduces_full_decode(tok: GGUFTokenizer) -> None:
    expected = [case["decoded"] for case in CASES]
    actual = ["".join(stream(tok, case["ids"])) for case in CASES]
    assert actual == expected, mismatches(expected, actual)


def test_stream_decoder_holds_back_a_split_character(tok: GGUFTokenizer) -> None:
    ids = tok.encode("a😀")
    assert len(ids) > 2, "the emoji should take several byte-level tokens"
    pieces = stream(tok, ids)
    assert pieces[0] == "a"
    assert pieces[1:-2] == [""] * (len(ids) - 2)
    assert pieces[-2:] == ["😀", ""]


def test_stream_decoder_flushes_a_cut_off_character_like_decode(tok: GGUFTokenizer) -> None:
    ids = tok.encode("x👨‍👩‍👧 y")
    for end in range(len(ids) + 1):
        assert "".join(stream(tok, ids[:end])) == tok.decode(ids[:end])


def test_smollm2_properties(tok: GGUFTokenizer) -> None:
    assert (tok.bos_id, tok.eos_id, tok.add_bos, tok.vocab_size) == (1, 2, False, 49152)
    assert tok.encode("<|im_start|>user\nhi<|im_end|>")[0] == 1
    # <|im_end|> is EOS; <|endoftext|> ends generation in llama.cpp too
    assert [i for i in range(100) if tok.is_stop(i)] == [0, 2]


def test_token_text_is_readable(tok: GGUFTokenizer) -> None:
    the = tok.encode(" the")
    assert len(the) == 1
    assert tok.token_text(the[0]) == " the"
    assert tok.token_text(1) == "<|im_start|>"
    first_byte = tok.encode("😀")[0]
    assert tok.token_text(first_byte).startswith("\\x")


def test_chat_template_default_adds_generation_prompt(tok: GGUFTokenizer) -> None:
    rendered = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert rendered.endswith("<|im_start|>assistant\n")


def write_variant(source: gguf.GGUFReader, path: Path, overrides: dict[str, Any]) -> None:
    """The same file tests/reference/make_tokenizer_fixtures.py tokenized with transformers."""
    writer = gguf.GGUFWriter(path, "llama")
    for key, field in source.fields.items():
        if key.startswith("tokenizer.") and key not in overrides:
            sub_type = field.types[-1] if len(field.types) > 1 else None
            writer.add_key_value(key, field.contents(), field.types[0], sub_type)
    for key, value in overrides.items():
        vtype = gguf.GGUFValueType.BOOL if isinstance(value, bool) else gguf.GGUFValueType.STRING
        writer.add_key_value(key, value, vtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()


@pytest.mark.parametrize("variant", FIXTURE["variants"], ids=lambda v: v["overrides"]["tokenizer.ggml.pre"])
def test_other_pre_tokenizers_match_transformers(
    model_reader: gguf.GGUFReader, tmp_path: Path, variant: dict[str, Any]
) -> None:
    path = tmp_path / "variant.gguf"
    write_variant(model_reader, path, variant["overrides"])
    tokenizer = GGUFTokenizer.from_gguf(open_gguf(path))
    actual = [tokenizer.encode(case["text"]) for case in CASES]
    assert actual == variant["ids"], mismatches(variant["ids"], actual)


# Tiny hand-made vocabularies: no model file needed.

TINY_TOKENS = ["<s>", "</s>", "<think>", "a", "b", "ab", "Ġ", "Ġab"]
TINY_TYPES = [CONTROL, CONTROL, USER_DEFINED, 1, 1, 1, 1, 1]


def tiny_gguf(path: Path, *, model: str = "gpt2", pre: str | None = "gpt2", **extra: Any) -> gguf.GGUFReader:
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tokenizer_model(model)
    if pre is not None:
        writer.add_tokenizer_pre(pre)
    writer.add_token_list(TINY_TOKENS)
    writer.add_token_types(TINY_TYPES)
    writer.add_token_merges(["a b", "Ġ ab"])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    if "add_bos" in extra:
        writer.add_add_bos_token(extra["add_bos"])
    if "template" in extra:
        writer.add_chat_template(extra["template"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return open_gguf(path)


def test_tiny_vocabulary_encodes_and_decodes(tmp_path: Path) -> None:
    tok = GGUFTokenizer.from_gguf(tiny_gguf(tmp_path / "t.gguf", add_bos=True))
    assert tok.add_bos and tok.vocab_size == len(TINY_TOKENS)
    assert tok.encode("ab ab<think></s>") == [0, 5, 7, 2, 1]
    assert tok.decode([5, 7, 2]) == "ab ab<think>"
    assert tok.is_stop(1) and not tok.is_stop(0)


def test_missing_pre_tokenizer_means_default(tmp_path: Path) -> None:
    tok = GGUFTokenizer.from_gguf(tiny_gguf(tmp_path / "t.gguf", pre=None))
    assert tok.encode("ab") == [5]
    assert not tok.add_bos


def test_unknown_pre_tokenizer_is_an_error(tmp_path: Path) -> None:
    reader = tiny_gguf(tmp_path / "t.gguf", pre="klingon-bpe")
    with pytest.raises(InfernoError, match="pre-tokenizer 'klingon-bpe'"):
        GGUFTokenizer.from_gguf(reader)


def test_unknown_tokenizer_model_is_an_error(tmp_path: Path) -> None:
    reader = tiny_gguf(tmp_path / "t.gguf", model="wordpiece-9000")
    with pytest.raises(InfernoError, match="tokenizer model 'wordpiece-9000'"):
        GGUFTokenizer.from_gguf(reader)


def test_file_without_tokenizer_is_an_error(tmp_path: Path) -> None:
    writer = gguf.GGUFWriter(tmp_path / "t.gguf", "llama")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    with pytest.raises(InfernoError, match="no tokenizer"):
        GGUFTokenizer.from_gguf(open_gguf(tmp_path / "t.gguf"))


def test_missing_chat_template_is_an_error(tmp_path: Path) -> None:
    tok = GGUFTokenizer.from_gguf(tiny_gguf(tmp_path / "t.gguf"))
    with pytest.raises(InfernoError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_chat_template_sees_special_tokens_and_can_refuse(tmp_path: Path) -> None:
    template = (
        "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}"
        "{{ raise_exception('System role not supported') }}{% endif %}"
        "{{ m['content'] | tojson }}{{ eos_token }}{% endfor %}"
        "{% if add_generation_prompt %}>{% endif %}"
    )
    tok = GGUFTokenizer.from_gguf(tiny_gguf(tmp_path / "t.gguf", template=template))
    assert tok.apply_chat_template([{"role": "user", "content": "<b>é"}]) == '<s>"<b>é"</s>>'
    with pytest.raises(InfernoError, match="System role not supported"):
        tok.apply_chat_template([{"role": "system", "content": "x"}])
