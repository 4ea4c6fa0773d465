"""The text a generation shows, as it streams: end tokens left out, cut before a stop string.

Generation ends on a stop token (end of sequence, end of turn) or on a stop string the caller gives.
Neither is part of the answer: the stop token is not text at all (`<|im_end|>` would otherwise end
every chat reply), and the text is cut where a stop string begins. While streaming, text that could
be the beginning of a stop string is held back until the next tokens show whether it is one.
"""

from __future__ import annotations

from collections.abc import Sequence

from inferno.errors import InfernoError
from inferno.text.tokenizer import GGUFTokenizer, StreamDecoder


class OutputText:
    def __init__(self, tokenizer: GGUFTokenizer, stop_strings: Sequence[str] = ()) -> None:
        if any(not s for s in stop_strings):
            raise InfernoError("a stop string is empty")
        self._tokenizer = tokenizer
        self._decoder = StreamDecoder(tokenizer)
        self._stops = tuple(stop_strings)
        self.text = ""  # everything decoded so far, up to where a stop string begins
        self.token_ids: list[int] = []  # the generated tokens but a final stop token
        self.stopped_by: str | None = None  # the stop string, or the stop token's text, that ended it
        self._shown = 0  # characters of text already handed out

    def add(self, token_id: int, is_stop_token: bool = False) -> str:
        """Take the next generated token; the text that can now be shown."""
        if self.stopped_by is not None:
            return ""
        if is_stop_token:
            self.stopped_by = self._tokenizer.token_text(token_id)
            return self.flush()
        self.token_ids.append(token_id)
        self.text += self._decoder.add(token_id)
        return self._release(final=False)

    def flush(self) -> str:
        """Whatever is still held back, at the end of generation."""
        if self.stopped_by is None or self.stopped_by not in self._stops:
            self.text += self._decoder.flush()
        return self._release(final=True)

    @property
    def stopped(self) -> bool:
        return self.stopped_by is not None

    def _release(self, final: bool) -> str:
        if self.stopped_by is None or self.stopped_by not in self._stops:
            hits = [(at, s) for s in self._stops if (at := self.text.find(s, self._shown)) >= 0]
            if hits:
                at, self.stopped_by = min(hits)
                self.text = self.text[:at]
                final = True
        end = len(self.text) if final else len(self.text) - self._held_back()
        piece, self._shown = self.text[self._shown : end], max(self._shown, end)
        return piece

    def _held_back(self) -> int:
        """Length of the longest end of the text that is the beginning of a stop string."""
        longest = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(self.text) - self._shown), longest, -1):
                if self.text.endswith(stop[:n]):
                    longest = n
                    break
        return longest
