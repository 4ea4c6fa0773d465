"""Record two independent tokenizations of Gemma 3's SentencePiece vocabulary (tests/test_tokenizer_gemma.py).

Dev-only: needs `transformers gguf tokenizers sentencepiece protobuf jinja2 torch pytest llama-cpp-python`
in a separate virtualenv, never the project's. Run from anywhere:

    python tests/reference/make_gemma_tokenizer_fixtures.py [MODEL.gguf]

It writes tests/fixtures/tokenizer_gemma3.json: the SmolLM2 tokenizer corpus plus Gemma's own markers, each
text with transformers' ids and decode and llama.cpp's ids (`Llama(vocab_only=True).tokenize`, special tokens
parsed as transformers parses them); and the ids transformers gives for the same vocabulary in a file that
says `general.architecture = llama` (merges ranked by score, not vocabulary order) and `add_space_prefix`.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import gguf
import llama_cpp
import tokenizers
import transformers
from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the corpus of the SmolLM2 fixture
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the variant files the tests rebuild
from make_tokenizer_fixtures import corpus
from test_tokenizer import write_variant

REPO = Path(__file__).resolve().parents[2]
DEFAULT_MODEL = REPO / "models" / "gemma-3-270m-q4_k_m.gguf"
OUTPUT = REPO / "tests" / "fixtures" / "tokenizer_gemma3.json"

# The same vocabulary in a file of architecture llama (what write_variant writes), as Llama 2 and Mistral are.
# Only with add_space_prefix = true: transformers prepends ▁ to llama files whatever the flag says, while
# llama.cpp (and inferno) follow a false one; Gemma's own file covers the no-prefix path against both.
VARIANTS: list[dict[str, Any]] = [{"tokenizer.ggml.add_space_prefix": True}]

# Gemma's control and user-defined tokens, look-alikes, and what SentencePiece does with spaces and bytes.
GEMMA = [
    "<bos>",
    "<eos>",
    "<pad>",
    "<unk>",
    "<mask>",
    "<bos>Hello",
    "Hello<eos>",
    "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n",
    "<start_of_turn>",
    "<end_of_turn>",
    "x <end_of_turn> y",
    "<start_of_image><end_of_image>",
    "<unused0><unused99>",
    "[multimodal]",
    "<table><tr><td>1</td></tr></table>",
    "<h1>Title</h1><p>text</p>",
    "<b>bold</b> <i>it</i> <code>x</code>",
    "<start_of_turn",
    "start_of_turn>",
    "<START_OF_TURN>",
    "<0x41>",
    "<0x0A>",
    "\u2581",
    "\u2581\u2581hello",
    "a\u2581b",
    "\u2581 \u2581",
    " " * 31 + "x",
    " " * 40 + "x",
    "\n" * 31 + "x",
    "\n" * 40 + "x",
    "\t" * 31 + "x",
    "\t" * 40 + "x",
    " \n \t \n\n  \t\t   x",
    "x \n",
    "x  \n\n",
    "   leading spaces and trailing   ",
    "\ufffd",
    "\U0010ffff",
    "a\u0000b",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--out", type=Path, default=OUTPUT)
    args = parser.parse_args()
    model = args.model.resolve()

    texts = list(dict.fromkeys(corpus() + GEMMA))
    hf = AutoTokenizer.from_pretrained(model.parent, gguf_file=model.name)
    llama = llama_cpp.Llama(str(model), vocab_only=True, verbose=False)
    cases = []
    for text in texts:
        ids = hf.encode(text)
        cpp = llama.tokenize(text.encode("utf-8"), add_bos=True, special=True)
        cases.append({"text": text, "ids": ids, "llama_cpp_ids": cpp, "decoded": hf.decode(ids)})
    differ = [case["text"] for case in cases if case["ids"] != case["llama_cpp_ids"]]

    variants = []
    source = gguf.GGUFReader(model)
    with tempfile.TemporaryDirectory() as tmp:
        for n, overrides in enumerate(VARIANTS):
            path = Path(tmp) / f"variant{n}.gguf"
            write_variant(source, path, overrides)
            variant = AutoTokenizer.from_pretrained(tmp, gguf_file=path.name)
            ids = [variant.encode(text) for text in texts]
            variants.append({"overrides": overrides, "ids": ids, "decoded": [variant.decode(i) for i in ids]})

    fixture = {
        "model": model.name,
        "transformers_version": transformers.__version__,
        "tokenizers_version": tokenizers.__version__,
        "llama_cpp_python_version": llama_cpp.__version__,
        "transformers_and_llama_cpp_differ_on": differ,
        "cases": cases,
        "variants": variants,
    }
    args.out.write_text(json.dumps(fixture, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {len(cases)} cases ({len(differ)} differ in llama.cpp), {len(variants)} variants")
    for text in differ:
        print(f"  llama.cpp differs on {text!r}")


if __name__ == "__main__":
    main()
