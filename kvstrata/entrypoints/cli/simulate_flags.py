"""`kvstrata simulate`'s flags: the trace, the engines, speculation, the cost model and the output
(kvstrata.entrypoints.cli.simulate runs what they ask)."""

from __future__ import annotations

import argparse
from pathlib import Path

from kvstrata.core.config import POLICIES, SPECULATIVE_EXAMPLE, WRITE_POLICIES
from kvstrata.entrypoints.cli.calibrate import add_engine_timing
from kvstrata.entrypoints.cli.simulate import CAPACITIES, FROM_PROFILE, run_simulate, tokens
from kvstrata.sim.config import SimConfig
from kvstrata.sim.roofline import HARDWARE, MODELS
from kvstrata.sim.routing import ROUTERS
from kvstrata.sim.speculation import DEFAULT_ALPHA


# ---- the flags -----------------------------------------------------------------------------------
def add_simulate(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("simulate", help="replay a trace through the real scheduler and tiers "
                                                  "on a virtual clock")
    _add_trace_flags(parser)
    _add_engine_flags(parser)
    _add_speculation_flags(parser)
    _add_cost_flags(parser)
    output = _add_output_flags(parser)
    add_engine_timing(output)          # --validate runs and times the engine as calibrate does
    parser.set_defaults(run=run_simulate)


def _add_trace_flags(parser: argparse.ArgumentParser) -> None:
    """Which requests of the trace, how fast they arrive and how long they are."""
    trace = parser.add_argument_group("trace")
    trace.add_argument("--trace", required=True, help="Mooncake-format jsonl (timestamp, input_length, "
                                                      "output_length, hash_ids)")
    trace.add_argument("--max-requests", type=int, default=None, help="replay only the first N requests")
    trace.add_argument("--skip", type=int, default=None, help="start after the first N requests (default 0; "
                                                               "the slice's own with --validate)")
    trace.add_argument("--time-scale", type=float, default=None,
                       help="multiply arrival times (2: half the rate; default 1, or fitted to the engine "
                            "with --validate)")
    trace.add_argument("--max-input-tokens", type=int, default=None, help="cut longer prompts (keeps their prefix)")
    trace.add_argument("--max-output-tokens", type=int, default=None, help="cut longer outputs")


def _add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """Each engine's caches and scheduling, and the fleet."""
    engine = parser.add_argument_group("engines")
    engine.add_argument("--block-size", type=int, default=None,
                        help="engine block size, a power of two dividing 512 (default 512; 16 with --validate)")
    engine.add_argument("--device-cache-tokens", type=tokens, default=FROM_PROFILE,
                        help="device KV tokens per engine, or inf (default: what the hardware holds "
                             "beside the weights, from the profile)")
    engine.add_argument("--host-cache-tokens", type=tokens, default=0, help="host KV tokens per engine, "
                                                                          "inf, or 0 (none)")
    engine.add_argument("--store-cache-tokens", type=tokens, default=0, help="store KV tokens shared by all "
                                                                           "engines, inf, or 0 (none)")
    engine.add_argument("--instances", type=int, default=1, help="engines in the fleet")
    engine.add_argument("--router", default="round_robin", choices=list(ROUTERS))
    engine.add_argument("--prefill-instances", type=int, default=None,
                        help="prefill/decode disaggregation: prefill engines (--router over them), beside "
                             "--decode-instances decode engines (prefix_affinity over them), handing KV over "
                             "through the store; compared with as many colocated engines (--router)")
    engine.add_argument("--decode-instances", type=int, default=None, help="see --prefill-instances")
    engine.add_argument("--pd-splits", default=None, metavar="P:D,P:D,..",
                        help="several prefill:decode splits (e.g. 1:3,2:2,3:1), each against as many colocated "
                             "engines; with --slo-ttft-ms / --slo-tpot-ms, the layout to run for each fleet size")
    engine.add_argument("--local-prefill-tokens", type=int, default=0,
                        help="with a P:D split: prompts whose decode engine lacks at most this many of their tokens "
                             "are prefilled there, not handed over (as `kvstrata router --local-prefill-tokens`; "
                             "default 0: every prompt handed over)")
    engine.add_argument("--slo-ttft-ms", type=float, default=None,
                        help="a request's TTFT target: with --pd-splits, recommend the layout whose requests "
                             "meet the SLO most often")
    engine.add_argument("--slo-tpot-ms", type=float, default=None, help="a request's TPOT target (see --slo-ttft-ms)")
    engine.add_argument("--max-num-seqs", type=int, default=None,
                        help=f"requests running at once per engine (default {SimConfig.max_num_seqs})")
    engine.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help=f"token budget of a step (default {SimConfig.max_num_batched_tokens})")
    engine.add_argument("--policy", default="fcfs", choices=POLICIES)
    engine.add_argument("--max-tpot-ms", type=float, default=SimConfig.max_tpot_ms,
                        help="the engine's step-time target: while requests decode, cut each step's prefill to "
                             "what the step cost learned from the simulated steps says fits (`kvstrata serve` "
                             "defaults to 150; default 0: no cut, as --validate runs the engine)")
    engine.add_argument("--host-cores", type=float, default=None,
                        help="cores the whole fleet shares (engines of one thread, as the profile was calibrated): "
                             "a step starting while more engines compute than there are cores, each with its "
                             "--serving-overhead, takes that much longer (default: a core per engine)")
    engine.add_argument("--serving-overhead", type=float, default=0.0,
                        help="with --host-cores, or a P:D --validate: CPU seconds the fleet spends around a second "
                             "of steps (HTTP, streaming, the router, the store's server); a P:D --validate prints "
                             "what its fleets used (default 0)")
    engine.add_argument("--write-policy", default="write_back", choices=WRITE_POLICIES)
    engine.add_argument("--store-timeout", type=float, default=SimConfig.store_timeout)
    engine.add_argument("--swa-full", action="store_true",
                        help="a hybrid profile's sliding layers at full length in every tier (`kvstrata serve "
                             "--swa-full`), not in KV groups keeping their windows (the default)")


def _add_speculation_flags(parser: argparse.ArgumentParser) -> None:
    """Speculative decoding: the engine's config, and the workload's acceptance the simulator draws from."""
    spec = parser.add_argument_group("speculative decoding")
    spec.add_argument("--speculative-config", metavar="JSON", default=None,
                      help="as `kvstrata serve` takes it (num_speculative_tokens, disable_by_batch_size; the "
                           f"lookup fields are the engine's), e.g. '{SPECULATIVE_EXAMPLE}': the trace is replayed "
                           "without and with it, and the report says what it buys; with --validate, the "
                           "engine's speed-up against the predicted one at two loads")
    spec.add_argument("--spec-acceptance", metavar="A|A1,A2,..", default=None,
                      help="the workload's draft acceptance: one number, each draft accepted with that "
                           "probability after an accepted one (geometric); or per position i, P(at least i "
                           "drafts accepted) in a step with drafts, as the engine's spec_decode_num_accepted_"
                           f"tokens_per_pos / spec_decode_num_drafts measure it (default {DEFAULT_ALPHA})")
    spec.add_argument("--spec-draft-rate", type=float, default=None,
                      help="share of decodes that find a draft (an n-gram lookup can miss; default 1)")
    spec.add_argument("--spec-draft-lengths", metavar="S1,S2,..", default=None,
                      help="per position i, P(a draft has at least i tokens): 1 first (default: every draft "
                           "has num_speculative_tokens)")


def _add_cost_flags(parser: argparse.ArgumentParser) -> None:
    """Where step and transfer times come from: a calibrated profile or a roofline."""
    cost = parser.add_argument_group("cost model").add_mutually_exclusive_group()
    cost.add_argument("--profile", type=Path, default=None, help="a JSON profile from `kvstrata calibrate`")
    cost.add_argument("--hardware", choices=list(HARDWARE), default=None,
                      help="a roofline profile of this hardware (default: h100)")
    parser.add_argument("--model", choices=list(MODELS), default="llama3-8b", help="model size for --hardware")


def _add_output_flags(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """What to write, sweep or validate; returns the group, which also takes the engine-timing flags."""
    out = parser.add_argument_group("output")
    out.add_argument("--audit", action="store_true", help="audit every engine after every simulated step")
    out.add_argument("--output-json", type=Path, default=None, help="also write the figures here, as JSON")
    out.add_argument("--plot", type=Path, default=None, help="write PNG plots into this folder")
    out.add_argument("--sweep", default=None, metavar="PARAM=A,B,C",
                     help=f"run once per value of one capacity ({', '.join(CAPACITIES)})")
    out.add_argument("--validate", action="store_true",
                     help="replay a slice on the real engine and in the simulator at three loads (or at "
                          "--time-scale); print the figures and relative errors. With --prefill-instances and "
                          "--decode-instances: the trace through a real P:D fleet and P+D colocated engines "
                          "(--router) on this machine, each with a fresh Redis, against the simulator")
    out.add_argument("--slice", default=None, choices=("plain", "sessions", "speculative"),
                     help="--validate: the slice (plain, the default: a real slice, device cache only; sessions: "
                          "chat sessions shrunk to 32 tokens per hash id, host tier and disk store on; "
                          "speculative, the default with --speculative-config: 10 requests of up to 128 tokens)")
    out.add_argument("--repeat", type=int, default=1,
                     help="--validate: engine replays per load (the spread is noise); of a P:D fleet, the trace's "
                          "next slice of --max-requests each time")
    return out
