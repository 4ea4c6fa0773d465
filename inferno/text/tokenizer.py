"""The tokenizer a GGUF file carries in its metadata, rebuilt as a Hugging Face `tokenizers.Tokenizer`.

It is built the way transformers builds one from a GGUF (`AutoTokenizer.from_pretrained(..., gguf_file=...)`),
so both give the same ids for the same text; the tests check that against ids recorded from transformers.
The two kinds of vocabulary it can be (byte-level and SentencePiece BPE) are built in
inferno.text.vocabulary.
"""

from __future__ import annotations

import codecs
from functools import cached_property

import gguf
from tokenizers import Tokenizer

from inferno.errors import InfernoError
from inferno.file.reader import metadata, metadata_list
from inferno.text.vocabulary import (
    BYTE,
    CONTROL,
    SPACE,
    byte_level_tokenizer,
    merges_as_strings,
    sentencepiece_tokenizer,
    spelled_bytes,
)

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
            tokenizer, tokenizer_json = byte_level_tokenizer(reader, tokens, token_types, named_ids)
            pieces, byte_values = None, {}
            add_bos_default = False
        else:
            tokenizer, pieces, tokenizer_json = sentencepiece_tokenizer(
                reader, tokens, token_types, named_ids, ids["unknown"])
            byte_values = {i: int(tokens[i][3:5], 16) for i, t in enumerate(token_types) if t == BYTE}
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
        return state, self._json or merges_as_strings(self._tokenizer.to_str())

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
        )  # not keeping the JSON: 14 MB as a str for Qwen's vocabulary, and a loaded entry is never written

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
            return spelled_bytes(self._tokens[id])
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
