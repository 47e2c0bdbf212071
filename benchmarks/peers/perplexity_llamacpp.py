"""llama.cpp's perplexity on the token ids kvstrata scores (benchmarks/quant_accuracy.py --llamacpp).

Reads {"tokens": [...], "window": W} and scores it as quant_accuracy.py does: windows of W tokens, each its
own sequence from an empty cache, every position's logits (`logits_all`), exp of the mean negative
log-likelihood of each next token. Prints and writes {"perplexity", "count"}.
"""

import argparse
import json
import math

import llama_cpp
import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="the GGUF file")
    parser.add_argument("--tokens", required=True, help="JSON: tokens and window")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", required=True)
    args = parser.parse_args()
    job = json.loads(open(args.tokens).read())
    tokens, window = job["tokens"], job["window"]
    llm = llama_cpp.Llama(args.model, n_ctx=window, n_batch=window, n_ubatch=window, n_threads=args.threads,
                          n_threads_batch=args.threads, logits_all=True, verbose=False)
    nll, count = 0.0, 0
    for start in range(0, len(tokens) - 1, window):
        chunk = tokens[start:start + window]
        if len(chunk) < 2:
            break
        llm.reset()
        llm.eval(chunk)
        logits = np.asarray(llm.scores[:len(chunk) - 1], dtype=np.float64)           # (n - 1, vocab)
        top = logits.max(axis=1, keepdims=True)
        log_z = np.log(np.exp(logits - top).sum(axis=1)) + top[:, 0]
        nll += float((log_z - logits[np.arange(len(chunk) - 1), chunk[1:]]).sum())
        count += len(chunk) - 1
    result = {"perplexity": math.exp(nll / count), "count": count, "version": llama_cpp.__version__}
    print(f"llama.cpp {llama_cpp.__version__}: perplexity {result['perplexity']:.4f} over {count} predicted tokens")
    open(args.json, "w").write(json.dumps(result))


if __name__ == "__main__":
    main()
