import pytest

from strata.gguf import open_gguf
from strata.hub import pull_smollm2


@pytest.fixture(scope="session")
def smollm2_gguf():
    """SmolLM2-135M-Instruct Q4_1, pulled into the cache on first use (about 93 MB)."""
    return open_gguf(pull_smollm2(quiet=True))


@pytest.fixture(scope="session")
def smollm2_bf16(smollm2_gguf):
    from strata.load import load_model
    return load_model(smollm2_gguf)


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_gguf):
    from strata.tokenizer import Tokenizer
    return Tokenizer.from_gguf(smollm2_gguf)


@pytest.fixture(scope="session")
def llama_tools_text():
    """The text llama-perplexity and llama-imatrix read for the golden data (the first
    20,000 characters of strata.perplexity.stdlib_text() on Python 3.11), kept as a file:
    docstrings move between Python versions."""
    import json
    from pathlib import Path

    from strata.perplexity import text_sha256
    data = Path(__file__).resolve().parents[1] / "data"
    text = (data / "llama_tools_text.txt").read_text(encoding="utf-8")
    assert text_sha256(text) == json.loads((data / "llama_tools_golden.json").read_text())["text"]["sha256"]
    return text


@pytest.fixture(scope="session")
def flash_tiny_gguf():
    """flash-tiny (built into the cache on first use), opened."""
    from strata.hub import synth_flash_tiny
    return open_gguf(synth_flash_tiny(quiet=True))


@pytest.fixture(scope="session")
def flash_tiny_pack(flash_tiny_gguf, tmp_path_factory):
    """flash-tiny's experts packed (`strata pack`) into a directory of this session."""
    from strata.storage.pack import pack
    d = tmp_path_factory.mktemp("pack")
    pack(flash_tiny_gguf.path, d, say=lambda _msg: None)
    return d
