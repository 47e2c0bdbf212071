"""llama.cpp (llama-cpp-python) on the offline cases, serving the Q4_1 GGUF directly.

The high-level `Llama` class decodes one sequence at a time, so a batch goes through the
low-level `llama_batch` API: one sequence id per prompt, prompts prefilled in one batch, then
one token per live sequence per decode; `kv_unified=False` (independent sequences are faster,
research/assets.md). Greedy: argmax of each sequence's logits, EOS never stops a sequence.

`--prompt-lookup 0,4`: instead, each prompt alone through the high-level `Llama.generate`
(greedy sampler), without a draft model (0) and with llama.cpp's prompt-lookup decoding
(`LlamaPromptLookupDecoding(num_pred_tokens=K)`, its default n-gram size), the only way
llama-cpp-python speculates; both through the same API, so the ratio is the lookup's alone.
"""

import argparse

import llama_cpp
import numpy as np
from common import Speculation, digest, emit, parse_args, read_cases, time_case
from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

N_BATCH = 512


def generate(ctx, vocab: int, prompts: list[list[int]], output_len: int) -> None:
    n = len(prompts)
    batch = llama_cpp.llama_batch_init(max(N_BATCH, n), 0, 1)
    memory = llama_cpp.llama_get_memory(ctx)
    llama_cpp.llama_memory_clear(memory, True)
    try:
        tokens: dict[int, int] = {}                        # sequence -> its last sampled token
        flat = [(s, i, t) for s, p in enumerate(prompts) for i, t in enumerate(p)]
        for start in range(0, len(flat), N_BATCH):        # prefill, N_BATCH tokens per decode
            chunk = flat[start:start + N_BATCH]
            batch.n_tokens = len(chunk)
            ends = []
            for j, (s, i, t) in enumerate(chunk):
                batch.token[j], batch.pos[j], batch.n_seq_id[j] = t, i, 1
                batch.seq_id[j][0] = s
                batch.logits[j] = i == len(prompts[s]) - 1
                if batch.logits[j]:
                    ends.append((s, j))
            assert llama_cpp.llama_decode(ctx, batch) == 0
            tokens.update({s: _argmax(ctx, j, vocab) for s, j in ends})
        for step in range(1, output_len):                  # decode: one token per sequence
            batch.n_tokens = n
            for s in range(n):
                batch.token[s], batch.pos[s], batch.n_seq_id[s] = tokens[s], len(prompts[s]) + step - 1, 1
                batch.seq_id[s][0], batch.logits[s] = s, True
            assert llama_cpp.llama_decode(ctx, batch) == 0
            tokens = {s: _argmax(ctx, s, vocab) for s in range(n)}
    finally:
        llama_cpp.llama_batch_free(batch)


def _argmax(ctx, index: int, vocab: int) -> int:
    logits = llama_cpp.llama_get_logits_ith(ctx, index)
    return int(np.argmax(np.ctypeslib.as_array(logits, shape=(vocab,))))


class CountedLookup(LlamaPromptLookupDecoding):
    """Prompt-lookup decoding that counts its proposals: `Llama.generate` asks once per verification
    (and once after the prompt), so accepted drafts = output tokens - 1 - calls, to within the last one."""

    def __init__(self, num_pred_tokens: int):
        super().__init__(num_pred_tokens=num_pred_tokens)
        self.calls = self.drafts = self.draft_tokens = 0

    def __call__(self, input_ids, /, **kwargs):
        draft = super().__call__(input_ids, **kwargs)
        self.calls += 1
        self.drafts += len(draft) > 0
        self.draft_tokens += len(draft)
        return draft


def lookup_cases(args: argparse.Namespace, cases: list, lookups: list[int]) -> list:
    """Every case's prompts one at a time through `Llama.generate`, once per number of draft tokens."""
    n_ctx = max(len(p) for c in cases for r in c.repeats for p in r) + max(c.output_len for c in cases) + 64 + max(lookups)
    results = []
    for k in lookups:
        draft = CountedLookup(k) if k else None
        llm = llama_cpp.Llama(args.model, n_ctx=n_ctx, n_threads=args.threads, n_threads_batch=args.threads,
                              n_batch=N_BATCH, draft_model=draft, verbose=False,
                              logits_all=draft is not None)     # else its score buffer holds n_batch rows only
        _generate_alone(llm, [case.repeats[0][0][:16] for case in cases[:1]], 8)       # warm-up, untimed
        results += [_lookup_case(llm, draft, case, args.patience) for case in cases]
        del llm
    return results


def _lookup_case(llm, draft: CountedLookup | None, case, patience: float):
    digests, counted = [], []

    def generate(prompts: list[list[int]]) -> None:
        before = (draft.calls, draft.drafts, draft.draft_tokens) if draft else (0, 0, 0)
        outputs = _generate_alone(llm, prompts, case.output_len)
        digests.append(digest(outputs))
        if draft:
            accepted = len(prompts) * (case.output_len - 1) - (draft.calls - before[0])
            counted.append(Speculation(draft.drafts - before[1], draft.draft_tokens - before[2], accepted))

    result = time_case(case, generate, patience)
    result.name = f"{case.name} {f'lookup K={draft.num_pred_tokens}' if draft else 'off'}"
    result.output_digests = digests
    result.speculation = counted[result.elapsed_s.index(min(result.elapsed_s))] if counted else None
    return result


def _generate_alone(llm, prompts: list[list[int]], output_len: int) -> list[list[int]]:
    """Each prompt alone, greedy, exactly `output_len` tokens (EOS does not stop `Llama.generate`)."""
    outputs = []
    for prompt in prompts:
        tokens = []
        for token in llm.generate(prompt, temp=0.0, top_k=1, repeat_penalty=1.0, reset=True):
            tokens.append(int(token))
            if len(tokens) == output_len:
                break
        outputs.append(tokens)
    return outputs


def main() -> None:
    args = parse_args(__doc__, lambda p: p.add_argument(
        "--prompt-lookup", default=None, help="draft tokens per step, comma-separated (0: none): each prompt alone "
                                              "through Llama.generate, with LlamaPromptLookupDecoding when > 0"))
    cases = read_cases(args.prompts)
    if args.prompt_lookup is not None:
        lookups = [int(k) for k in args.prompt_lookup.split(",")]
        config = {"gguf": args.model, "threads": args.threads, "n_batch": N_BATCH, "api": "Llama.generate (high level)",
                  "prompt_lookup": lookups, "max_ngram_size": LlamaPromptLookupDecoding().max_ngram_size}
        emit(args.json, "llama.cpp", llama_cpp.__version__, config, lookup_cases(args, cases, lookups))
        return
    max_seqs = max(len(r) for c in cases for r in c.repeats)
    n_ctx = max(len(p) for c in cases for r in c.repeats for p in r) + max(c.output_len for c in cases)
    llama_cpp.llama_backend_init()
    model_params = llama_cpp.llama_model_default_params()
    model = llama_cpp.llama_model_load_from_file(args.model.encode(), model_params)
    vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
    params = llama_cpp.llama_context_default_params()
    params.n_ctx, params.n_batch, params.n_ubatch = n_ctx * max_seqs, N_BATCH, N_BATCH
    params.n_seq_max, params.n_threads, params.n_threads_batch = max_seqs, args.threads, args.threads
    params.kv_unified = False
    ctx = llama_cpp.llama_init_from_model(model, params)
    generate(ctx, vocab, [list(range(1000, 1016))], 8)
    results = []
    for case in cases:
        results.append(time_case(case, lambda prompts: generate(ctx, vocab, prompts, case.output_len), args.patience))
    config = {"gguf": args.model, "threads": args.threads, "n_batch": N_BATCH, "kv_unified": False,
              "api": "llama_batch (low level)"}
    emit(args.json, "llama.cpp", llama_cpp.__version__, config, results)
    llama_cpp.llama_free(ctx)
    llama_cpp.llama_model_free(model)


if __name__ == "__main__":
    main()
