"""The model wing: from a file on disk to a decoder that runs a step over the paged KV cache.

Rooms, one per axis, each importing only the rooms below it (pyproject.toml's import-linter contract):

    loader.py, builder.py, fingerprint.py    the way through: plan, build once, the cache key
    network/      the decoder: layers, step loops, paged attention, RoPE, the fused C++ loop
    formats/      weight formats (none, int8, gguf): pack at load, the matmul, the footprint
    adapters/     LoRA adapters, applied per group of a step's rows
    sources/      where weights, config and tokenizer come from (GGUF conversion, HF folders, dummy weights)
    kernels/      our C++ kernels: one declared interface, one ISA choice, one build policy
    arch/         the description of a model (sizes, attention, RoPE), and its checkpoint's tensor names

What a new weight format and a new architecture each touch: docs/design/model.md, "The seams".
"""
