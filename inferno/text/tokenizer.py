"""The tokenizer a GGUF file carries in its metadata, rebuilt as a Hugging Face `tokenizers.Tokenizer`.

It is built the way transformers builds one from a GGUF (`AutoTokenizer.from_pretrained(..., gguf_file=...)`),
so both give the same ids for the same text; the tests check that against ids recorded from transformers.
Two kinds of vocabulary are supported: byte-level BPE (`tokenizer.ggml.model = gpt2`: GPT-2, Llama 3, Qwen,
SmolLM) and SentencePiece BPE (`llama`: Llama 2, Mistral, Gemma), whose merges the file does not list.
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Container
from functools import cache, cached_property

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

# llama.cpp also ends generation on tokens with these texts; we take them when the file marks them control.
_END_OF_GENERATION_TEXTS = frozenset(
    {
        "<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>",
        "<|endoftext|>", "<|end_of_text|>", "<EOT>", "_<EOT>", "<end_of_utterance>",
        "<\uff5cend\u2581of\u2581sentence\uff5c>",  # DeepSeek's, written with full-width bars
    }
)  # fmt: skip


# Chat template variable (as transformers names it) -> the NAME in tokenizer.ggml.NAME_token_id
_TEMPLATE_NAMES = {"bos_token": "bos", "eos_token": "eos", "unk_token": "unknown", "pad_token": "padding"}


@cache
def _byte_spelling() -> dict[int, str]:
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
    return {char: b for b, char in _byte_spelling().items()}


def _spelled_bytes(token: str) -> bytes:
    """The bytes a token stands for, as the ByteLevel decoder reads them: a token that is not spelled
    in the byte alphabet (a user-defined token holding real spaces, say) stands for its own UTF-8."""
    table = _byte_of_char()
    if all(char in table for char in token):
        return bytes(table[char] for char in token)
    return token.encode("utf-8")


CUT_TOKENS = 64  # tokens a cut in the middle of a text may add (a word split in two): never counted


class GGUFTokenizer:
    """Text <-> token ids for one GGUF file, plus its chat template and stop tokens."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        tokens: list[str],
        *,
        pieces: list[str] | None,
        byte_values: dict[int, int],
        bos_id: int | None,
        eos_id: int | None,
        add_bos: bool,
        add_eos: bool,
        stop_ids: frozenset[int],
        special_tokens: dict[str, str],
        chat_template: str | None,
        tokenizer_json: str | None = None,
    ) -> None:
        self._tokenizer = tokenizer
        self._json = tokenizer_json  # what `tokenizer` was built from, when it was (for `to_state`)
        self._tokens = tokens
        self._pieces = pieces  # SentencePiece's pieces (▁ for a space); None: byte-level, spelled in tokens
        self._byte_values = byte_values  # SentencePiece's <0xNN> byte tokens: id -> byte
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.add_bos = add_bos
        self.add_eos = add_eos
        self.vocab_size = len(tokens)
        self._stop_ids = stop_ids
        self._special_tokens = special_tokens
        self._chat_template = chat_template

    @classmethod
    def from_gguf(cls, reader: gguf.GGUFReader) -> GGUFTokenizer:
        model = metadata(reader, "tokenizer.ggml.model", expected=str)
        if model is None:
            raise InfernoError("GGUF has no tokenizer (tokenizer.ggml.model is missing)")
        if model not in ("gpt2", "llama"):
            raise InfernoError(
                f"unsupported tokenizer model {model!r} "
                "(supported: 'gpt2', byte-level BPE; 'llama', SentencePiece BPE)"
            )
        tokens = metadata_list(reader, "tokenizer.ggml.tokens", str)
        if not tokens:
            raise InfernoError("GGUF tokenizer has no tokens")
        token_types = metadata_list(reader, "tokenizer.ggml.token_type", int) or [1] * len(tokens)
        if len(token_types) != len(tokens):
            raise InfernoError("GGUF tokenizer has a different number of token types than tokens")

        def token_id(name: str) -> int | None:
            value = metadata(reader, f"tokenizer.ggml.{name}_token_id", expected=int)
            return value if value is not None and 0 <= value < len(tokens) else None

        ids = {name: token_id(name) for name in ("bos", "eos", "unknown", "padding", "eot", "eom")}
        named = {var: ids[name] for var, name in _TEMPLATE_NAMES.items() if ids[name] is not None}
        named_ids = set(named.values())
        if model == "gpt2":
            tokenizer, tokenizer_json = _byte_level_tokenizer(reader, tokens, token_types, named_ids)
            pieces, byte_values = None, {}
            add_bos_default = False
        else:
            tokenizer, pieces = _sentencepiece_tokenizer(reader, tokens, ids["unknown"])
            tokenizer_json = None
            byte_values = {i: int(tokens[i][3:5], 16) for i, t in enumerate(token_types) if t == BYTE}
            special, user_defined = _added_tokens(tokens, token_types, named_ids, None, set(pieces))
            tokenizer.add_special_tokens(special)
            tokenizer.add_tokens(user_defined)
            add_bos_default = True  # llama.cpp's and transformers' default for SentencePiece files
        stop_ids = {i for i in (ids["eos"], ids["eot"], ids["eom"]) if i is not None}
        stop_ids |= {
            i
            for i, (text, token_type) in enumerate(zip(tokens, token_types, strict=True))
            if token_type == CONTROL and text in _END_OF_GENERATION_TEXTS
        }
        return cls(
            tokenizer,
            tokens,
            pieces=pieces,
            byte_values=byte_values,
            bos_id=ids["bos"],
            eos_id=ids["eos"],
            add_bos=metadata(reader, "tokenizer.ggml.add_bos_token", add_bos_default, expected=bool),
            add_eos=metadata(reader, "tokenizer.ggml.add_eos_token", False, expected=bool),
            stop_ids=frozenset(stop_ids),
            special_tokens={var: tokens[i] for var, i in named.items()},
            chat_template=metadata(reader, "tokenizer.chat_template", expected=str),
            tokenizer_json=tokenizer_json,
        )

    def to_state(self) -> tuple[dict, str]:
        """Everything this tokenizer is, as JSON-able data and the `tokenizers` JSON (`from_state`
        rebuilds it several times faster than from the GGUF's metadata)."""
        state = {
            "tokens": self._tokens,
            "pieces": self._pieces if self._pieces != self._tokens else "tokens",
            "byte_values": [[i, b] for i, b in self._byte_values.items()],
            "bos_id": self.bos_id, "eos_id": self.eos_id, "add_bos": self.add_bos, "add_eos": self.add_eos,
            "stop_ids": sorted(self._stop_ids),
            "special_tokens": self._special_tokens,
            "chat_template": self._chat_template,
        }
        return state, self._json or _merges_as_strings(self._tokenizer.to_str())

    @classmethod
    def from_state(cls, state: dict, tokenizer_json: str) -> GGUFTokenizer:
        """The tokenizer `to_state` described (a KeyError, TypeError or ValueError if it is not one)."""
        tokens = state["tokens"]
        pieces = tokens if state["pieces"] == "tokens" else state["pieces"]
        if not all(isinstance(t, str) for t in tokens) or (pieces is not None and len(pieces) != len(tokens)):
            raise ValueError("tokenizer state: tokens and pieces disagree")
        return cls(
            Tokenizer.from_str(tokenizer_json),
            tokens,
            pieces=pieces,
            byte_values={int(i): int(b) for i, b in state["byte_values"]},
            bos_id=state["bos_id"],
            eos_id=state["eos_id"],
            add_bos=bool(state["add_bos"]),
            add_eos=bool(state["add_eos"]),
            stop_ids=frozenset(int(i) for i in state["stop_ids"]),
            special_tokens=dict(state["special_tokens"]),
            chat_template=state["chat_template"],
            tokenizer_json=tokenizer_json,
        )

    def encode(self, text: str, context: int | None = None) -> list[int]:
        """Token ids for `text`; special tokens written in it (`<|im_start|>`) become their single id.

        With `context`, a text that must be longer than `context` tokens is refused before all of it is
        tokenized (tokenizing a 16 MiB prompt takes gigabytes): no token stands for more bytes than the
        vocabulary's longest, so a text of N bytes is at least N / that many tokens; else it is counted
        in pieces of 4 x context characters, each piece's tokens less the few a cut can change, until
        they are more than the context (a piece at a time in memory) or the text ends."""
        if context is not None and len(text) > context:
            size = len(text.encode("utf-8", "surrogatepass"))
            least = -(-size // self.longest_token_bytes)
            step, counted = 4 * context, 0
            for start in range(0, len(text), step) if len(text) > step else ():
                if least > context:
                    break
                piece = text[start:start + step]
                counted += len(self._tokenizer.encode(piece, add_special_tokens=False).ids) - CUT_TOKENS
                least = max(least, counted)
            if least > context:
                raise InfernoError(f"prompt of {size:,} bytes is at least {least:,} tokens, longer than the "
                                   f"model's context of {context:,}")
        ids = self._tokenizer.encode(text, add_special_tokens=False).ids
        if self.add_bos and self.bos_id is not None:
            ids.insert(0, self.bos_id)
        if self.add_eos and self.eos_id is not None:
            ids.append(self.eos_id)
        return ids

    @cached_property
    def longest_token_bytes(self) -> int:
        """Bytes of the vocabulary's longest token (special tokens included)."""
        longest = max((len(self.token_bytes(i)) for i in range(self.vocab_size)), default=1)
        return max([longest, *(len(t.encode("utf-8")) for t in self._special_tokens.values())])

    def decode(self, ids: list[int]) -> str:
        """The text of `ids`, special tokens included; bytes that are not valid UTF-8 become U+FFFD."""
        return self._tokenizer.decode(ids, skip_special_tokens=False)

    def token_bytes(self, id: int) -> bytes:
        """The raw bytes one token stands for (may be part of a multi-byte character)."""
        self._token(id)  # refuses an id outside the vocabulary
        if self._pieces is None:
            return _spelled_bytes(self._tokens[id])
        if id in self._byte_values:
            return bytes([self._byte_values[id]])
        return self._pieces[id].replace(SPACE, " ").encode("utf-8")

    def token_text(self, id: int) -> str:
        """One token as readable text: "Ġthe" and "▁the" are " the"; a piece of a character shows as \\xNN."""
        return self.token_bytes(id).decode("utf-8", errors="backslashreplace")

    def is_stop(self, id: int) -> bool:
        """True for the tokens that end generation: EOS, end-of-turn and the like."""
        return id in self._stop_ids

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True,
                            template: str | None = None) -> str:
        """Render the file's chat template (or `template`, a --chat-template file's text) for `messages`
        (dicts with "role" and "content"), with this model's special tokens."""
        source = "the --chat-template file" if template is not None else self._template_source
        template = template if template is not None else self._chat_template
        if template is None:
            raise InfernoError("this GGUF has no chat template (tokenizer.chat_template): "
                               "give one with --chat-template FILE")
        from inferno.text.chat_template import render  # jinja2 is imported only by runs that use a template

        return render(template, template_source=source, messages=messages, tools=None, documents=None,
                      add_generation_prompt=add_generation_prompt, **self._special_tokens)

    _template_source = "the model's chat template (tokenizer.chat_template)"

    def use_chat_template(self, template: str) -> None:
        """Render chats with `template` (a --chat-template file's text) instead of the model's."""
        self._chat_template, self._template_source = template, "the --chat-template file"

    @property
    def has_chat_template(self) -> bool:
        return self._chat_template is not None

    def _token(self, id: int) -> str:
        if not 0 <= id < len(self._tokens):
            raise InfernoError(f"token id {id} is outside the vocabulary (0..{len(self._tokens) - 1})")
        return self._tokens[id]


class StreamDecoder:
    """Decodes ids one at a time for streaming output.

    A byte-level token can end halfway through a multi-byte character, so each call returns only
    the text that is complete; the rest waits for the next token (or for `flush`). The pieces put
    together equal `GGUFTokenizer.decode` of all the ids.
    """

    def __init__(self, tokenizer: GGUFTokenizer) -> None:
        self._tokenizer = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, id: int) -> str:
        """The new printable text once token `id` is appended."""
        return self._utf8.decode(self._tokenizer.token_bytes(id))

    def flush(self) -> str:
        """Whatever is still held back (a cut-off character comes out as U+FFFD)."""
        return self._utf8.decode(b"", final=True)


def _merges_as_strings(tokenizer_json: str) -> str:
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
    if not merges or not all(map(_one_space, merges)):
        return tokenizer_json
    return tokenizer_json[: keys[0].end()] + json.dumps(merges, ensure_ascii=False) + tokenizer_json[end:]


def _one_space(merge: str) -> bool:
    """A merge "left right" that reads back as the pair it stands for."""
    return merge.count(" ") == 1 and not merge.startswith(" ") and not merge.endswith(" ")


def _byte_level_tokenizer(
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
    special, user_defined = _added_tokens(tokens, token_types, named, set(_byte_spelling().values()), vocab)
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
    skeleton.add_special_tokens(special)
    skeleton.add_tokens(user_defined)
    spec = json.loads(skeleton.to_str())
    # "left right" is the older form of a merge, which `tokenizers` still reads, and a quarter faster
    spec["model"].update(vocab=vocab, merges=merges if _all_one_space(merges) else
                         [m.split(" ", 1) for m in merges])
    tokenizer_json = json.dumps(spec, ensure_ascii=False)
    try:
        return Tokenizer.from_str(tokenizer_json), tokenizer_json
    except Exception as exc:  # the Rust side reports a merge naming an unknown token this way
        raise InfernoError(f"GGUF tokenizer is inconsistent: {exc}") from None


_SPELLED = re.compile(r"\A[" + re.escape("".join(_byte_spelling().values())) + r"]*\Z")


def _byte_level_vocab(tokens: list[str]) -> dict[str, int]:
    """Token -> id. A token not spelled in the byte alphabet is respelled into it, as transformers does,
    so BPE can reach it; one match over all the tokens finds the common case of none."""
    if _SPELLED.match("".join(tokens)):
        return {token: i for i, token in enumerate(tokens)}
    spelling = _byte_spelling()
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


def _sentencepiece_tokenizer(
    reader: gguf.GGUFReader, tokens: list[str], unk_id: int | None
) -> tuple[Tokenizer, list[str]]:
    """SentencePiece BPE as transformers rebuilds it from a GGUF: spaces are ▁, characters missing from
    the vocabulary fall back to <0xNN> byte tokens, and merges come from the vocabulary itself.

    A SentencePiece file lists no merges: a token merges from any two tokens that spell it, the
    better-ranked tokens first (by score; Gemma's by their order in the vocabulary). Returns the
    tokenizer and the pieces as it spells them.
    """
    gemma = metadata(reader, "general.architecture", expected=str) in _GEMMA_ARCHITECTURES
    if gemma:  # Gemma writes its runs of spaces as real spaces; they are ▁▁... to the merges
        tokens = [SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
        priority = {token: -i for i, token in enumerate(tokens)}
    else:
        scores = metadata_list(reader, "tokenizer.ggml.scores", float)
        if scores is None or len(scores) != len(tokens):
            raise InfernoError("GGUF SentencePiece tokenizer has no score for every token")
        priority = dict(zip(tokens, scores, strict=True))
    vocab = {token: i for i, token in enumerate(tokens)}
    unk = tokens[unk_id] if unk_id is not None else None
    bpe = models.BPE(
        vocab=vocab,
        merges=_merges_from_vocabulary(vocab, priority),
        unk_token=unk,
        fuse_unk=True,
        byte_fallback=True,
    )
    tokenizer = Tokenizer(bpe)
    add_prefix_space = metadata(reader, "tokenizer.ggml.add_space_prefix", True, expected=bool) and not gemma
    tokenizer.normalizer = normalizers.Replace(" ", SPACE)
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix_space:  # Llama 2 style: a ▁ before the text (not after special tokens), dropped on decode
        tokenizer.normalizer = None
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement=SPACE, prepend_scheme="first", split=False
        )
        steps.append(decoders.Strip(content=" ", left=1))
    tokenizer.decoder = decoders.Sequence(steps)
    return tokenizer, tokens


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


def _added_tokens(
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
