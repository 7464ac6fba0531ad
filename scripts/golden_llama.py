"""Golden data for the `llama` model, from llama.cpp and from transformers.

    python scripts/golden_llama.py [--model PATH] [--out tests/data/smollm2_golden.json]

For three prompts of 100+ tokens:
- llama.cpp (llama-cpp-python 0.3.36, CPU): the prompt's token ids, the top-16 logits at
  every position, the greedy 64-token continuation and the top-16 at each of its steps;
- transformers (the math reference, fp32, the GGUF dequantized by transformers' own
  loader): its logits at llama.cpp's top-16 ids at every position, and its own greedy
  continuation.
Both peers are used here only; Strata never imports them at run time. transformers
needs `pip install transformers accelerate`.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

PROMPTS = [
    # prose
    "The lighthouse keeper had not spoken to another person in three months when the storm "
    "finally broke. He climbed the spiral stairs every evening at dusk, trimmed the wick, and "
    "wound the clockwork that turned the great lens. Ships passed far out on the horizon, "
    "their lights like slow stars. On the ninety-third night, a small boat appeared in the "
    "cove below, its sail torn and its hull scraping against the rocks. He ran down to the "
    "shore with a lantern and a coil of rope, and",
    # technical, with numbers
    "A hash table stores key-value pairs in an array of buckets. To insert a key, the table "
    "computes hash(key) mod n, where n is the number of buckets, and places the pair in that "
    "bucket. When two keys land in the same bucket, a collision occurs; chaining keeps a list "
    "per bucket, while open addressing probes the next slots (linear probing tries i+1, i+2, "
    "and so on). The load factor is the ratio of stored items to buckets: at 0.75, many "
    "implementations double the array and rehash every key. Lookups therefore take",
    # chat template, special tokens
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "<|im_start|>user\nWrite a short Python function that returns the n-th Fibonacci number "
    "iteratively, and explain in two sentences why the iterative version is faster than the "
    "naive recursive one. Then give the first ten Fibonacci numbers as a list.<|im_end|>\n"
    "<|im_start|>assistant\n",
]
# the chat prompt is short: give it a longer conversation so that it has 100+ tokens
PROMPTS[2] = PROMPTS[2].replace("<|im_start|>user\n", "<|im_start|>user\nI am learning Python and "
    "I keep reading that recursion can be slow for some problems, especially when the same "
    "subproblem is solved many times over. My teacher used the Fibonacci sequence as an "
    "example. ", 1)


def add_transformers(model_path: str, out: dict, n_cont: int) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    path = Path(model_path)
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    hf.eval()
    out["reference"] = "transformers fp32 (LlamaForCausalLM from the GGUF)"
    with torch.no_grad():
        for p in out["prompts"]:
            logits = hf(torch.tensor([p["ids"]])).logits[0]
            p["hf_at_top_ids"] = np.round(torch.gather(logits, 1, torch.tensor(p["top_ids"])).numpy(), 5).tolist()
            p["hf_argmax"] = logits.argmax(-1).tolist()
            seq = list(p["ids"])  # plain argmax, end-of-turn tokens included, as for llama.cpp
            for _ in range(n_cont):
                seq.append(int(hf(torch.tensor([seq])).logits[0, -1].argmax()))
            p["hf_greedy"] = seq[len(p["ids"]):]


def main() -> None:
    from llama_cpp import Llama

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="GGUF path (default: the cached SmolLM2)")
    ap.add_argument("--out", default="tests/data/smollm2_golden.json")
    ap.add_argument("--continue-tokens", type=int, default=64)
    args = ap.parse_args()
    if args.model is None:
        from strata.hub import pull_smollm2
        args.model = str(pull_smollm2())
    llm = Llama(args.model, n_ctx=1024, n_threads=2, logits_all=True, verbose=False, seed=0)
    out = {"model": Path(args.model).name, "engine": "llama-cpp-python 0.3.36, CPU, 2 threads",
           "top_k": 16, "prompts": []}
    for text in PROMPTS:
        ids = llm.tokenize(text.encode(), add_bos=False, special=True)
        assert len(ids) >= 100, len(ids)
        llm.reset()
        llm.eval(ids)
        scores = np.array(llm.scores[:len(ids)], dtype=np.float32)
        top = np.argsort(-scores, axis=-1, kind="stable")[:, :16]
        vals = np.take_along_axis(scores, top, -1)
        cont, cont_top, cont_logits = [], [], []
        last = scores[-1]
        for _ in range(args.continue_tokens):
            order = np.argsort(-last, kind="stable")[:16]
            cont_top.append(order.tolist())
            cont_logits.append(np.round(last[order], 4).tolist())
            tok = int(order[0])
            cont.append(tok)
            llm.eval([tok])
            last = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
        out["prompts"].append({
            "text": text, "ids": [int(i) for i in ids],
            "top_ids": top.tolist(), "top_logits": np.round(vals, 4).tolist(),
            "greedy": cont, "greedy_top_ids": cont_top, "greedy_top_logits": cont_logits,
        })
    add_transformers(args.model, out, args.continue_tokens)
    Path(args.out).write_text(json.dumps(out))
    print(f"wrote {args.out}: " + ", ".join(f"{len(p['ids'])} tokens" for p in out["prompts"]))


if __name__ == "__main__":
    main()
