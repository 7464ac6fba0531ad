"""llama-perplexity's perplexity and KL divergence over a text, for any model with
`new_cache(capacity)` and `forward(tokens, cache, last_only=False)`: the text (`text`), PPL
over its chunks (`scoring`), the base model's log-probs saved for later (`saved`), and the KL
divergence of a model from that base (`kld`). The public names of all four are here; the
`strata perplexity` command that prints their progress is strata.cli.eval.
"""
from strata.perplexity.kld import DP_PERCENTILES, KLD_PERCENTILES, KLDResult, kl_divergence, kld_rows, print_kld
from strata.perplexity.saved import (
    DEFAULT_TOP_K,
    LOGITS_FORMAT,
    BaseChunk,
    SavedLogits,
    base_from_logits,
    save_logits,
)
from strata.perplexity.scoring import (
    LogitsModel,
    PerplexityResult,
    chunk_logits,
    iter_chunks,
    log_probs,
    mean_err,
    n_chunks_of,
    perplexity,
    scored_targets,
    token_nll,
)
from strata.perplexity.text import STDLIB_MODULES, stdlib_text, text_sha256

__all__ = [
    "DEFAULT_TOP_K", "DP_PERCENTILES", "KLDResult", "KLD_PERCENTILES", "LOGITS_FORMAT", "STDLIB_MODULES",
    "BaseChunk", "LogitsModel", "PerplexityResult", "SavedLogits", "base_from_logits", "chunk_logits",
    "iter_chunks", "kl_divergence", "kld_rows", "log_probs", "mean_err", "n_chunks_of", "perplexity",
    "print_kld", "save_logits", "scored_targets", "stdlib_text", "text_sha256", "token_nll",
]
