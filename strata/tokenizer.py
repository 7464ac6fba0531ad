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
from datetime import datetime
from typing import Any, Iterable

import numpy as np

from strata.gguf.reader import GGUFError, GGUFFile
from strata.pretokenizers import PRE_TOKENIZERS, with_classes


class TokenizerError(GGUFError):
    """A GGUF tokenizer Strata cannot build; the message names the file and the key."""


class TokenizerInputError(ValueError):
    """Input a built tokenizer cannot take: text with no UTF-8 form, a token id outside the
    vocabulary; the message names the tokenizer's file, what is wrong and where."""


class TokenIdError(TokenizerInputError, IndexError):
    """A token id that is not an integer in 0..vocab_size-1. Also an IndexError: the id
    indexes the vocabulary, and callers catching IndexError for it keep working."""


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
                "src/llama-vocab.cpp to strata.pretokenizers.PRE_TOKENIZERS and check them")
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
            [pre_tokenizers.Split(Regex(with_classes(r)), behavior="isolated") for r in PRE_TOKENIZERS[pre]]
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
