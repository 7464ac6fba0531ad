"""llama.cpp's tokenizer test vectors for the Qwen vocabularies, for tests/strata/test_tokenizer_vocabs.py.

    python scripts/fetch_vocab_tests.py                  # fetch into the cache, print the paths
    python scripts/fetch_vocab_tests.py --check-split 20000

The files come from the llama-cpp-python 0.3.36 sdist (its vendor/llama.cpp): the vocab-only
GGUFs models/ggml-vocab-{qwen2,qwen35}.gguf with the .inp/.out pairs llama.cpp's
tests/test-tokenizer-0 checks them against, and two Qwen chat templates (models/templates).
The sdist (about 77 MB) is fetched with `pip download` into a temporary directory (never built
or installed), only those members are read out of it, each is checked against its sha256
below, and they are kept under strata.cache.cache_dir()/vocabs/.

--check-split also takes llama.cpp's Unicode code (src/unicode*.{h,cpp}) from the sdist,
compiles it with g++ into a small program, and compares how it splits random text (and
every codepoint) into pre-tokens with strata.tokenizer's regexes, for each Qwen pre-tokenizer.
"""
from __future__ import annotations

import argparse
import os
import struct
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from strata.cache import cache_dir, locked, sha256

SDIST = "llama-cpp-python==0.3.36"
PREFIX = "llama_cpp_python-0.3.36/vendor/llama.cpp/"

# member (under PREFIX): (sha256, size in bytes)
VOCAB_FILES = {
    "models/ggml-vocab-qwen2.gguf":
        ("44c2f46b715f585c6ab513970e8a006bfa5badd6108560054921cf598d154d8c", 5928681),
    "models/ggml-vocab-qwen2.gguf.inp":
        ("be0a11f7071f0c67d3053a2d377d8f35f0dbcb77ff11a60300fb57d36b477cf0", 1943),
    "models/ggml-vocab-qwen2.gguf.out":
        ("de785bb305cc6fa9d43908ed5da337f853c0b79e971348fcfb9f0915a39c5363", 1765),
    "models/ggml-vocab-qwen35.gguf":
        ("63ed952ff338996cf0bdf24a7b10015124273f75c6dc9bb427356aa3f67ec62c", 5928682),
    "models/ggml-vocab-qwen35.gguf.inp":
        ("0fc6547e7876cd5b2ef64a9d319c6e39040eb53986660bd4227ed7ddef017a94", 2651),
    "models/ggml-vocab-qwen35.gguf.out":
        ("5efe225820325303857d0a087a8d59216f0d1e9a9e31133e7a5b44c3c4e1e9ca", 3570),
    "models/templates/Qwen-Qwen3-0.6B.jinja":
        ("87a2728cb8dc9fe424d624542f6060ec05a1d285ebbec578bb078900e33396b5", 4116),
    "models/templates/Qwen3.5-4B.jinja":
        ("a4aee8afcf2e0711942cf848899be66016f8d14a889ff9ede07bca099c28f715", 7756),
}
UNICODE_FILES = {
    "src/unicode.cpp": ("b1f3a18646197e21f7300c6d3b45c9faf52a123d58a38d7d54f3f225018da45d", 55284),
    "src/unicode.h": ("f1562388d5b9d2dac1152ad8eda56e0bcae25dd407cf15d9dd2e96fe0124f4e7", 3967),
    "src/unicode-data.cpp": ("95170cd1c105a5b41a1b2dce73b0fae8ce8011ef7897600828bb2babe8b26e5d", 168374),
    "src/unicode-data.h": ("1854f4494e5666db6036f0bf4cf818e01588b40b48a89e3372e775c4d5174402", 630),
}

# What pip prints when it cannot get at the index at all (no network, a proxy refusing, an
# offline mirror without the package), as opposed to a package that is there but broken.
_UNREACHABLE = ("NewConnectionError", "Failed to establish a new connection", "Network is unreachable",
                "Temporary failure in name resolution", "Name or service not known", "ProxyError",
                "Max retries exceeded", "ConnectTimeoutError", "ReadTimeoutError",
                "No matching distribution found")


class VocabFetchError(RuntimeError):
    """The test files could not be had; `unreachable` when pip could not get at PyPI at all."""

    def __init__(self, message: str, unreachable: bool = False):
        super().__init__(message)
        self.unreachable = unreachable


def vocab_dir() -> Path:
    return cache_dir() / "vocabs"


def _cached(files: dict[str, tuple[str, int]], dest: Path) -> bool:
    # a size check only: the sha256 was checked when the file was put there
    return all((dest / Path(m).name).is_file() and (dest / Path(m).name).stat().st_size == size
               for m, (_, size) in files.items())


def fetch(files: dict[str, tuple[str, int]] | None = None, quiet: bool = True) -> Path:
    """The directory holding `files` (default VOCAB_FILES, each by its base name), fetching
    and checking them first if need be."""
    files = VOCAB_FILES if files is None else files
    dest = vocab_dir()
    dest.mkdir(parents=True, exist_ok=True)
    if _cached(files, dest):
        return dest
    with locked(dest):  # parallel test workers fetch it once
        if not _cached(files, dest):
            _fetch(files, dest, quiet)
    return dest


def _fetch(files: dict[str, tuple[str, int]], dest: Path, quiet: bool) -> None:
    if not quiet:
        print(f"fetching the {SDIST} sdist (about 77 MB) for {len(files)} llama.cpp test files "
              f"into {dest}", file=sys.stderr)
    with tempfile.TemporaryDirectory(dir=dest) as tmp:
        # --no-binary for this package only: its build backend may still come as a wheel, so
        # pip's metadata step takes seconds, not a source build of scikit-build-core
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-python",
               "--quiet", "-d", tmp, SDIST]
        proc = subprocess.run(cmd, check=False, capture_output=True, text=True)
        if proc.returncode != 0:
            err = proc.stderr.strip()
            raise VocabFetchError(f"pip download {SDIST} failed: {err[-500:]}",
                                  unreachable=any(s in err for s in _UNREACHABLE))
        sdists = list(Path(tmp).glob("*.tar.gz"))
        if not sdists:
            raise VocabFetchError(f"pip download {SDIST} left no .tar.gz in {tmp}")
        wanted = {PREFIX + m: m for m in files}
        got: dict[str, Path] = {}
        # one pass through the stream: the sdist is large and the members few
        with tarfile.open(sdists[0], "r|gz") as tar:
            for info in tar:
                if info.name not in wanted or not info.isfile():
                    continue
                part = Path(tmp) / Path(wanted[info.name]).name
                with tar.extractfile(info) as src, open(part, "wb") as out:
                    while chunk := src.read(1 << 20):
                        out.write(chunk)
                got[wanted[info.name]] = part
        missing = sorted(set(files) - set(got))
        if missing:
            raise VocabFetchError(f"{sdists[0].name} has no {', '.join(missing)} under {PREFIX}; "
                                  f"a different sdist than the one these hashes are of")
        for member, (sha, _size) in files.items():
            if (h := sha256(got[member])) != sha:
                raise VocabFetchError(f"{member} in {sdists[0].name} has sha256 {h}, expected {sha}; "
                                      "not using it")
        for member in files:
            os.replace(got[member], dest / Path(member).name)


def read_vectors(inp: Path, out: Path) -> list[tuple[str, list[int]]]:
    """The (text, ids) pairs of a llama.cpp .inp/.out pair, split as tests/test-tokenizer-0.cpp
    splits them: inputs between "\\n__ggml_vocab_test__\\n" markers (the file ends with one),
    one line of space-separated ids per input."""
    raw = inp.read_bytes().decode("utf-8")
    sep = "\n__ggml_vocab_test__\n"
    texts = raw.split(sep)
    if texts[-1]:
        raise ValueError(f"{inp}: does not end with the {sep!r} marker")
    lines = out.read_bytes().decode("utf-8").split("\n")
    if lines[-1]:
        raise ValueError(f"{out}: does not end with a newline")
    texts, lines = texts[:-1], lines[:-1]
    if len(texts) != len(lines):
        raise ValueError(f"{inp} has {len(texts)} inputs but {out} has {len(lines)} lines")
    return [(t, [int(x) for x in line.split()]) for t, line in zip(texts, lines)]


# -- --check-split -----------------------------------------------------------------------------

_HARNESS = r"""
#include "unicode.h"
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>
// stdin: texts, each a little-endian uint32 byte length and its UTF-8; stdout: for each,
// the number of pieces, then the pieces (byte-level encoded, so never holding a newline).
int main(int argc, char ** argv) {
    const std::vector<std::string> exprs = {argv[1]};
    uint32_t n;
    while (fread(&n, 4, 1, stdin) == 1) {
        std::string s(n, '\0');
        if (n && fread(&s[0], 1, n, stdin) != n) return 1;
        const auto parts = unicode_regex_split(s, exprs, true);
        printf("%zu\n", parts.size());
        for (const auto & p : parts) printf("%s\n", p.c_str());
    }
    return 0;
}
"""

# Characters that sit on the edges of the Qwen regexes: contractions, CR/LF and other
# whitespace, digits of several scripts, combining marks, letters, punctuation, emoji, and
# codepoints llama.cpp's table leaves undefined.
_POOLS = [
    "aAzZsStTmMdDrReEvVlL'\u2019 \t\n\r",
    " \u00a0\u2028\u2029\u3000\u200b\u0085\x0b\x0c\x1c\x1d\x1e\x1f",
    "0123456789\u0660\u0661\u0662\u0969\u096a\u096b\u0be7\u00b9\u00b2\u00bd\u216b",
    "\u0301\u0308\u0327\u0903\u093f\u094d\u0e31\u0e48\u20dd\u200d\ufe0f\U0001f3fb\u0489",
    ("\u00e9\u00f1\u00e7\u00e5\u00f8\u00df\u0416\u0436\u03a9\u03c9\u05d0\u05d1\u0639\u0631\u0628"
     "\u0915\u094d\u0937\u093f\u0e2a\u0e27\u0e31\u0e14\u0e35\u65e5\u672c\u8a9e\ud55c\uad6d"),
    ".,;:!?-_()[]{}<>/\\|\"#$%&*+=@^`~\u2026\u2014\u00ab\u00bb\u201c\u201d",
    "\U0001f600\U0001f680\U0001f44d\U0001f3fb\U0001f1eb\U0001f1f7\u2764\ufe0f",
    "\x00\x01\x7f\ufffe\U000e0001\U0010fffd\U00050000\u0378\u08b5",
]


def check_split(n: int, seed: int = 0) -> int:
    """Mismatches between llama.cpp's split (compiled from the sdist) and strata's, over `n`
    random texts and every codepoint, per Qwen pre-tokenizer; prints the first few."""
    import random
    import shutil

    from strata.tokenizer import PRE_TOKENIZERS, Tokenizer

    if not shutil.which("g++"):
        raise SystemExit("--check-split compiles llama.cpp's src/unicode.cpp: install g++ (apt-get install g++)")
    src = fetch(UNICODE_FILES, quiet=False)
    rng = random.Random(seed)

    def text() -> str:
        out = []
        for _ in range(rng.randint(0, 24)):
            if rng.random() < 0.85:
                out.append(rng.choice(rng.choice(_POOLS)))
            else:
                c = rng.randint(0, 0x10FFFF - 0x800)
                out.append(chr(c + 0x800 if c >= 0xD800 else c))  # no surrogates: no UTF-8
        return "".join(out)

    cpts = [c for c in range(0x110000) if not 0xD800 <= c <= 0xDFFF]
    rng.shuffle(cpts)
    texts = [text() for _ in range(n)] + ["".join(map(chr, cpts[i:i + 16])) for i in range(0, len(cpts), 16)]
    data = b"".join(struct.pack("<I", len(t.encode())) + t.encode() for t in texts)
    bad = 0
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "split.cpp").write_text(_HARNESS)
        exe = Path(tmp) / "split"
        subprocess.run(["g++", "-O1", "-std=c++17", f"-I{src}", str(Path(tmp) / "split.cpp"),
                        str(src / "unicode.cpp"), str(src / "unicode-data.cpp"), "-o", str(exe)], check=True)
        for pre in ("qwen2", "qwen35"):
            if len(PRE_TOKENIZERS[pre]) != 1:
                raise SystemExit(f"{pre}: the harness passes one regex, strata has {len(PRE_TOKENIZERS[pre])}")
            lines = subprocess.run([str(exe), PRE_TOKENIZERS[pre][0]], input=data, capture_output=True,
                                   check=True).stdout.decode().split("\n")
            tok = Tokenizer(["a"], [1], [], pre=pre, bos_id=None, eos_id=None, add_bos=False, chat_template=None)
            at, mismatches = 0, 0
            for t in texts:
                k = int(lines[at])
                want, at = lines[at + 1:at + 1 + k], at + 1 + k
                got = [p for p, _ in tok._hf.pre_tokenizer.pre_tokenize_str(t)]
                if got != want:
                    mismatches += 1
                    if mismatches <= 5:
                        print(f"{pre}: {t!r}\n  llama.cpp {want}\n  strata    {got}")
            print(f"{pre}: {len(texts)} texts ({n} random, then every codepoint, 16 to a text), "
                  f"{mismatches} split differently")
            bad += mismatches
    return bad


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check-split", type=int, metavar="N",
                    help="compare pre-token splits with llama.cpp's compiled code on N random texts")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.check_split is not None:
        sys.exit(1 if check_split(args.check_split, args.seed) else 0)
    d = fetch(quiet=False)
    for m in VOCAB_FILES:
        print(d / Path(m).name)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    main()
