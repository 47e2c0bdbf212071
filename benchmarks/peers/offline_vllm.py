"""vLLM (CPU build) `LLM.generate` on the offline cases, prompts as token ids, ignore_eos.

Its engine core starts in a spawned process, hence the __main__ guard; it drops torch to one
thread unless OMP_NUM_THREADS is set, which the caller does (run_all.py sets it to --threads).

`--load-format dummy --model llama-3.2-1b` runs vLLM's random weights at a shape of kvstrata's
`--load-format dummy` (a shipped shape's name, a config.json or its folder): the folder it serves is
written by dummy_model_dir.py (config + SmolLM2's tokenizer, no weights). Size VLLM_CPU_KVCACHE_SPACE
for the shape: it is allocated on top of the weights (2.5 GB for the 1B in bf16, 16 GB for the 8B).
"""

import vllm
from common import emit, parse_args, read_cases, time_case
from dummy_model_dir import write_dir


def main() -> None:
    args = parse_args(__doc__, lambda p: p.add_argument(
        "--load-format", choices=("auto", "dummy"), default="auto",
        help="dummy: vLLM's random weights at --model's shape (a shipped shape, a config.json or its folder)"))
    model = str(write_dir(args.model)) if args.load_format == "dummy" else args.model
    config = dict(dtype=args.dtype, max_model_len=2048, max_num_seqs=64, seed=0, load_format=args.load_format)
    llm = vllm.LLM(model=model, **config)
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
