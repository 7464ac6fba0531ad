"""The pre-tokenizers llama.cpp runs before byte-level BPE: the regexes of each
`tokenizer.ggml.pre` name, with their Unicode classes spelled out as llama.cpp's own table
has them (strata.tokenizer builds the tokenizer from these)."""
from __future__ import annotations

import functools
import re

# llama.cpp's `tokenizer.ggml.pre` names and the regexes it splits text with, applied in
# order, each to the pieces the previous one left (llama-vocab.cpp, llm_tokenizer_bpe).
# \p{L}, \p{N}, \p{M}, \s and \S are read by llama.cpp's Unicode table (see _classes), not
# the regex engine's. A name is listed only once its ids have been checked against llama.cpp
# (smollm: tests/data/tokenizer_golden.json; qwen2, qwen35: llama.cpp's own test vectors,
# tests/strata/test_tokenizer_vocabs.py).
PRE_TOKENIZERS: dict[str, list[str]] = {
    # LLAMA_VOCAB_PRE_TYPE_SMOLLM: every digit alone, then GPT-2's regex.
    "smollm": [
        r"\p{N}",
        r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
    ],
    # LLAMA_VOCAB_PRE_TYPE_QWEN2 (Qwen1.5 to Qwen3): tokenizer.json's regex with its
    # (?i:...) contractions spelled out, as llama.cpp spells them; digits one by one.
    "qwen2": [
        (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
         r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
    ],
    # LLAMA_VOCAB_PRE_TYPE_QWEN35 (Qwen3.5 on): qwen2's, but combining marks (\p{M}) stay in
    # the letter run they follow instead of starting a punctuation run.
    "qwen35": [
        (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
         r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
    ],
}


# llama.cpp's whitespace (unicode-data.cpp, unicode_set_whitespace): Unicode White_Space.
_WHITESPACE = [(0x9, 0xD), (0x20, 0x20), (0x85, 0x85), (0xA0, 0xA0), (0x1680, 0x1680),
               (0x2000, 0x200A), (0x2028, 0x2029), (0x202F, 0x202F), (0x205F, 0x205F),
               (0x3000, 0x3000)]


@functools.cache
def _classes() -> dict[str, str]:
    """Oniguruma class bodies for llama.cpp's letters (L), numbers (N), marks (M) and
    whitespace (W).

    llama.cpp classifies codepoints by a table of its own (an older Unicode than Oniguruma's
    or Python's: a letter or digit added since splits differently), so the regexes spell
    that table out as ranges.
    """
    ranges: dict[str, list[tuple[int, int]]] = {"L": [], "N": [], "M": [], "O": []}
    runs = [(c, int(gap, 16)) for c, gap in re.findall(r"([LNMO])([0-9a-f]+)", _LLAMA_CPP_CLASSES)]
    start = 0
    for k, (cls, gap) in enumerate(runs):
        start += gap
        end = start + runs[k + 1][1] - 1 if k + 1 < len(runs) else 0x10FFFF
        ranges[cls].append((start, end))
    ranges["W"] = _WHITESPACE
    return {c: "".join(rf"\x{{{a:x}}}-\x{{{b:x}}}" for a, b in rs) for c, rs in ranges.items() if c != "O"}


def with_classes(regex: str) -> str:
    """`regex` with \\p{L}, \\p{N}, \\p{M}, \\s and \\S replaced by llama.cpp's classes, in or out of [...]."""
    cls = _classes()
    names = {r"\p{L}": "L", r"\p{N}": "N", r"\p{M}": "M", r"\s": "W"}
    out, i, inside = [], 0, False
    while i < len(regex):
        for name, c in names.items():
            if regex.startswith(name, i):
                out.append(cls[c] if inside else f"[{cls[c]}]")
                i += len(name)
                break
        else:
            if regex.startswith(r"\S", i) and not inside:
                out.append(f"[^{cls['W']}]")
                i += 2
                continue
            if regex[i] == "\\":
                if regex[i + 1] in "pPS":
                    raise ValueError(f"pre-tokenizer regex {regex!r}: {regex[i:i + 5]!r} is not mapped "
                                     "to llama.cpp's Unicode classes; add it to strata.pretokenizers.with_classes")
                out.append(regex[i:i + 2])
                i += 2
                continue
            inside = {"[": True, "]": False}.get(regex[i], inside)
            out.append(regex[i])
            i += 1
    return "".join(out)


# llama.cpp's codepoint classes (unicode-data.cpp, unicode_ranges_flags, as vendored in
# llama-cpp-python 0.3.36): runs of L letter, N number, M mark, O other, each a class letter
# and the hex gap from the previous run's start. From scripts/golden_tokenizer.py --unicode-table.
_LLAMA_CPP_CLASSES = (
    "O0N30OaL7O1aL6O1aL2fO1N7O2L1O1N3L1O1N1O3L1O17L1O1fL1O1caL4OcLeO5L7O1L1O1M11L70O5L1O2L2O4L1O1"
    "L6O1L1O3L1O1L1O14L1O53L1O8bM1L7Oa6L1O26L2O1L6O29M8O2dM1O1M1O2M1O2M1O1L8O1bL4O4M1dObL5M2bN15O"
    "aL4M2L1O63L1M1O7M2L6M2O2M1L4N2LaO3L2O1L10M1L1M1eO1bL2M59LbO1NeLaM21L9O2L4O1M2O1L2M16L4M1L9M1"
    "L3M1O5L12M19O3L4ObL5O18L1O6M9L8M2aO18M1L21M36L3M1L12M1L7MaO2N2OaL1M10O3L1O8L2O2L2O16L1O7L1O1"
    "L3O4M2L1M1O7M2O2M2L3O1M8O1L4O2L1M3O2N2LaO2N2O6L2O1M1O1M2O3L1O6L4O2L2O16L1O7L1O2L1O2L1O2M2O1M"
    "1O5M4O2M2O3M3O1L7O4L1O1N7MaL2M3O1MbO3L1O9L1O3L1O16L1O7L1O2L1O5M2L1M1O8M1O3M1O3L2O1LfM2O2N2Oa"
    "L9M1O6M1O3L1O8L2O2L2O16L1O7L1O2L1O5M2L1M1O7M2O2M2O3M7O3L4O2L1M3O2N2OaL1N1O6MaL1O1L1O6L3O3L1O"
    "4L3O2L1O1L1O2L3O2L3O3L3OcM4O5M3O3M1O4L2O1M6O1NeOdMdL5O8L1O3L1O17L1O10M2L1M1O7M1O3M1O4M7O2L1O"
    "3L2O1L2M2O2N2OaN8O7L1M1O3L1O8L1O3L1O17L1OaL1O5M2L1M1O7M1O3M1O4M7O2L6O2L1M2O2N2OaL1M2O1McL4O9"
    "L1O3L1M29L2M1O7M1O3M1L4O1L5M3N1L7M3O2N2O13L1O6M1O3L1O12L3O18L1O9L1O1L2O7M3O1M4O6M1O1M1O8N6Oa"
    "M2O2LdM30L1M2O7L5M7O8N1OaL27O2L1O1L1O5L1O18L1O1L1MaL1M2L9O1L2O5L1O1M1O7N1OaL2O4L20O1M17O2N6O"
    "14M1O1M1O1M1O1M4L2O8L1O24M4O14M1L2M5ObM1O24M9O1L39M2bL14N1OaL6M6L4M4L3M1L3M2L7M3L4MdLcM1N1Ma"
    "O4L2O26L1O1L5O1L2O2bL1O14dL1O4L2O7L1O1L1O4L2O29L1O4L2O21L1O4L2O7L1O1L1O4L2OfL1O39L1O4L2O43M2"
    "O3N9O14L3O10L10O56L2O6L3O26cL2O11L1O1aL5O4bN3L3O8L7M12O4L9M13O3LbM12O2LcOdL1O3M1O2LcM34O20L3"
    "O1L4M1O1N2OaN6OaM11O3M1N1OaL6O59L7M5L2M22L1O1L5O46LaO1fM1OcM4OcNaLaO1eL2O5LbO2cL4O1aN6ObL25M"
    "17O5L4M35OaM1O1dM2N1OaN6OaLdO1M8O1fM31L5M2fL11O8N3OaM11O9McL3M1eLdN2LaM2cOeLcM24O14N8OaL3N3L"
    "aO24L2O9L7O2bL2O3M10O3M1L15M4L1M6L1M2L3O1L5Mc0L40O116L2O6L2O26L2O6L2O8L1O1L1O1L1O1L1O1fL2O35"
    "L1O7L1O1L3O3L1O7L3O4L2O6L4OdL5O3L1O7N73L1O1N2O6L5N1OaL6OdM33O21L11O1L4O1L2OaL1O1L3O5L6O1L1O1"
    "L1O1L1O4L1ObL2O4L5O5L4O1N1L33N2O5N2d6O3cN4eO16N276O1eL46cOe5L6M4L3O2N9O1L2O26L1O1L5O1L2O38L7"
    "O1MfL1O17L9O7L1O7L1O7L1O7L1O7L1O7L1O7L1O7M1O20L2fO1L1d5N2O1N19M9O6L1O5N2L3O2L4O56M2O2L2O3L1O"
    "5aL1O4L5O2bL1O5eN3O4LaO20L30O10N20OaN1eO8N1OfN20OaN27OfL140O19c0L40O568dL43O2eL2O10dL3N10LaO"
    "2L14M2fO4M1OaL1M1fL2N46MaO2L25O9L2O67L2O40L5O2L1O1L1O5L18M10L1M3L1M4L1M17O5M4O1N3O6LaO34McL2"
    "M32O12NaOaM6L12O6L3O1L1M2N1LaM1cO8L2M17OdLcO1dM3L4M2fOeLeN1OaL6M5L1NaLaO5L1M29OeL9M3L1M8O2N2"
    "OaL6O17L3M1L3M32L1M1L3M2L2M5L2M1L1O1L18O3L2MbO5L2M3O2LaO6L2O6L2O6L9O7L1O7L1O2bL1OeL6M73O8M1O"
    "2N2OaL6O2ba4LcO17L4O31L2104O16eL2O6aL26O7LcO5L5M1L1OaL1OdL1O5L1O1L1O2L1O2L1O6cL21O16bL12O40L"
    "2O36L28OcM4O10M10O10L40O5L1O87N13OaL7O1aL6O1aLbO59L3O6L2O6L2O6L2O3L23OcL1O1aL1O13L1O2L1OfL2O"
    "eL22O7bNcO2dNcO39N11O2M71O1L82O1dL3O31MfN1O1bL4N20O4L9N14L1N8O1L5M26O5L5O1eL2O24L4O8N1O5L2aO"
    "9eN2OaL6O24L4O24L4O28L8O34LcObL1OfL1O7L1O2L1ObL1OfL1O7L1O2L43O137L9O16LaO8L18O6L1O2aL1O9L45O"
    "6L2O1L1O2cL1O2L3O1L2O17N2L8O17N2L7O1fN8O9L30O13L1O2N5L5N16O6L4O1aL46O38N4L2N2O10N2L2eM1O3M1O"
    "2M5L4O4L1O3L1O1dM2O3M4N1O9L17N1dO2L1N1dO3L20O8L1M1cO2N4O5L10O36LaO16N2L8O13N5L8O12N17O7L50O4"
    "9L37O33LdO33N7L6M24O4N8OaN126O1fL1O2aM1O2L3O2M4bL3N1dLaO1L8M16NbO4L1bM12O4L2aN15O7L14O17M9L3"
    "M35OfNbM1eL1M2L2O1M9L4M2dObM7O1LdO19N7OaM6L3M24OeN1OaL4M1L2O1L8M23O1L2O1M9L3M30LeO4M4O4M1N2L"
    "aO1L1O1N4O14LbO12L1M19OcM6L1M2O1L3eO7L1O1L1O4L1OfL1OaL7M2fOcN5OaM6O4L1O8L2O2L2O16L1O7L1O2L1O"
    "5M1L2M1O7M2O2M2O3L2O1M6O1L5M5O2M2O7M3O5L8bM35L12O4N5OaM4L1O3L1eM30L14O2L1O1N8OaLa6M2fO7M2O9L"
    "17M4O2L22M30O11L3O1NbOaL26M2bLdO1N7OaL36O1bM2OfN4OcL4O7Lb9M2cOfL65N40O13LcO8L2O1L2O8L1O2L1M1"
    "8O6M1O2M2L4M1L1M1O2NcOaL46O8L2M27O7M2L7O1L1M1O1L1bM1LaM28L7M1O4M8O1L8M1LbM2eO10L3O1L12O49L10"
    "7O9L1M25O8M1L8O1NfO1dL5O1eM2O16M1OeL49O7L1O2L1M26O6M3O1M1O2M1L7M1O1N8OaL6O6L1O2L1M20O5M1O2M1"
    "L5O1N7OaL136M13O4M9L2M1L1OdL1M22O7M3O5NdOaL56O1NfO15L2bO39aN66O6fL11Oc4La4cO61LfO430M10L1M6O"
    "fLfaaO247L21b9O239L7O1fN1OaL6O4fN1OaL6O1eM2O5LbM30O7L9O4NcOaN1O7L1O15L5O13L2b0N40O17L69O4bM4"
    "L1M1O37M7L4OdL40O2L1M1O1MbO2LeO17f8L8O4d6L2aO9L22e7O4L1O7L1O2L1O123LfO1L1dO3L2O1LeO4L8O18cL9"
    "04O6bL5OdL3O9L7OaM3O2M1261O2eM2O17M21eO5M3O6M8O8M2O7M1eO4M94O3N7bO14NcO14N6cO19L87O55L1O47L1"
    "O2L2O1L2O2L2O4L1OcL1O1L1O7L1O41L1O4L2O8L1O7L1O1cL1O4L1O5L1O1L3O7L1O154L2O19L1O19L1O1fL1O19L1"
    "O1fL1O19L1O1fL1O19L1O1fL1O19L1O8N2O32M200O37M4O32M8O1MeO1M16O5M1OfL450O1fL6O6Md5O7M1O11M2O7M"
    "1O2M1O5L5O3eM21O1L70O2dM3L7O7N2OaL4O1L141M1eO1L11M2cN4OaL1d6M1cN4OaL2e6O7L1O4L1O2L1OfL1Oc5N2"
    "M9O7L29M44L7O1N4OaN317O3bN1O3N1O4N4cO2dN1OfLc2O4L1O1bL1O2L1O1L2O1L1OaL1O4L1O1L1O1L6O1L4O1L1O"
    "1L1O1L1O3L1O2L1O1L2O1L1O1L1O1L1O1L1O1L1O2L1O1L2O4L1O7L1O4L1O4L1O1L1OaL1O11L5O3L1O5L1O11N244O"
    "dNae3OaL406Oa6e0L20O103aL6OdeL2O1682LeO1d31LfO26eL9a2O21eL5e2O134bL5O1060Madd50Of0"
)
