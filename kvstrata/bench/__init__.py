"""Benchmarks: `kvstrata bench serve` (any OpenAI-compatible server, peers side by side) and
`kvstrata bench offline` (the Python API, with the weight-bandwidth roofline).

    workloads.py   seeded request sequences: random, shared-prefix, multi-turn, trace:PATH
    client.py      one streamed request -> RequestResult (TTFT, ITL, usage) over httpx
    loadgen.py     open-loop arrivals (Poisson / gamma), sessions, concurrency cap, alternating runs
    metrics.py     percentiles, latency summaries, throughput, goodput under SLOs
    report.py      text tables with ratios, JSON, PNG of latency CDFs and throughput
    offline.py     prompts through LLMEngine, achieved weight bandwidth beside measured memory bandwidth
    cases.py       offline cases and results, stdlib only (the peers' scripts in other venvs load it too)
    roofline.py    weight bytes per step, measured memory read bandwidth
    quiet.py       wait for quiet cores before a measurement (stdlib only, as cases.py)

The command line is `kvstrata.entrypoints.cli.bench`; standalone scripts and peers are in benchmarks/.

Methodology follows `vllm bench serve` (peers.md §3) so figures compare with published ones.
"""
