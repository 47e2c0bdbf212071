"""Print the HF-format folder of the default model (safetensors + config.json + tokenizer + chat
template), as kvstrata's own loader converts the GGUF; vLLM and transformers serve this folder.

    .venv/bin/python benchmarks/peers/export_hf.py      # -> /root/.cache/kvstrata/models/gguf-<sha>-v1

The folder already has everything vLLM 0.32 needs (`rope_theta` beside `rope_parameters`,
`chat_template.jinja`), so it is used as it is, never copied.
"""

from kvstrata.entrypoints.cli.bench import default_model_folder

if __name__ == "__main__":
    print(default_model_folder())
