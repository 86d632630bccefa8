"""Record llama.cpp's token ids for a list of tricky strings, as the reference for
tests/test_tokenizer_real.py.

    python benchmarks/record_llamacpp_token_ids.py /path/to/SmolLM2-135M-Instruct.Q4_1.gguf \
        [tests/data/smollm2_llamacpp_token_ids.json]

Needs llama-cpp-python (`pip install llama-cpp-python`); only the vocabulary is loaded.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import llamacpp_peer as peer

CASES = [
    "",
    "Hello world",
    " leading space",
    "  two leading spaces",
    "a 1",
    "a  12",
    "x   345",
    "total:        67890",
    "line one\nline two\n\nline four",
    "\ttab\tseparated\t\tvalues",
    "windows\r\nline endings\r\n",
    "emoji 😀 and thumbs 👍🏽",
    "family 👨\u200d👩\u200d👧\u200d👦 zwj",
    "flag 🇺🇸 and heart ❤️",
    "한국어 텍스트입니다",
    "中文文本测试，标点。",
    "日本語のテキスト",
    "def add(a, b):\n    return a + b\n\nclass Foo:\n    pass\n",
    'if (x) {\n\tprintf("%d\\n", x);\n}',
    "      indented line\n        more",
    "1234567890123",
    "3.14159 and -42 and 1,000,000",
    "don't won't I'll we've they're she'd I'm",
    "DON'T SHOUT IT'S",
    "<|im_start|>user\nhi<|im_end|>",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more",
    "<|im_start|",
    "   ",
    "\n\n\n",
    "trailing spaces   ",
    "mixed\u00a0nbsp and\u3000ideographic space",
    "Ünïcödé àccents ñ",
    "URL https://example.com/a?b=c&d=1",
    "Ｆｕｌｌｗｉｄｔｈ１２３",
    "math: x² + y³ = z½",
]


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__)
        return 2
    model_path = Path(argv[1])
    default_out = Path(__file__).resolve().parent.parent / "tests/data/smollm2_llamacpp_token_ids.json"
    out = Path(argv[2]) if len(argv) > 2 else default_out
    llm = peer.load(model_path, vocab_only=True)
    cases = []
    for text in CASES:
        data = text.encode("utf-8")
        cases.append({
            "text": text,
            "ids": llm.tokenize(data, add_bos=False, special=True),
            "ids_no_special": llm.tokenize(data, add_bos=False, special=False),
        })
    record = {
        "model": model_path.name,
        "llama_cpp_python_version": peer.version(),
        "call": "Llama(model_path, vocab_only=True).tokenize(text.encode(), add_bos=False, special=True|False)",
        "cases": cases,
    }
    # one case a line, so a diff of the file shows which strings changed
    head = json.dumps({k: v for k, v in record.items() if k != "cases"}, ensure_ascii=False, indent=1)[:-2]
    lines = ",\n  ".join(json.dumps(c, ensure_ascii=False) for c in cases)
    out.write_text(f'{head},\n "cases": [\n  {lines}\n ]\n}}\n', encoding="utf-8")
    print(f"wrote {len(cases)} cases to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
