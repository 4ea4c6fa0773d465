"""The two kinds of vocabulary a GGUF file carries, rebuilt as `tokenizers.Tokenizer`s the way transformers
rebuilds them: byte-level BPE (`tokenizer.ggml.model = gpt2`: GPT-2, Llama 3, Qwen, SmolLM), whose merges the
file lists, and SentencePiece BPE (`llama`: Llama 2, Mistral, Gemma), whose merges come from the vocabulary;
and the tokens that match whole in text (special and user-defined).
"""

from __future__ import annotations

import json
import re
from collections.abc import Container
from functools import cache

import gguf
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from inferno.errors import InfernoError
from inferno.file.reader import metadata, metadata_list

# tokenizer.ggml.token_type values
CONTROL = 3
USER_DEFINED = 4
BYTE = 6  # SentencePiece's byte fallback pieces, <0x00> .. <0xFF>

SPACE = "\u2581"  # SentencePiece writes a space as ▁

# Architectures whose SentencePiece merges follow the order of the vocabulary, not its scores, and whose
# runs-of-spaces tokens the file writes as real spaces (transformers' gemma_tokenizer)
_GEMMA_ARCHITECTURES = frozenset({"gemma", "gemma2", "gemma3"})

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# tokenizer.ggml.pre -> the regex that cuts text into words before BPE. None is GPT-2's own regex,
# which is what transformers uses for every name it has no regex for (smollm among them).
PRE_TOKENIZER_SPLITS: dict[str, str | None] = {
    "default": None,
    "gpt2": None,
    "gpt-2": None,
    "smollm": None,
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "falcon3": _LLAMA3_SPLIT,
    "dbrx": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
    "megrez": _QWEN2_SPLIT,
    "qwen35": _QWEN35_SPLIT,
}


@cache
def byte_spelling() -> dict[int, str]:
    """GPT-2's byte -> printable character table: byte-level vocabularies spell every token with it."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]  # stand for themselves
    spelling = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in spelling:
            spelling[b] = chr(256 + extra)
            extra += 1
    return spelling


@cache
def _byte_of_char() -> dict[str, int]:
    return {char: b for b, char in byte_spelling().items()}


def spelled_bytes(token: str) -> bytes:
    """The bytes a token stands for, as the ByteLevel decoder reads them: a token that is not spelled
    in the byte alphabet (a user-defined token holding real spaces, say) stands for its own UTF-8."""
    table = _byte_of_char()
    if all(char in table for char in token):
        return bytes(table[char] for char in token)
    return token.encode("utf-8")


def merges_as_strings(tokenizer_json: str) -> str:
    """The `tokenizers` JSON with its BPE merges written "left right" (its older format, which it still
    reads, and a quarter faster) instead of [left, right], when no token in them holds a space. Only
    the merges are rewritten: `"merges":` can only be the model's key (a quote inside a JSON string is
    escaped)."""
    keys = list(re.finditer(r'"merges":\s*', tokenizer_json))
    if len(keys) != 1:
        return tokenizer_json
    pairs, end = json.JSONDecoder().raw_decode(tokenizer_json, keys[0].end())
    if not isinstance(pairs, list):
        return tokenizer_json
    valid = all(isinstance(m, list) and len(m) == 2 and all(isinstance(p, str) for p in m) for m in pairs)
    merges = [" ".join(m) for m in pairs] if valid else []
    if not merges or not _all_one_space(merges):
        return tokenizer_json
    return tokenizer_json[: keys[0].end()] + json.dumps(merges, ensure_ascii=False) + tokenizer_json[end:]


def _one_space(merge: str) -> bool:
    """A merge "left right" that reads back as the pair it stands for."""
    return merge.count(" ") == 1 and not merge.startswith(" ") and not merge.endswith(" ")


def byte_level_tokenizer(
    reader: gguf.GGUFReader, tokens: list[str], token_types: list[int], named: set[int]
) -> tuple[Tokenizer, str]:
    """The tokenizer, and the `tokenizers` JSON it was built from: the prepared-model cache stores that
    JSON, and a later start builds the same tokenizer from it the same way (Tokenizer.from_str).

    `tokenizers` writes every part of the JSON but the vocabulary and merges itself, for a model holding
    only the added tokens (which take their ids from it); the file's vocabulary and merges go in as they
    are, instead of through a full model that would then be written out and parsed again."""
    pre = metadata(reader, "tokenizer.ggml.pre", "default", expected=str)
    if pre not in PRE_TOKENIZER_SPLITS:
        raise InfernoError(
            f"unsupported pre-tokenizer {pre!r} (supported: {', '.join(sorted(PRE_TOKENIZER_SPLITS))})"
        )
    merges = metadata_list(reader, "tokenizer.ggml.merges", str)
    if not merges:
        raise InfernoError("GGUF tokenizer has no merges")
    split = PRE_TOKENIZER_SPLITS[pre]
    vocab = _byte_level_vocab(tokens)
    special, user_defined = added_tokens(tokens, token_types, named, set(byte_spelling().values()), vocab)
    added = {t.content: vocab[t.content] for t in special + user_defined}
    skeleton = Tokenizer(models.BPE(vocab=added, merges=[], fuse_unk=False))
    if split is None:
        skeleton.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        skeleton.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    skeleton.decoder = decoders.ByteLevel()
    # "left right" is the older form of a merge, which `tokenizers` still reads, and a quarter faster
    return _from_skeleton(skeleton, special, user_defined, vocab,
                          merges if _all_one_space(merges) else [m.split(" ", 1) for m in merges])


def _from_skeleton(
    skeleton: Tokenizer, special: list[AddedToken], user_defined: list[AddedToken], vocab: dict[str, int],
    merges: list[str] | list[list[str]],
) -> tuple[Tokenizer, str]:
    """The tokenizer `skeleton` is with the added tokens and the whole vocabulary and merges, built from
    its `tokenizers` JSON, and that JSON. The skeleton's BPE holds only the added tokens (which take
    their ids from it); `tokenizers` writes the rest of the JSON itself."""
    skeleton.add_special_tokens(special)
    skeleton.add_tokens(user_defined)
    spec = json.loads(skeleton.to_str())
    spec["model"].update(vocab=vocab, merges=merges)
    tokenizer_json = json.dumps(spec, ensure_ascii=False)
    try:
        return Tokenizer.from_str(tokenizer_json), tokenizer_json
    except Exception as exc:  # the Rust side reports a merge naming an unknown token this way
        raise InfernoError(f"GGUF tokenizer is inconsistent: {exc}") from None


_SPELLED = re.compile(r"\A[" + re.escape("".join(byte_spelling().values())) + r"]*\Z")


def _byte_level_vocab(tokens: list[str]) -> dict[str, int]:
    """Token -> id. A token not spelled in the byte alphabet is respelled into it, as transformers does,
    so BPE can reach it; one match over all the tokens finds the common case of none."""
    if _SPELLED.match("".join(tokens)):
        return {token: i for i, token in enumerate(tokens)}
    spelling = byte_spelling()
    alphabet = set(spelling.values())
    return {
        token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode("utf-8")): i
        for i, token in enumerate(tokens)
    }


def _all_one_space(merges: list[str]) -> bool:
    """Every merge is "left right" with one space (one regex pass instead of a check per merge)."""
    joined = "\n".join(merges)
    if joined.count("\n") != len(merges) - 1:  # a merge holding a newline: merge by merge
        return all(map(_one_space, merges))
    return re.search(r"^[^ \n]*$|^ | $| [^ \n]* ", joined, re.MULTILINE) is None


def sentencepiece_tokenizer(
    reader: gguf.GGUFReader, tokens: list[str], token_types: list[int], named: set[int], unk_id: int | None
) -> tuple[Tokenizer, list[str], str]:
    """SentencePiece BPE as transformers rebuilds it from a GGUF: spaces are ▁, characters missing from
    the vocabulary fall back to <0xNN> byte tokens, and merges come from the vocabulary itself.

    A SentencePiece file lists no merges: a token merges from any two tokens that spell it, the
    better-ranked tokens first (by score; Gemma's by their order in the vocabulary). Returns the
    tokenizer, the pieces as it spells them, and the `tokenizers` JSON it was built from (as
    byte_level_tokenizer does).
    """
    gemma = metadata(reader, "general.architecture", expected=str) in _GEMMA_ARCHITECTURES
    pieces = tokens
    if gemma:  # Gemma writes its runs of spaces as real spaces; they are ▁▁... to the merges
        pieces = [SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
        priority = {piece: -i for i, piece in enumerate(pieces)}
    else:
        scores = metadata_list(reader, "tokenizer.ggml.scores", float)
        if scores is None or len(scores) != len(tokens):
            raise InfernoError("GGUF SentencePiece tokenizer has no score for every token")
        priority = dict(zip(tokens, scores, strict=True))
    vocab = {piece: i for i, piece in enumerate(pieces)}
    special, user_defined = added_tokens(tokens, token_types, named, None, vocab)
    added = {t.content: vocab[t.content] for t in special + user_defined if t.content in vocab}
    fresh = len(vocab)
    for t in special + user_defined:  # one respelled for the merges: a new id after the vocabulary's
        if t.content not in added:
            added[t.content], fresh = fresh, fresh + 1
    unk = pieces[unk_id] if unk_id is not None else None
    skeleton = Tokenizer(models.BPE(vocab=added, merges=[], unk_token=unk, fuse_unk=True, byte_fallback=True))
    add_prefix_space = metadata(reader, "tokenizer.ggml.add_space_prefix", True, expected=bool) and not gemma
    skeleton.normalizer = normalizers.Replace(" ", SPACE)
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix_space:  # Llama 2 style: a ▁ before the text (not after special tokens), dropped on decode
        skeleton.normalizer = None
        skeleton.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement=SPACE, prepend_scheme="first", split=False
        )
        steps.append(decoders.Strip(content=" ", left=1))
    skeleton.decoder = decoders.Sequence(steps)
    pairs = _merges_from_vocabulary(vocab, priority)
    one_space = not any(" " in left or " " in right for left, right in pairs)  # (pieces are never empty)
    merges = [f"{left} {right}" for left, right in pairs] if one_space else [list(pair) for pair in pairs]
    tokenizer, tokenizer_json = _from_skeleton(skeleton, special, user_defined, vocab, merges)
    return tokenizer, pieces, tokenizer_json


def _merges_from_vocabulary(vocab: dict[str, int], priority: dict[str, float]) -> list[tuple[str, str]]:
    """Every (left, right) pair of tokens that spells a token, best-ranked token first; within one token
    the longer left piece first; ties in vocabulary order. The list transformers' generate_merges makes."""
    ranked = []
    for token, score in priority.items():
        for i in range(1, len(token)):
            left = token[:i]
            if left in vocab and (right := token[i:]) in vocab:
                ranked.append((score, i, len(token) - i, left, right))
    ranked.sort(key=lambda m: m[:3], reverse=True)  # stable: equal keys keep the vocabulary's order
    return [(left, right) for _, _, _, left, right in ranked]


def added_tokens(
    tokens: list[str],
    token_types: list[int],
    named: set[int],
    alphabet: set[str] | None,
    vocab: Container[str],
) -> tuple[list[AddedToken], list[AddedToken]]:
    """The special and the user-defined tokens that match whole in text: control tokens, BOS/EOS/UNK/PAD
    (special), and user-defined ones.

    In a byte-level vocabulary (alphabet given) a control token spelled outside the byte alphabet is a
    mislabelled piece of text, not a marker: transformers leaves it to BPE, and so do we. A user-defined
    token is added only when the model's vocabulary (`vocab`) holds it as written: one that had to be
    respelled (Gemma's runs of spaces, now ▁▁...) is left to the merges, as transformers does.
    """
    special = [
        AddedToken(token, normalized=False, special=True)
        for i, (token, token_type) in enumerate(zip(tokens, token_types, strict=True))
        if (token_type == CONTROL or i in named) and (alphabet is None or set(token) <= alphabet)
    ]
    contents = {t.content for t in special}
    user_defined = [
        AddedToken(token, normalized=False, special=False)
        for token, token_type in zip(tokens, token_types, strict=True)
        if token_type == USER_DEFINED and (token in vocab or token in contents)
    ]
    return special, user_defined
