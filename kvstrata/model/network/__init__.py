"""The network room: the decoder that runs a step over the paged KV cache.

    decoder.py        DecoderModel, made once from ModelParts (what the builder made) and Kernels (which of ours)
    layer.py          a layer's Python steps around attention (norms, projections, RoPE, the MLP)
    steps.py          the step loops (fused C++, kernel, torch), the one chosen when a model is made
    fused.py          a step's layers in one C++ call
    attention.py      paged attention: the plan of a step, the kernel's calls, the torch paths
    rope.py           rotary tables
    compiled.py       `--compile`
    forward_batch.py  one step's work as tensors (the runner's to build)

It calls projections (`proj(x)`) and kernels through their rooms' faces; it never asks which weight format
made a projection.
"""
