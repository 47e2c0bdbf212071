"""Benchmarks: `kvstrata bench serve` (any OpenAI-compatible server, peers side by side) and
`kvstrata bench offline` (the Python API, with the weight-bandwidth roofline).

    workloads.py   seeded request sequences: random, shared-prefix, multi-turn, trace:PATH
    client.py      one streamed request -> RequestResult (TTFT, ITL, usage, the response's id) over httpx
    loadgen.py     open-loop arrivals (Poisson / gamma), sessions, concurrency cap, alternating runs
    metrics.py     percentiles, latency summaries, throughput, goodput under SLOs (--slo)
    tails.py       the slowest 1% (e2e, TTFT) and where their time went, from the server's /v1/timelines
                   (kvstrata keeps them, a peer does not; --no-timelines skips the fetch)
    report.py      text tables with ratios, the headline (throughput beside goodput), JSON, PNG of latency
                   CDFs and throughput; a sweep (--request-rate 0.5,1,inf): its summary and PNG of p99s by rate
    offline.py     prompts through LLMEngine, achieved weight bandwidth beside measured memory bandwidth
    cases.py       offline cases and results, stdlib only (the peers' scripts in other venvs load it too)
    grounded.py    chat prompts whose replies quote or edit them (code edits, with or without OpenAI
                   predictions; summaries with quotes) and a chat workload that does not: speculative decoding
    texts.py       the source files, passages and questions grounded.py is made of
    roofline.py    weight bytes per step, measured memory read bandwidth
    quiet.py       wait for quiet cores before a measurement (stdlib only, as cases.py)

The command line is `kvstrata.entrypoints.cli.bench`; standalone scripts and peers are in benchmarks/.

Methodology follows `vllm bench serve` (peers.md §3) so figures compare with published ones.
"""
