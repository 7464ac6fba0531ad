"""Tokenizer metadata for GGUF from a Hugging Face byte-level BPE tokenizer (tokenizer.json).

The keys and values are those llama.cpp's converter writes for a "gpt2" vocabulary
(`_set_vocab_gpt2`): every id below the config's vocab_size as a token (holes become
`[PAD<id>]`, UNUSED), added tokens typed CONTROL when special or when they look special
(`<|...|>`), else USER_DEFINED; `tokenizer.ggml.pre` named by the sha256 of the ids of
a fixed check text, which is how llama.cpp tells pre-tokenizers apart; then merges,
special token ids, add_bos/add_eos and the chat template through gguf-py's SpecialVocab.
"""
from __future__ import annotations

import json
from hashlib import sha256
from pathlib import Path
from typing import Any

from gguf import GGUFValueType, GGUFWriter, SpecialVocab

from .errors import ConvertError

# gguf-py's TokenType values
NORMAL, CONTROL, USER_DEFINED, UNUSED = 1, 3, 4, 5

# The check text of llama.cpp's convert_hf_to_gguf_update.py; its token ids, hashed, name
# the pre-tokenizer. Only the hashes of tokenizers Strata has met are listed: add a line
# (from llama.cpp's get_vocab_base_pre) when a new one comes.
CHECK_TEXT = (
    '\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ (multiple emojis concatenated) ✅ '
    '🦙🦙 3 33 333 3333 33333 333333 3333333 33333333 3.3 3..3 3...3 កាន់តែពិសេសអាច😁 ?我想在apple工作1314151天～ '
    '------======= нещо на Български \'\'\'\'\'\'```````""""......!!!!!!?????? I\'ve been \'told he\'s there, '
    '\'RE you sure? \'M not sure I\'ll make it, \'D you like some tea? We\'Ve a\'lL'
)
PRE_BY_HASH = {
    "855059429035d75a914d1eda9f10a876752e281a054a7a3d421ef0533e5b6249": "smollm",  # SmolLM, SmolLM2
    "d30d75d9059f1aa2c19359de71047b3ae408c70875e8a3ccf8c5fba56c9d8af4": "qwen35",  # Qwen3.5
    "1444df51289cfa8063b96f0e62b1125440111bc79a52003ea14b6eac7016fd5f": "qwen35",
    "e636dc30a262dcc0d8c323492e32ae2b70728f4df7dfe9737d9f920a282b8aea": "qwen2",  # Qwen1.5 .. Qwen3
    "d4540891389ea895b53b399da6ac824becc30f2fba0e9ddbb98f92e55ca0e97c": "qwen2",
}


def _looks_special(text: str) -> bool:
    # llama.cpp's does_token_look_special: some models leave control tokens unmarked
    return (text in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
            or (text.startswith("<|") and text.endswith("|>"))
            or (text.startswith("<｜") and text.endswith("｜>"))
            or (text.startswith("<unused") and text.endswith(">")))


def pre_tokenizer_name(tok, where: Path) -> str:
    ids = tok.encode(CHECK_TEXT).ids
    digest = sha256(str(ids).encode()).hexdigest()
    name = PRE_BY_HASH.get(digest)
    if name is None:
        raise ConvertError(f"{where}: the BPE pre-tokenizer is not one Strata knows (check-text hash "
                           f"{digest}); add its llama.cpp name to strata/convert/vocab.py PRE_BY_HASH")
    return name


def gpt2_vocab_metadata(hf_dir: Path, vocab_size: int) -> list[tuple[str, Any, GGUFValueType]]:
    """(key, value, type) for the tokenizer, in llama.cpp's order."""
    from tokenizers import Tokenizer

    path = hf_dir / "tokenizer.json"
    if not path.is_file():
        raise ConvertError(f"{hf_dir}: no tokenizer.json; save the model's tokenizer beside config.json "
                           f"(tokenizer.save_pretrained)")
    tok = Tokenizer.from_file(str(path))
    model = json.loads(path.read_text(encoding="utf-8")).get("model", {})
    if model.get("type") != "BPE":
        raise ConvertError(f"{path}: a {model.get('type')} tokenizer; strata convert handles byte-level BPE only")

    vocab = tok.get_vocab(with_added_tokens=True)
    if vocab and max(vocab.values()) >= vocab_size:
        raise ConvertError(f"{path}: token id {max(vocab.values())} is beyond the config's vocab_size {vocab_size}")
    added = tok.get_added_tokens_decoder()  # id -> AddedToken
    reverse = {i: t for t, i in vocab.items()}
    tokens: list[str] = []
    types: list[int] = []
    for i in range(vocab_size):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(UNUSED)
            continue
        text = reverse[i]
        if i in added:
            if not added[i].normalized:
                # llama.cpp expects control and user-defined tokens pre-normalized
                text = tok.decode(tok.encode(text, add_special_tokens=False).ids, skip_special_tokens=False)
            if added[i].special or _looks_special(text):
                types.append(CONTROL)
            else:
                text = text.replace("\u2581", " ")
                types.append(USER_DEFINED)
        else:
            types.append(NORMAL)
        tokens.append(text)

    out = [
        ("tokenizer.ggml.model", "gpt2", GGUFValueType.STRING),
        ("tokenizer.ggml.pre", pre_tokenizer_name(tok, path), GGUFValueType.STRING),
        ("tokenizer.ggml.tokens", tokens, GGUFValueType.STRING),
        ("tokenizer.ggml.token_type", types, GGUFValueType.INT32),
    ]
    out += _special_vocab(hf_dir)
    return out


def _normalizer_flags(normalizer: dict | None, flags: dict[str, bool]) -> None:
    # newer gguf-py writes these two flags from tokenizer.json's normalizer; the released
    # gguf package does not yet, so they are read here, the same way
    if not normalizer:
        return
    kind = normalizer.get("type")
    if kind == "Lowercase":
        flags["lowercase"] = True
    elif kind == "StripAccents":
        flags["strip_accents"] = True
    elif kind == "BertNormalizer":
        for key, flag in (("lowercase", "lowercase"), ("strip_accents", "strip_accents")):
            if key in normalizer and normalizer[key] is not None:
                flags[flag] = bool(normalizer[key])
    elif kind == "Sequence":
        for part in normalizer.get("normalizers", []):
            _normalizer_flags(part, flags)


def _special_vocab(hf_dir: Path) -> list[tuple[str, Any, GGUFValueType]]:
    """Merges, special token ids, add_*_token and the chat template, as gguf-py's
    SpecialVocab reads them (tokenizer.json, tokenizer_config.json, chat_template.jinja,
    config.json); a path-less GGUFWriter records the keys with their types."""
    w = GGUFWriter(None, "none")
    SpecialVocab(hf_dir, load_merges=True).add_to_gguf(w, quiet=True)
    out = []
    for k, v in w.kv_data[0].items():
        if k.startswith("general."):
            continue
        vtype = v.type
        if vtype == GGUFValueType.ARRAY:  # the writer infers an array's element type when it writes
            vtype = v.sub_type or GGUFValueType.get_type(v.value[0])
        out.append((k, v.value, vtype))
    flags: dict[str, bool] = {}
    _normalizer_flags(json.loads((hf_dir / "tokenizer.json").read_text(encoding="utf-8")).get("normalizer"), flags)
    for name in ("lowercase", "strip_accents"):
        if name in flags:
            out.append((f"tokenizer.ggml.normalizer.{name}", flags[name], GGUFValueType.BOOL))
    return out
