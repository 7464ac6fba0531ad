"""flash-tiny's logits and greedy tokens, in one process or as one rank of --ep/--pp.

test_dist.py runs `torchrun --nproc-per-node N tests/strata/dist_run.py OUT EP PP` and
compares rank 0's OUT (.npz) with `run()` in its own process."""
import sys

import numpy as np
import torch

PROMPT = 160  # tokens: past flash-tiny's QSA budget (64), so the sparse path runs


def run(path) -> dict:
    """Logits (PROMPT, vocab) of one prefill, and 8 greedy tokens after the prompt's first 20."""
    from strata.gguf import open_gguf
    from strata.load import load_model
    from strata.runtime import SamplingParams, generate
    from strata.tokenizer import Tokenizer
    g = open_gguf(path)
    model = load_model(g, torch.float32, "cpu", "torch")
    tokens = np.random.default_rng(0).integers(0, model.cfg.vocab_size, PROMPT)
    logits = model(torch.from_numpy(tokens), model.new_cache())
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    res = generate(model, Tokenizer.from_gguf(g), tokens[:20].tolist(), greedy)
    return {"logits": logits.numpy(), "tokens": np.asarray(res.tokens)}


def main(out: str, ep: int, pp: int) -> None:
    from strata import dist
    from strata.hub import flash_tiny_path
    torch.set_num_threads(1)
    comm = dist.init(ep, pp, timeout_s=120)
    try:
        res = run(flash_tiny_path())
        if comm.layout.rank == 0:
            np.savez(out, **res)
    finally:
        dist.close()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
