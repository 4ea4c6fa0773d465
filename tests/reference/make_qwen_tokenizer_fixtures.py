"""Record Hugging Face transformers' tokenization of Qwen2.5-Coder's byte-level BPE (test_qwen_reference.py).

Dev-only: needs `transformers gguf tokenizers jinja2` (and torch, which transformers' GGUF reader imports)
in a separate virtualenv, never the project's. Run from anywhere:

    python tests/reference/make_qwen_tokenizer_fixtures.py [MODEL.gguf]

It writes tests/fixtures/tokenizer_qwen.json: the texts of the SmolLM2 tokenizer fixture (the corpus of
tests/reference/make_tokenizer_fixtures.py and its rendered chats, read from tokenizer_smollm2.json so the
two fixtures share them exactly) plus Qwen's own special tokens, each with transformers' ids and decode;
and the fixture's chats rendered with this file's chat template.
"""

# Full-width punctuation in the corpus, on purpose.
# ruff: noqa: RUF001

from __future__ import annotations

import argparse
import json
from pathlib import Path

import tokenizers
import transformers
from transformers import AutoTokenizer

REPO = Path(__file__).resolve().parents[2]
DEFAULT_MODEL = REPO / "models" / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
SMOLLM2_FIXTURE = REPO / "tests" / "fixtures" / "tokenizer_smollm2.json"
OUTPUT = REPO / "tests" / "fixtures" / "tokenizer_qwen.json"

# Qwen2.5's added tokens (151643 and up), look-alikes, and what its pre-tokenizer does with digits and code.
QWEN = [
    "<|endoftext|>",
    "<|im_start|>system\nYou are Qwen.<|im_end|>\n",
    "<|fim_prefix|>def add(a, b):\n    <|fim_suffix|>\n    return c<|fim_middle|>",
    "<|repo_name|>inferno\n<|file_sep|>inferno/__init__.py\nimport numpy\n",
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    "<|object_ref_start|>cat<|object_ref_end|><|box_start|>(1,2),(3,4)<|box_end|>",
    "<|quad_start|><|quad_end|><|vision_start|><|vision_pad|><|image_pad|><|video_pad|><|vision_end|>",
    "<|fim_pad|><|fim_prefix|><|fim_middle|><|fim_suffix|>",
    "x<|endoftext|>y",
    "<|endoftext",
    "<|fim_prefix",
    "<tool_call",
    "</tool_call>",
    "<|FIM_PREFIX|>",
    "12345678901234567890",
    "3.14159 2.71828 1e-9 0xdeadbeef",
    "for (int i = 0; i < 100; ++i) {\n        sum += a[i] * b[i];\n    }\n",
    "            deeply indented line\n\n\n\n    less indented\n",
    "你好世界123abc！？。",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--out", type=Path, default=OUTPUT)
    args = parser.parse_args()
    model = args.model.resolve()

    smollm2 = json.loads(SMOLLM2_FIXTURE.read_text(encoding="utf-8"))
    hf = AutoTokenizer.from_pretrained(model.parent, gguf_file=model.name)
    chats = [
        {
            "messages": chat["messages"],
            "add_generation_prompt": chat["add_generation_prompt"],
            "rendered": hf.apply_chat_template(
                chat["messages"], tokenize=False, add_generation_prompt=chat["add_generation_prompt"]
            ),
        }
        for chat in smollm2["chats"]
    ]
    texts = [case["text"] for case in smollm2["cases"]] + QWEN + [chat["rendered"] for chat in chats]
    texts = list(dict.fromkeys(texts))
    cases = []
    for text in texts:
        ids = hf.encode(text)
        cases.append({"text": text, "ids": ids, "decoded": hf.decode(ids)})

    fixture = {
        "model": model.name,
        "transformers_version": transformers.__version__,
        "tokenizers_version": tokenizers.__version__,
        "texts_from": SMOLLM2_FIXTURE.name,
        "cases": cases,
        "chats": chats,
    }
    args.out.write_text(json.dumps(fixture, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {len(cases)} cases, {len(chats)} chats to {args.out}")


if __name__ == "__main__":
    main()
