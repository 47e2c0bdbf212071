"""HF transformers `generate()` on the offline cases: the plain-PyTorch baseline.

Prompts of one case have equal lengths, so the batch needs no padding; greedy, exactly
`output_len` new tokens (min_new_tokens), the static KV cache transformers picks by default.
"""

import torch
import transformers
from common import emit, parse_args, read_cases, time_case
from transformers import AutoModelForCausalLM


def main() -> None:
    args = parse_args(__doc__)
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).eval()
    settings = dict(do_sample=False, pad_token_id=2, eos_token_id=None)
    with torch.inference_mode():
        model.generate(torch.arange(1000, 1016).view(1, -1), max_new_tokens=8, **settings)
        results = []
        for case in read_cases(args.prompts):
            def generate(prompts: list[list[int]]) -> None:
                ids = torch.tensor(prompts)
                out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=case.output_len,
                                     min_new_tokens=case.output_len, **settings)
                assert out.shape[1] == ids.shape[1] + case.output_len
            results.append(time_case(case, generate, args.patience))
    emit(args.json, "transformers", transformers.__version__,
         {"torch": torch.__version__, "dtype": args.dtype, "threads": args.threads, "api": "generate()"}, results)


if __name__ == "__main__":
    main()
