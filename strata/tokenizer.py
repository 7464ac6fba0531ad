"""The tokenizer and chat template of a GGUF model, giving the same token ids as llama.cpp.

Byte-level BPE (`tokenizer.ggml.model = "gpt2"`) runs in HuggingFace's `tokenizers`, built
from the GGUF's tokens and merges with the pre-tokenizer regexes llama.cpp picks for the
file's `tokenizer.ggml.pre` (src/llama-vocab.cpp, `llm_tokenizer_bpe`). Special tokens are
split out of the text here, in Python, by llama.cpp's own rule (`tokenizer_st_partition`:
the longest token first, wherever it is in the text), which is not the leftmost-longest
match of `tokenizers`' added tokens.
"""
from __future__ import annotations

import codecs
import functools
import operator
import os
import re
from datetime import datetime
from typing import Any, Iterable

import numpy as np

from strata.gguf.reader import GGUFError, GGUFFile


class TokenizerError(GGUFError):
    """A GGUF tokenizer Strata cannot build; the message names the file and the key."""


class TokenizerInputError(ValueError):
    """Input a built tokenizer cannot take: text with no UTF-8 form, a token id outside the
    vocabulary; the message names the tokenizer's file, what is wrong and where."""


class TokenIdError(TokenizerInputError, IndexError):
    """A token id that is not an integer in 0..vocab_size-1. Also an IndexError: the id
    indexes the vocabulary, and callers catching IndexError for it keep working."""


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

# tokenizer.ggml.token_type values (gguf-py's TokenType).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# Token texts llama.cpp treats as ending generation whatever their type, and marks as
# control tokens (llama-vocab.cpp, the special_eog_ids list).
EOG_TEXTS = frozenset([
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<｜end▁of▁sentence｜>", "[e~[",
])

_UNK_TEXT = "\x00strata-unk\x00"

# HuggingFace's ChatML template, for GGUFs that carry none.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _byte_decoder() -> dict[str, int]:
    # GPT-2's byte-to-unicode table, inverted: vocab texts spell each byte as one printable char.
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


@functools.cache
def _byte_lut() -> np.ndarray:
    """Code point -> the byte it spells in a byte-level text (`_byte_decoder`), or as its own
    UTF-8 where that is one byte (ASCII outside the alphabet); 256 for every other code point
    (the last entry stands for all past the table)."""
    dec = _byte_decoder()
    lut = np.full(max(map(ord, dec)) + 2, 256, dtype=np.int16)
    lut[:0x80] = np.arange(0x80)
    for c, b in dec.items():
        lut[ord(c)] = b
    return lut


def _byte_level_bytes(texts: list[str]) -> list[bytes]:
    """The bytes each byte-level text spells: `_byte_decoder`'s byte for each character of
    the alphabet, the UTF-8 of any other (as llama.cpp's token_to_piece), looked up for all
    texts at once; a text with characters outside the alphabet is spelled out alone."""
    lut = _byte_lut()
    # surrogatepass: a lone surrogate (no UTF-8 form) is looked up as past the table, and
    # the text holding it fails alone below as it always did
    cps = np.frombuffer("".join(texts).encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
    spelt = lut[np.minimum(cps, len(lut) - 1)]
    ends = np.cumsum(np.fromiter(map(len, texts), dtype=np.int64, count=len(texts)))
    flat = spelt.astype(np.uint8).tobytes()
    cuts = [0, *ends.tolist()]
    out = [flat[a:b] for a, b in zip(cuts, cuts[1:])]
    dec = _byte_decoder()
    for i in np.unique(np.searchsorted(ends, np.flatnonzero(spelt > 255), side="right")).tolist():
        out[i] = b"".join(bytes([dec[c]]) if c in dec else c.encode() for c in texts[i])
    return out


class Tokenizer:
    def __init__(self, tokens: list[str], token_types: list[int], merges: list[str], *,
                 pre: str, bos_id: int | None, eos_id: int | None, add_bos: bool,
                 chat_template: str | None, eot_id: int | None = None, source: str = "<tokenizer>"):
        from tokenizers import Regex, models, pre_tokenizers
        from tokenizers import Tokenizer as HFTokenizer

        self.source = source
        if pre not in PRE_TOKENIZERS:
            raise TokenizerError(
                f"{source}: tokenizer.ggml.pre = {pre!r} is not supported (supported: "
                f"{', '.join(sorted(PRE_TOKENIZERS))}); add its regexes from llama.cpp's "
                "src/llama-vocab.cpp to strata.tokenizer.PRE_TOKENIZERS and check them")
        if len(token_types) != len(tokens):
            raise TokenizerError(f"{source}: tokenizer.ggml.token_type has {len(token_types)} "
                                 f"entries for {len(tokens)} tokens; the file is damaged")
        types = [int(t) for t in token_types]
        eog = [i for i, text in enumerate(tokens) if text in EOG_TEXTS]
        for i in eog:
            types[i] = CONTROL
        self._types = types
        self.vocab_size = len(tokens)
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.add_bos = add_bos
        self.chat_template = chat_template
        eot = set(eog)
        eot |= {i for i in (eos_id, eot_id) if i is not None}
        self.eot_ids = frozenset(eot)

        # The bytes each id stands for: byte-level texts for ordinary tokens, the text itself
        # (UTF-8) for control and user-defined ones, as llama.cpp's token_to_piece.
        self._pieces: list[bytes] = []
        byte_level = [text for text, t in zip(tokens, types) if t not in (CONTROL, USER_DEFINED, UNKNOWN, UNUSED)]
        spelt = iter(_byte_level_bytes(byte_level))
        for text, t in zip(tokens, types):
            if t in (CONTROL, USER_DEFINED, UNKNOWN):
                self._pieces.append(text.encode())
            elif t == UNUSED:
                self._pieces.append(b"")
            else:
                self._pieces.append(next(spelt))

        # Ids llama.cpp matches verbatim in text before BPE, longest text first; ties keep id
        # order. Control and unknown ones only with parse_special.
        special = [i for i, t in enumerate(types) if t in (CONTROL, USER_DEFINED, UNKNOWN) and tokens[i]]
        special.sort(key=lambda i: -len(tokens[i].encode()))
        self._special = [(tokens[i], i, types[i] != USER_DEFINED) for i in special]

        # A character with no token (SmolLM2 lacks some control bytes, and 0xF1/0xF2) still
        # stands between its neighbours during merges in llama.cpp, and is dropped after.
        # `tokenizers` drops it before merging, so it maps here to an id past the vocabulary,
        # filtered out of encode's result; its text is no byte-level string.
        vocab = {text: i for i, text in enumerate(tokens)}
        self._unk = len(tokens)
        vocab[_UNK_TEXT] = self._unk
        # llama.cpp splits at the first space after the first character: the first space,
        # for a merge that does not start with one (all of them, in byte-level BPE); tuples
        # made at once (a list each kept until the end makes the collector walk them all)
        pairs = [tuple(m.split(" ", 1)) for m in merges]
        if not all(len(p) == 2 and p[0] for p in pairs):
            pairs = []
            for m in merges:
                cut = m.find(" ", 1)
                if cut < 0:
                    raise TokenizerError(f"{source}: tokenizer.ggml.merges entry {m!r} has no space")
                pairs.append((m[:cut], m[cut + 1:]))
        try:
            model = models.BPE(vocab=vocab, merges=pairs, unk_token=_UNK_TEXT)
        except Exception as e:
            raise TokenizerError(f"{source}: tokenizer.ggml.tokens and tokenizer.ggml.merges "
                                 f"do not form a BPE vocabulary: {e}") from e
        hf = HFTokenizer(model)
        hf.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(_with_classes(r)), behavior="isolated") for r in PRE_TOKENIZERS[pre]]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        self._hf = hf

    @classmethod
    def from_gguf(cls, gguf: GGUFFile | str | os.PathLike) -> Tokenizer:
        g = gguf if isinstance(gguf, GGUFFile) else GGUFFile(gguf)
        model = g.require("tokenizer.ggml.model")
        if model != "gpt2":
            raise TokenizerError(f"{g.path}: tokenizer.ggml.model = {model!r} is not supported; "
                                 "Strata reads only byte-level BPE tokenizers ('gpt2')")
        tokens = g.require("tokenizer.ggml.tokens")
        types = g.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
        return cls(tokens, types, g.require("tokenizer.ggml.merges"),
                   pre=g.get("tokenizer.ggml.pre", "default"),
                   bos_id=g.get("tokenizer.ggml.bos_token_id"),
                   eos_id=g.get("tokenizer.ggml.eos_token_id"),
                   eot_id=g.get("tokenizer.ggml.eot_token_id"),
                   # absent, llama.cpp adds no BOS for the pre-types supported here
                   add_bos=bool(g.get("tokenizer.ggml.add_bos_token", False)),
                   chat_template=g.get("tokenizer.chat_template"),
                   source=str(g.path))

    # -- encoding ---------------------------------------------------------------------------

    def _partition(self, text: str, parse_special: bool) -> list[str | int]:
        # llama.cpp's tokenizer_st_partition: each special token in turn, longest first,
        # cuts every remaining text fragment at each of its occurrences.
        parts: list[str | int] = [text] if text else []
        for s, sid, is_control in self._special:
            if is_control and not parse_special:
                continue
            if not any(isinstance(p, str) and s in p for p in parts):
                continue
            out: list[str | int] = []
            for p in parts:
                if isinstance(p, int) or s not in p:
                    out.append(p)
                    continue
                pieces = p.split(s)
                for k, piece in enumerate(pieces):
                    if k:
                        out.append(sid)
                    if piece:
                        out.append(piece)
            parts = out
        return parts

    def encode(self, text: str, add_bos: bool | None = None, parse_special: bool = True) -> list[int]:
        """Token ids of `text`; add_bos None follows the GGUF's tokenizer.ggml.add_bos_token.

        `text` is any str that has a UTF-8 form: all of Unicode but lone surrogates, which
        raise TokenizerInputError (a ValueError). `decode` gives the text back, less the
        bytes the vocabulary has no token for (llama.cpp drops them too: for SmolLM2 the
        controls U+0004, U+0006, U+0013, U+0014, U+0016, U+001D and the lead byte of
        U+40000..U+BFFFF, whose other bytes decode as U+FFFD).
        """
        if not isinstance(text, str):
            raise TypeError(f"encode takes a str, got {type(text).__name__}; decode bytes first")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            # A lone surrogate (from errors="surrogateescape" or "surrogatepass", or a JSON
            # "\ud800" escape) has no bytes to tokenize; `tokenizers` refuses such a str
            # with a TypeError that says nothing of the text.
            raise TokenizerInputError(
                f"{self.source}: cannot encode text with U+{ord(text[e.start]):04X}, a lone "
                f"surrogate, at index {e.start}: it has no UTF-8 form; decode the bytes the text "
                f"came from with errors='replace' (or fix the escape that made it)") from None
        parts = self._partition(text, parse_special)
        raw = [p for p in parts if isinstance(p, str)]
        encoded = iter(self._hf.encode_batch(raw, add_special_tokens=False)) if raw else iter(())
        ids: list[int] = []
        if (self.add_bos if add_bos is None else add_bos):
            if self.bos_id is None:
                raise TokenizerError(f"{self.source}: add_bos asked for, but "
                                     "tokenizer.ggml.bos_token_id is missing")
            ids.append(self.bos_id)
        for p in parts:
            if isinstance(p, str):
                ids.extend(i for i in next(encoded).ids if i != self._unk)
            else:
                ids.append(p)
        return ids

    # -- decoding ---------------------------------------------------------------------------

    def _check(self, token_id: int) -> int:
        try:
            # operator.index: a float or a str would otherwise reach the comparison or the
            # list index below and fail with a TypeError naming neither the id nor the vocabulary
            i = operator.index(token_id)
        except TypeError:
            raise TokenIdError(f"{self.source}: token id {token_id!r} is a "
                               f"{type(token_id).__name__}, not an integer") from None
        if not 0 <= i < self.vocab_size:
            raise TokenIdError(f"{self.source}: token id {i} is outside the vocabulary "
                               f"(0..{self.vocab_size - 1})")
        return i

    def is_special(self, token_id: int) -> bool:
        """Control and unknown tokens: the ones decode(skip_special=True) leaves out."""
        return self._types[self._check(token_id)] in (CONTROL, UNKNOWN)

    def token_bytes(self, token_id: int) -> bytes:
        return self._pieces[self._check(token_id)]

    def token_to_piece(self, token_id: int) -> str:
        """The text of one token; a token holding part of a UTF-8 character shows U+FFFD."""
        return self.token_bytes(token_id).decode("utf-8", errors="replace")

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """The text of `ids` (bytes that are no whole UTF-8 character show as U+FFFD);
        TokenIdError for an id that is not an integer in 0..vocab_size-1."""
        return b"".join(self.token_bytes(i) for i in ids
                        if not (skip_special and self.is_special(i))).decode("utf-8", errors="replace")

    def stream(self, skip_special: bool = False) -> StreamDecoder:
        return StreamDecoder(self, skip_special)

    # -- chat -------------------------------------------------------------------------------

    @property
    def has_thinking_switch(self) -> bool:
        """Whether the chat template reads `enable_thinking` (Qwen3 and later): only then does
        apply_chat_template's enable_thinking change the prompt."""
        return "enable_thinking" in (self.chat_template or "")

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            *, enable_thinking: bool | None = None, **kwargs: Any) -> str:
        """The prompt text for `messages`, rendered as HuggingFace's apply_chat_template does.

        enable_thinking: False asks a template with a thinking switch for an answer without
        reasoning (Qwen3's writes an empty <think></think> block after the generation prompt);
        None leaves the variable undefined, so the template takes its own default (thinking on
        for Qwen3). Templates without the switch ignore it. Other keywords (tools, ...) reach
        the template as variables.
        """
        template = _compile(self.chat_template or CHATML_TEMPLATE)
        bos = "" if self.bos_id is None else self.token_to_piece(self.bos_id)
        eos = "" if self.eos_id is None else self.token_to_piece(self.eos_id)
        if enable_thinking is not None:
            # Qwen's templates test `enable_thinking is false`, true only of False itself: a 0
            # or "false" from a config file would leave thinking on without a word.
            if not isinstance(enable_thinking, bool):
                raise TypeError(f"enable_thinking must be True, False or None, "
                                f"got {enable_thinking!r}")
            kwargs["enable_thinking"] = enable_thinking
        return template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                               bos_token=bos, eos_token=eos, **kwargs)

    def __repr__(self) -> str:
        return f"Tokenizer({self.source!r}, vocab_size={self.vocab_size})"


class StreamDecoder:
    """Text of ids fed one at a time, holding back bytes of a UTF-8 character not yet whole.

    Joined, the pieces `feed` and `flush` return equal `Tokenizer.decode` of all the ids.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False):
        self._tok = tokenizer
        self._skip = skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_id: int) -> str:
        if self._skip and self._tok.is_special(token_id):
            return ""
        return self._utf8.decode(self._tok.token_bytes(token_id))

    def flush(self) -> str:
        """What is left at the end of the stream: U+FFFD for an unfinished character."""
        return self._utf8.decode(b"", final=True)


_TEMPLATES: dict[str, Any] = {}


def _compile(source: str):
    # HuggingFace's chat-template environment: sandboxed, trimmed blocks, loop controls,
    # tojson without ASCII escapes, raise_exception and strftime_now helpers.
    if source not in _TEMPLATES:
        import json

        import jinja2.ext
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str):
            raise TemplateError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent,
                              separators=separators, sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        _TEMPLATES[source] = env.from_string(source)
    return _TEMPLATES[source]


# -- Unicode classes ---------------------------------------------------------------------------

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


def _with_classes(regex: str) -> str:
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
                                     "to llama.cpp's Unicode classes; add it to _with_classes")
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
