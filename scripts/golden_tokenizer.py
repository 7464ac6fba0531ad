"""Golden token ids and chat prompts for tests/strata/test_tokenizer.py, from llama.cpp.

    python scripts/golden_tokenizer.py            # writes tests/data/tokenizer_golden.json
    python scripts/golden_tokenizer.py --unicode-table path/to/llama.cpp/src/unicode-data.cpp

The first needs llama-cpp-python (`pip install llama-cpp-python`, a llama.cpp build) and the
SmolLM2 GGUF (`strata.hub.pull_smollm2()`). The second prints `_LLAMA_CPP_CLASSES`, the
letter/number/mark table of strata/pretokenizers.py, from llama.cpp's own Unicode data: llama.cpp
splits text by its table, not by the Unicode version of the regex engine or of Python.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "data" / "tokenizer_golden.json"

TEXTS = [
    "",
    "Hello world",
    "Hello, world! How are you today?",
    " leading space",
    "   three leading spaces",
    "trailing spaces   ",
    "I'm sure they're here; we'll see what you've done, it's Bob's and I'd go.",
    "DON'T SHOUT, I'LL LISTEN",
    "Numbers: 0 7 42 1234567890 3.14159 -273.15 1e-9 0x1F 1,000,000",
    "123456789012345678901234567890",
    "Chinese: 你好，世界！我们今天去哪里？",
    "Japanese: 日本語のテキストとカタカナ、ひらがな。",
    "Korean: 안녕하세요 세계",
    "Russian: Привет, мир! Съешь же ещё этих мягких французских булок.",
    "Greek: Γειά σου Κόσμε",
    "Arabic: مرحبا بالعالم ١٢٣",
    "Hebrew: שלום עולם",
    "Hindi: नमस्ते दुनिया २०२४",
    "Thai: สวัสดีชาวโลก",
    "Accents: naïve café résumé Ångström Straße œuvre",
    "Emoji: 😀😃😄 🚀 🇫🇷 ❤️",
    "Family ZWJ: 👨‍👩‍👧‍👦 and 👩🏽‍💻 with skin tones 👍🏻👍🏼👍🏽👍🏾👍🏿",
    "def f(x):\n\tif x > 0:\n\t\treturn x * 2\n\treturn -x\n",
    "class A:\n    def __init__(self):\n        self.x = {'a': [1, 2, 3]}\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }  // C++",
    "a          b               c",
    "\n\n\n\nfour newlines before, then\n\n\n\n\n\n",
    " \n \n\t\n  \r\n",
    "tabs\t\t\tand\tspaces \t \t mixed",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more text",
    "<|im_start|><|im_end|><|endoftext|>",
    "almost special: <|im_start> <im_end|> <|endoftext",
    "Code tokens: <filename>main.py<file_sep><gh_stars>10",
    "Punctuation!!! ??? ... --- *** ((())) [[[]]] {{{}}}",
    "URL: https://example.com/path?q=1&r=two#frag, mail: a.b@c.de",
    "Mixed: The café served 3 croissants 🥐 at 08:30 — ¡Olé! «quoted» “smart quotes”",
    "Math: ∀x∈ℝ, x² ≥ 0; ∑ᵢ aᵢ = ∫₀¹ f(t) dt ≈ π/4 ½ ⅓",
    "Control chars: \x00\x01\x04\x7f and \u00a0nbsp\u2003emsp\u3000ideographic",
    "Rare: \U00010d40\U000116d0 ꙮ 𒀀 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "          ",
]

MESSAGES = [
    {"role": "user", "content": "Hi! What is the capital of France?"},
    {"role": "assistant", "content": "The capital of France is Paris."},
    {"role": "user", "content": "And of Italy?"},
]
SYSTEM = [{"role": "system", "content": "You answer in one word."}] + MESSAGES[:1]


def unicode_table(path: Path) -> str:
    """llama.cpp's codepoint classes as `class letter + hex gap` runs: L letter, N number, M mark
    (for qwen35's \\p{M}), O other."""
    body = path.read_text().split("unicode_ranges_flags = {", 1)[1].split("};", 1)[0]
    ranges = [(int(a, 16), int(f, 16)) for a, f in re.findall(r"\{0x([0-9A-F]+), 0x([0-9A-F]+)\}", body)]
    runs: list[tuple[int, str]] = []
    for start, flags in ranges[:-1]:  # the last entry only ends the table
        cls = "L" if flags & 0x4 else "N" if flags & 0x2 else "M" if flags & 0x10 else "O"
        if not runs or runs[-1][1] != cls:
            runs.append((start, cls))
    text, prev = "", 0
    for start, cls in runs:
        text += f"{cls}{start - prev:x}"
        prev = start
    lines = [text[i:i + 92] for i in range(0, len(text), 92)]
    return "_LLAMA_CPP_CLASSES = (\n" + "".join(f'    "{line}"\n' for line in lines) + ")\n"


def golden() -> dict:
    import llama_cpp
    from llama_cpp import Llama
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    from strata.gguf.reader import GGUFFile
    from strata.hub import pull_smollm2

    path = pull_smollm2()
    llm = Llama(str(path), vocab_only=True, verbose=False)
    tokens = [{"text": t, "ids": llm.tokenize(t.encode(), add_bos=False, special=True),
               "ids_no_special": llm.tokenize(t.encode(), add_bos=False, special=False)}
              for t in TEXTS]
    g = GGUFFile(path)
    toks = g.require("tokenizer.ggml.tokens")
    template = g.require("tokenizer.chat_template")
    bos, eos = toks[g.require("tokenizer.ggml.bos_token_id")], toks[g.require("tokenizer.ggml.eos_token_id")]
    chats = []
    for messages in (MESSAGES, SYSTEM):
        for agp in (True, False):
            fmt = Jinja2ChatFormatter(template, eos_token=eos, bos_token=bos, add_generation_prompt=agp)
            prompt = fmt(messages=messages).prompt
            chats.append({"messages": messages, "add_generation_prompt": agp, "prompt": prompt,
                          "ids": llm.tokenize(prompt.encode(), add_bos=False, special=True)})
    return {"model": path.name, "llama_cpp_python": llama_cpp.__version__,
            "tokenize": "Llama(vocab_only=True).tokenize(text.encode(), add_bos=False, special=...)",
            "texts": tokens, "chat": chats}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--unicode-table", type=Path, metavar="UNICODE_DATA_CPP",
                    help="print the class table from llama.cpp's src/unicode-data.cpp instead")
    args = ap.parse_args()
    if args.unicode_table:
        sys.stdout.write(unicode_table(args.unicode_table))
        return
    OUT.parent.mkdir(parents=True, exist_ok=True)
    # one line per entry, so a change in some ids reads as a one-line diff
    lines = []
    for key, value in golden().items():
        if isinstance(value, list):
            items = ",\n".join("  " + json.dumps(v, ensure_ascii=False) for v in value)
            lines.append(f"{json.dumps(key)}: [\n{items}\n ]")
        else:
            lines.append(f"{json.dumps(key)}: {json.dumps(value, ensure_ascii=False)}")
    OUT.write_text("{\n " + ",\n ".join(lines) + "\n}\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
