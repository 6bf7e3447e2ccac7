"""pagedserve: an LLM server with continuous batching over a paged KV cache, and the tools to size it.

Each subcommand lives with what it runs (server/cli.py, bench/cli.py, tune/cli.py); the flags they share
are in args.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

from pagedserve.args import (Parser, add_engine_args, engine_args_from, non_negative_float, positive_int,
                             setup_logging, vllm_flag_hint)
from pagedserve.errors import reported

DEFAULT_PROMPTS = [
    "Hello, my name is",
    "The capital of France is",
    "Continuous batching keeps the accelerator busy because",
    "The future of AI is",
]


def cmd_generate(ns: argparse.Namespace) -> None:
    """Offline generation: print the memory budget, then each completion, then throughput."""
    from pagedserve import LLM, SamplingParams

    from pagedserve.builtin.tiny import TINY_MODEL_NAMES

    args = engine_args_from(ns)
    llm = LLM(**dataclasses.asdict(args))
    if args.model in TINY_MODEL_NAMES:
        print("The built-in tiny model has random weights: it shows the engine at work, not language (expect "
              "gibberish). Pass a Hugging Face checkpoint folder for real text.\n")
    print("Memory budget:")
    for line in llm.memory_budget.report_lines():
        print("  " + line)
    prompts = ns.prompt or DEFAULT_PROMPTS
    gen = llm.engine.config.generation  # the model's recommended defaults for the flags left unset
    temperature = ns.temperature if ns.temperature is not None else gen.sampling.get("temperature", 0.0)
    params = SamplingParams(**{**gen.sampling, "temperature": temperature},
                            max_tokens=ns.max_tokens or gen.max_tokens or 32, seed=ns.sampling_seed,
                            ignore_eos=ns.ignore_eos)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    for out in outputs:
        c = out.outputs[0]
        print(f"\nPrompt: {out.prompt!r}\nOutput: {c.text!r}\n  ({len(c.token_ids)} tokens, finish_reason={c.finish_reason})")
    total = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(f"\nGenerated {total} tokens for {len(outputs)} prompts in {elapsed:.2f} s ({total / elapsed:.1f} output tokens/s).")


def build_parser() -> argparse.ArgumentParser:
    import pagedserve

    parser = Parser(prog="pagedserve", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"pagedserve {pagedserve.__version__}")
    sub = parser.add_subparsers(dest="command", parser_class=Parser, metavar="COMMAND")

    gen = sub.add_parser("generate", help="Generate completions offline (default: the built-in tiny model).")
    add_engine_args(gen)
    gen.add_argument("--prompt", action="append", help="A prompt (repeatable). Default: four sample prompts.")
    gen.add_argument("--max-tokens", type=positive_int, default=None,
                     help="Tokens to generate per prompt (default: the model's max_new_tokens, else 32).")
    gen.add_argument("--temperature", type=non_negative_float, default=None,
                     help="Sampling temperature (default: the model's, else 0: greedy).")
    gen.add_argument("--sampling-seed", type=int, default=None)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.set_defaults(func=cmd_generate)

    from pagedserve.server.cli import add_serve_parser

    add_serve_parser(sub)
    from pagedserve.bench.cli import add_bench_parser

    add_bench_parser(sub)
    from pagedserve.tune.cli import add_tune_parsers

    add_tune_parsers(sub)
    from pagedserve.sim.cli import add_sim_parsers

    add_sim_parsers(sub)
    return parser


def _server_flag_hint(parser: argparse.ArgumentParser, ns: argparse.Namespace, rest: list[str]) -> str:
    """Where server flags go for the benchmarks that talk to a server: they are the likeliest unknown ones there."""
    command = getattr(ns, "bench_command", None)
    if command not in ("serve", "sweep"):
        return ""
    serve = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["serve"]
    flags = {s for a in serve._actions for s in a.option_strings}
    given = [name for name in (a.split("=")[0] for a in rest) if name in flags]
    if not given:
        return ""
    what = f"{', '.join(given)} {'is a server flag' if len(given) == 1 else 'are server flags'}"
    if command == "sweep":
        return f" ({what}; `bench sweep` starts its servers with --serve-args, e.g. --serve-args '{' '.join(rest)}')"
    return f" ({what}; `bench serve` is a client: give {'it' if len(given) == 1 else 'them'} to `pagedserve serve`)"


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    ns, rest = parser.parse_known_args(argv)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}{vllm_flag_hint(rest)}"
                     f"{_server_flag_hint(parser, ns, rest)}")
    if ns.command is None:
        parser.print_help()
        return
    ns.argv = argv  # recorded in results, to re-run them
    setup_logging(getattr(ns, "log_level", "INFO"))
    with reported(f"pagedserve {ns.command}"):
        ns.func(ns)


if __name__ == "__main__":
    main()
