"""Record Hugging Face transformers' tokenization of a GGUF file as the reference for tests/test_tokenizer.py.

Dev-only: needs `transformers gguf tokenizers sentencepiece protobuf jinja2` (and torch, which transformers'
GGUF reader imports) in a separate virtualenv, never the project's. Run from anywhere:

    python tests/reference/make_tokenizer_fixtures.py [MODEL.gguf]

It writes tests/fixtures/tokenizer_smollm2.json: a corpus of texts with transformers' ids and decodes,
the same corpus tokenized by the same vocabulary relabelled with other pre-tokenizers, and rendered chat
templates.
"""

# The corpus is about look-alike characters (full-width digits, dotless i, curly quotes), on purpose.
# ruff: noqa: RUF001

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import gguf
import tokenizers
import transformers
from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the variant files the tests rebuild
from test_tokenizer import write_variant

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # this checkout's inferno, for its default model's name
from inferno.cli.common import DEFAULT_MODEL  # noqa: E402

OUTPUT = REPO / "tests" / "fixtures" / "tokenizer_smollm2.json"

# The same vocabulary under other names: tests/test_tokenizer.py writes these files the same way.
VARIANTS: list[dict[str, Any]] = [
    {"tokenizer.ggml.pre": "llama-bpe", "tokenizer.ggml.add_bos_token": True},
    {"tokenizer.ggml.pre": "qwen2"},
]

PROSE = [
    "Hello world",
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "Once upon a time, there was a little tokenizer that could.",
    "I'm sure they'll say it's fine, but we've seen what you'd do.",
    "DON'T SHOUT. We'Re NOT Listening!",
    "She said: \"Don't go\" -- and then (after a pause) 'please'.",
    "What?! No... really?? Yes!!!",
    "e-mail me at first.last+tag@example.com or visit https://example.org/a/b?c=d&e=f#frag",
    "# Heading\n\n* item one\n* item two\n\n> quoted **bold** _italic_ `code`",
    "Dr. Smith arrived at 5 p.m. on Jan. 3rd; Mr. O'Neil didn't.",
    "supercalifragilisticexpialidocious antidisestablishmentarianism",
    "A sentence with trailing space ",
    " A sentence with leading space",
    "Tokenization is the first step: text goes in, integers come out.",
    "rock'n'roll isn't dead, y'all",
    "It costs $12.50 (or €11,20 / £9.99) -- 20% off!",
    "C'est la vie.",
    "snake_case camelCase PascalCase kebab-case SCREAMING_CASE",
    "hello\nworld",
    "Line one.\r\nLine two.\r\n",
    "The year 2024 was a leap year; 2025 is not.",
    "Call 555-0123 before 9:30am, ext. 42.",
    "¿Dónde está la biblioteca? ¡Aquí!",
    "Ellipsis… em—dash – en-dash “curly quotes” ‘single’ «guillemets»",
]

CODE = [
    "def add(a, b):\n    return a + b\n",
    "import numpy as np\n\nx = np.zeros((3, 4), dtype=np.float32)\nprint(x.shape)",
    "class Foo(Bar):\n    def __init__(self, *args) -> None:\n        super().__init__(*args)",
    'for i in range(10):\n\tif i % 2 == 0:\n\t\tprint(f"{i=}")',
    "const f = (x) => x ** 2;\nconsole.log([1, 2, 3].map(f));",
    "function hello() {\n  return 'hi';\n}",
    '#include <stdio.h>\n\nint main(void) {\n    printf("%d\\n", 42);\n    return 0;\n}',
    'fn main() {\n    let v: Vec<u32> = (0..10).collect();\n    println!("{:?}", v);\n}',
    'package main\n\nimport "fmt"\n\nfunc main() {\n\tfmt.Println("hi")\n}',
    "SELECT id, name FROM users WHERE age >= 18 ORDER BY name DESC LIMIT 10;",
    '<div class="box" id="main"><p>Hello &amp; welcome</p></div>',
    '{"key": "value", "list": [1, 2, 3], "nested": {"a": null, "b": true}}',
    '#!/bin/bash\nset -euo pipefail\nfor f in *.txt; do echo "$f"; done',
    "main :: IO ()\nmain = mapM_ print [x * x | x <- [1..10], even x]",
    "\\begin{equation}\n  E = mc^2 \\quad \\sum_{i=0}^{n} i^2\n\\end{equation}",
    r"^(?:[a-z0-9!#$%&'*+/=?^_`{|}~-]+)@(?:[a-z0-9-]+\.)+[a-z]{2,}$",
    "x+=1;y-=2;z*=3;w/=4;a<<=1;b>>=2;c&&d||e",
    "if (a != b && c <= d) { return !e; }",
    "    indented four\n        indented eight\n",
    "key: value\nlist:\n  - one\n  - two\nnested:\n  a: 1",
    "<?php echo $var; ?>",
    'public static void main(String[] args) { System.out.println("Hello"); }',
    "#define MAX(a, b) ((a) > (b) ? (a) : (b))",
    "a = [[1, 2], [3, 4]]\nb = {k: v for k, v in zip('ab', (1, 2))}",
    "// comment\n/* block\n   comment */\n-- sql comment\n# hash comment",
    "__init__ __name__ __main__ __dict__",
    "0x1F 0b1010 0o777 1_000_000 3.5e-8 .5 5.",
    'git commit -m "fix: handle \\t tabs" && git push origin main',
    "<|fake|> <not_a_token> </s> <s> [INST] [/INST] <<SYS>>",
    "\t\tdeeply\n\t\t\tindented\n\t\ttabs",
]

WHITESPACE = [
    " ",
    "  ",
    "   ",
    "\t",
    "\n",
    "\n\n",
    "\r\n",
    " \n ",
    "\t\n",
    "\n \n",
    "a b",
    "a  b",
    "a   b",
    "a\tb",
    "a\t\tb",
    "a\nb",
    "a\n\nb",
    "a \nb",
    "a\n b",
    "a \t \n b",
    "  leading",
    "trailing  ",
    "  both  ",
    "end with newline\n",
    "\n\nstart with newlines",
    "multiple   spaces   between   words",
    "non\u00a0breaking\u00a0space",
    "ideographic\u3000space",
    "em\u2003space thin\u2009space",
    "zero\u200bwidth\u200bspace",
    "vertical\x0btab form\x0cfeed",
    "mixed \t\n\r\n \t whitespace",
]

NUMBERS = [
    "0",
    "7",
    "42",
    "123",
    "1234",
    "12345",
    "1234567890",
    "3.14159265358979323846",
    "1,000,000",
    "-42",
    "+7",
    "1e-10",
    "2024-01-15",
    "12:34:56",
    "v1.2.3",
    "a1b2c3",
    "abc123def",
    "99 bottles",
    "room 101",
    "١٢٣٤٥",
    "१२३",
    "１２３",
    "x² + y³ = z⁴",
    "½ ¼ ¾",
    "Ⅻ ⅻ",
    "123456789012345678901234567890123456789012345678901234567890",
]

ACCENTS = [
    "café naïve résumé",
    "Ça va? Très bien, merci.",
    "Größe Straße über Äpfel",
    "Tiếng Việt có dấu",
    "Zażółć gęślą jaźń",
    "İstanbul ılık ışık",
    "Ελληνικά γράμματα",
    "Русский текст",
    "Українська мова",
    "e\u0301 a\u0300 o\u0308",
    "n\u0303",
    "Ångström",
    "Øresund ærø",
    "señor piñata",
    "Þórður",
]

CJK = [
    "你好，世界！",
    "我爱自然语言处理。",
    "こんにちは世界",
    "カタカナとひらがな",
    "東京は日本の首都です。",
    "안녕하세요 세계",
    "한국어 텍스트입니다.",
    "中文English混合text",
    "「引用」『二重』【括弧】",
    "𠀀𠀁𪚥",
    "漢字かな交じり文",
    "繁體中文與简体中文",
]

EMOJI = [
    "😀",
    "👍🏽",
    "👨‍👩‍👧‍👦",
    "👩🏾‍💻",
    "🏳️‍🌈",
    "🇫🇷🇯🇵",
    "1️⃣",
    "❤️",
    "I ❤️ Python 🐍!",
    "🔥🔥🔥",
    "emoji🙂inside",
    "🧑‍🤝‍🧑 🫶",
    "☕ ☀ ✈",
    "🏴󠁧󠁢󠁳󠁣󠁴󠁿",
    "👋 hello 👋",
]

RTL = [
    "مرحبا بالعالم",
    "שלום עולם",
    "Hello مرحبا world",
    "עברית and English",
    "\u200frtl mark\u200e ltr mark",
    "سلام دنیا",
    "یہ اردو ہے",
    "العربية 123 أرقام",
]

OTHER_SCRIPTS = [
    "สวัสดีชาวโลก",
    "नमस्ते दुनिया",
    "বাংলা লিপি",
    "தமிழ் எழுத்து",
    "ქართული",
    "Հայերեն",
    "ሰላም ልዑል",
    "∀x ∈ ℝ: x² ≥ 0",
    "┌─┬─┐\n│a│b│\n└─┴─┘",
    "⠓⠑⠇⠇⠕",
    "𝄞 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "\ue000private use",
    "control\x00char\x01\x7f",
    "‽ ⁂ ※ § ¶ † ‡",
]

SPECIAL = [
    "<|im_start|>user\nhi<|im_end|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
    "<|im_start|><|im_end|>",
    "<|endoftext|><|endoftext|>",
    "text<|endoftext|>more text",
    "x <|im_end|> y",
    " <|im_start|> ",
    "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start",
    "<|im_start|",
    "im_start|>",
    "< |im_start|>",
    "<|IM_START|>",
    "<<|im_end|>>",
    "<repo_name>inferno<file_sep>main.py<filename>",
    "<jupyter_start><jupyter_code>print(1)<jupyter_output>1",
    "<issue_start><issue_comment>bug<issue_closed>",
    "<gh_stars>100",
    "<empty_output>",
    "foo<|im_end|>\n",
    "\n<|im_start|>\n",
]

EDGE = [
    "",
    "a",
    "A",
    ".",
    "'",
    "'s",
    "''",
    '"',
    "\\",
    "!!!???...",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    "the the the the the the the the",
    "~`!@#$%^&*()_+-={}[]|:;<>,.?/",
]


def corpus() -> list[str]:
    """A deterministic corpus: the lists above plus variations that move spaces and case around."""
    texts = PROSE + CODE + WHITESPACE + NUMBERS + ACCENTS + CJK + EMOJI + RTL + OTHER_SCRIPTS + SPECIAL + EDGE
    texts += [" " + t for t in PROSE[:12] + CJK[:4] + EMOJI[:4]]
    texts += [t + "\n" for t in PROSE[:6] + CODE[:4]]
    texts += [t.upper() for t in PROSE[:6] + ACCENTS[:6]]
    texts += [" " * n + "x" + " " * n + "y" for n in range(1, 9)]
    texts += ["\t" * n + "z" + "\n" * n for n in range(1, 6)]
    texts += [str(2**k) for k in (10, 31, 63, 100)]
    texts += [" ".join(PROSE[i : i + 5]) for i in range(0, 20, 5)]
    texts.append("\n\n".join(PROSE + CODE[:5] + CJK[:3] + EMOJI[:5]))  # one long text
    unique = list(dict.fromkeys(texts))
    assert len(unique) >= 200, len(unique)
    return unique


CHATS = [
    [{"role": "user", "content": "Hi there!"}],
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "What is 2+2?"},
    ],
    [
        {"role": "user", "content": "Name a color."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another one, en français 🙂"},
    ],
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", type=Path, default=REPO / DEFAULT_MODEL)
    parser.add_argument("--out", type=Path, default=OUTPUT)
    args = parser.parse_args()
    model = args.model.resolve()

    hf = AutoTokenizer.from_pretrained(model.parent, gguf_file=model.name)
    chats = [
        {
            "messages": messages,
            "add_generation_prompt": add,
            "rendered": hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add),
        }
        for messages in CHATS
        for add in (True, False)
    ]
    texts = corpus() + [chat["rendered"] for chat in chats]
    cases = []
    for text in texts:
        ids = hf.encode(text)
        cases.append({"text": text, "ids": ids, "decoded": hf.decode(ids)})

    variants = []
    source = gguf.GGUFReader(model)
    with tempfile.TemporaryDirectory() as tmp:
        for n, overrides in enumerate(VARIANTS):
            path = Path(tmp) / f"variant{n}.gguf"
            write_variant(source, path, overrides)
            variant = AutoTokenizer.from_pretrained(tmp, gguf_file=path.name)
            variants.append({"overrides": overrides, "ids": [variant.encode(text) for text in texts]})

    fixture = {
        "model": model.name,
        "transformers_version": transformers.__version__,
        "tokenizers_version": tokenizers.__version__,
        "cases": cases,
        "chats": chats,
        "variants": variants,
    }
    args.out.write_text(json.dumps(fixture, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {len(cases)} cases, {len(chats)} chats, {len(variants)} variants to {args.out}")


if __name__ == "__main__":
    main()
