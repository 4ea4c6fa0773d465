"""The benchmark's prompts: deterministic English text cut to an exact number of tokens."""

from __future__ import annotations

from pathlib import Path

from inferno.bench.figures import Plan
from inferno.file.reader import open_gguf
from inferno.text.tokenizer import GGUFTokenizer

_OPENERS = ["In the morning", "Later that day", "After the rain", "Before dinner", "At the edge of town",
            "During the long winter", "On the first warm evening", "Every few days", "Without a word",
            "Near the old harbour"]
_SUBJECTS = ["the miller", "a young teacher", "the captain of the ferry", "an old shepherd",
             "the baker's daughter", "a tired traveller", "the village doctor", "two curious children",
             "the keeper of the lighthouse", "a quiet painter", "the blacksmith", "a group of students"]
_VERBS = ["carried", "repaired", "painted", "described", "found", "counted", "cleaned", "studied",
          "sold", "remembered", "borrowed", "measured"]
_OBJECTS = ["a basket of apples", "the broken wheel", "a map of the valley", "the letters from the city",
            "a small wooden boat", "the heavy iron gate", "a book about the stars",
            "the bread for the market", "a lantern with green glass", "the roof of the chapel",
            "a bundle of dry wood", "the old clock in the square"]
_PLACES = ["across the stone bridge", "behind the mill", "along the river", "in the quiet library",
           "near the fish market", "under the tall oak trees", "inside the empty barn",
           "on the hill above the farms", "by the northern road", "at the end of the pier"]
_ENDINGS = ["because the weather was changing", "while the bells were ringing", "and nobody asked why",
            "as the sun went down", "before anyone else woke up", "so that the neighbours could see",
            "although it took much longer than planned", "and then went home to rest"]


def english_text(sentences: int) -> str:
    """Plain sentences picked by a fixed linear congruential sequence: the same text on every run.

    No digits or line breaks, so every engine's pre-tokenizer splits it the same way.
    """
    state = 20240611
    parts: list[str] = []

    def pick(options: list[str]) -> str:
        nonlocal state
        state = (state * 1103515245 + 12345) % 2**31
        return options[(state >> 8) % len(options)]

    for _ in range(sentences):
        parts.append(f"{pick(_OPENERS)}, {pick(_SUBJECTS)} {pick(_VERBS)} {pick(_OBJECTS)} "
                     f"{pick(_PLACES)} {pick(_ENDINGS)}.")
    return " ".join(parts)


def exact_prompt(tokenizer: GGUFTokenizer, target: int) -> str:
    """English text that the model's tokenizer turns into exactly `target` tokens.

    Built word by word: BPE never merges across the pre-tokenizer's word boundaries, so a text's
    token count is the sum of its words' counts, and a word that would overshoot is skipped for a
    shorter one until the count lands exactly. The count is of the text's own tokens (no BOS), which
    is what every engine is given.
    """

    def count(text: str) -> int:
        return len(tokenizer.encode(text)) - len(tokenizer.encode(""))

    words = english_text(max(target // 8, 1)).replace(",", " ,").replace(".", " .").split(" ")
    cost: dict[str, int] = {}
    out: list[str] = []
    total = 0
    for word in words * 2:
        if total == target:
            break
        piece = word if word in (",", ".") or not out else " " + word
        if piece not in cost:
            cost[piece] = count(piece)
        if total + cost[piece] <= target:
            out.append(piece)
            total += cost[piece]
    text = "".join(out)
    if count(text) != target:
        raise RuntimeError(f"prompt builder made {count(text)} tokens, wanted {target}")
    return text


def write_prompts(model: str, plan: Plan, folder: Path) -> dict[str, Path]:
    """A file per prompt of the plan in `folder`: the short prompt as it is, the others cut to length
    by the model's tokenizer."""
    files = {"short": folder / "short.txt"}
    files |= {prompt: folder / f"{prompt}.txt" for prompt in plan.prompt_lengths}
    files["short"].write_text(plan.short_prompt)
    write_exact_prompts(model, {files[prompt]: tokens for prompt, tokens in plan.prompt_lengths.items()})
    return files


def write_exact_prompts(model: str, counts: dict[Path, int]) -> None:
    """Each file of `counts` gets English text of exactly its count of the model's tokens."""
    tokenizer = GGUFTokenizer.from_gguf(open_gguf(model))
    for path, tokens in counts.items():
        path.write_text(exact_prompt(tokenizer, tokens))
