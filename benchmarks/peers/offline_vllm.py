"""vLLM (CPU build) `LLM.generate` on the offline cases, prompts as token ids, ignore_eos.

Its engine core starts in a spawned process, hence the __main__ guard; it drops torch to one
thread unless OMP_NUM_THREADS is set, which the caller does (run_all.py sets it to --threads).
"""

import vllm
from common import emit, parse_args, read_cases, time_case


def main() -> None:
    args = parse_args(__doc__)
    config = dict(dtype=args.dtype, max_model_len=2048, max_num_seqs=64, seed=0)
    llm = vllm.LLM(model=args.model, **config)
    llm.generate([vllm.TokensPrompt(prompt_token_ids=list(range(1000, 1016)))],
                 vllm.SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
    results = []
    for case in read_cases(args.prompts):
        params = vllm.SamplingParams(temperature=0, max_tokens=case.output_len, min_tokens=case.output_len,
                                     ignore_eos=True)

        def generate(prompts: list[list[int]]) -> None:
            outs = llm.generate([vllm.TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
            assert all(len(o.outputs[0].token_ids) == case.output_len for o in outs)
        results.append(time_case(case, generate, args.patience))
    emit(args.json, "vllm", vllm.__version__, config, results)


if __name__ == "__main__":
    main()
