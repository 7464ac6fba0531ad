"""The text perplexity is measured on: `stdlib_text()`, the docstrings of a fixed list of
standard-library modules (STDLIB_MODULES), so that every machine has it without a download,
and `text_sha256` to name it. Docstrings move a little between Python versions, so each
result carries the text's token count and sha256.
"""
from __future__ import annotations

import hashlib
import importlib
import inspect
import warnings

# Pure-Python or C modules whose docstrings do not depend on the platform (no os, sys,
# socket, subprocess: their members differ between Linux, macOS and Windows).
STDLIB_MODULES = (
    "abc", "argparse", "ast", "base64", "bisect", "calendar", "cmd", "codecs", "collections",
    "colorsys", "configparser", "contextlib", "copy", "csv", "dataclasses", "datetime",
    "decimal", "difflib", "enum", "fnmatch", "fractions", "functools", "getopt", "gettext",
    "glob", "graphlib", "gzip", "hashlib", "heapq", "hmac", "html.parser", "http.client",
    "inspect", "ipaddress", "itertools", "json", "logging", "numbers", "operator", "optparse",
    "pathlib", "pickle", "pprint", "queue", "random", "re", "sched", "secrets", "shlex",
    "shutil", "statistics", "string", "struct", "tarfile", "tempfile", "textwrap", "threading",
    "timeit", "tokenize", "traceback", "typing", "unittest", "urllib.parse", "uuid",
    "warnings", "weakref", "zipfile",
)


def _own_doc(obj) -> str | None:
    """The object's own docstring, dedented (inspect.getdoc would inherit a base class's)."""
    doc = getattr(obj, "__doc__", None)
    return inspect.cleandoc(doc) if isinstance(doc, str) and doc.strip() else None


def _module_docs(name: str) -> str:
    mod = importlib.import_module(name)
    out = [f"{name}\n{'=' * len(name)}\n\n{_own_doc(mod) or ''}"]
    for attr, obj in sorted(vars(mod).items()):
        if attr.startswith("_") or not (inspect.isclass(obj) or inspect.isroutine(obj)):
            continue
        if getattr(obj, "__module__", None) != name:  # re-exported from elsewhere
            continue
        if doc := _own_doc(obj):
            out.append(f"{name}.{attr}\n\n{doc}")
        if inspect.isclass(obj):
            for member, v in sorted(vars(obj).items()):
                f = v.__func__ if isinstance(v, (staticmethod, classmethod)) else v
                if member.startswith("_") or not (inspect.isroutine(f) or isinstance(f, property)):
                    continue
                # a method some other package patched in (transformers adds logging.Logger
                # .warning_once on import) would make the text depend on what was imported
                if getattr(f.fget if isinstance(f, property) else f, "__module__", name) not in (name, None):
                    continue
                if doc := _own_doc(f):
                    out.append(f"{name}.{attr}.{member}\n\n{doc}")
    return "\n\n".join(out)


def stdlib_text(modules: tuple[str, ...] = STDLIB_MODULES) -> str:
    """Docstrings of `modules` (module, then its public classes and functions by name, then
    each class's methods by name): about 436k characters, 116k SmolLM2 tokens on 3.11."""
    with warnings.catch_warnings():  # typing.io and typing.re warn when touched
        warnings.simplefilter("ignore", DeprecationWarning)
        return "\n\n\n".join(_module_docs(m) for m in modules) + "\n"


def text_sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()
