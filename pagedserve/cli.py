"""pagedserve: an LLM server with continuous batching over a paged KV cache, and the tools to size it.

Engine flags are generated from ``EngineArgs``' fields, so the CLI, the offline API and the config
validation share one list of names, defaults and help texts.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import logging
import sys
import time
import typing

from pagedserve.config import EngineArgs
from pagedserve.errors import BenchmarkError, ConfigError, InvalidRequestError


def add_engine_args(parser: argparse.ArgumentParser, positional_model: bool = True) -> None:
    group = parser.add_argument_group("engine")
    hints = typing.get_type_hints(EngineArgs)
    for f in dataclasses.fields(EngineArgs):
        help_text = f.metadata["help"]
        if f.name == "model":
            if positional_model:
                parser.add_argument("model", nargs="?", default=f.default, help=help_text)
            else:
                group.add_argument("--model", default=f.default, help=help_text)
            continue
        name = "--" + f.name.replace("_", "-")
        kind = hints[f.name]
        if kind is bool:
            group.add_argument(name, action=argparse.BooleanOptionalAction, default=f.default, help=help_text)
        elif f.metadata.get("size"):
            group.add_argument(name, default=f.default, help=help_text)  # parsed (8k, 4GiB) by EngineArgs
        else:
            base = next((t for t in typing.get_args(kind) if t is not type(None)), kind)
            group.add_argument(name, type=base, default=f.default, help=help_text)


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    return EngineArgs(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(EngineArgs)})


def engine_flags(args: EngineArgs) -> list[str]:
    """The command-line flags that give ``args`` (those that differ from the defaults), for a server that a
    command starts with the engine it was asked about."""
    flags = []
    for f in dataclasses.fields(EngineArgs):
        value = getattr(args, f.name)
        if f.name == "model" or value == f.default:
            continue
        name = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(name if value else "--no-" + name[2:])
        else:
            flags += [name, str(value)]
    return flags


def setup_logging(level: str = "INFO") -> None:
    logging.basicConfig(level=level.upper(), format="%(levelname)s %(asctime)s [%(name)s] %(message)s",
                        datefmt="%m-%d %H:%M:%S", stream=sys.stderr)
    for chatty in ("httpx", "matplotlib"):  # a line per HTTP call or font scan drowns our own output
        logging.getLogger(chatty).setLevel(logging.WARNING)


DEFAULT_PROMPTS = [
    "Hello, my name is",
    "The capital of France is",
    "Continuous batching keeps the accelerator busy because",
    "The future of AI is",
]


def cmd_generate(ns: argparse.Namespace) -> None:
    """Offline generation: print the memory budget, then each completion, then throughput."""
    from pagedserve import LLM, SamplingParams

    from pagedserve.model.tiny import TINY_MODEL_NAMES

    args = engine_args_from(ns)
    llm = LLM(**dataclasses.asdict(args))
    if args.model in TINY_MODEL_NAMES:
        print("The built-in tiny model has random weights: it shows the engine at work, not language (expect "
              "gibberish). Pass a Hugging Face checkpoint folder for real text.\n")
    print("Memory budget:")
    for line in llm.memory_budget.report_lines():
        print("  " + line)
    prompts = ns.prompt or DEFAULT_PROMPTS
    params = SamplingParams(temperature=ns.temperature, max_tokens=ns.max_tokens, seed=ns.sampling_seed,
                            ignore_eos=ns.ignore_eos)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    for out in outputs:
        c = out.outputs[0]
        print(f"\nPrompt: {out.prompt!r}\nOutput: {c.text!r}\n  ({len(c.token_ids)} tokens, finish_reason={c.finish_reason})")
    total = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(f"\nGenerated {total} tokens for {len(outputs)} prompts in {elapsed:.2f} s ({total / elapsed:.1f} output tokens/s).")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's help ends with its default, also for options without a help text (which argparse
    would otherwise list bare)."""

    def _format_action(self, action: argparse.Action) -> str:
        if action.help is None and action.option_strings and action.default is not argparse.SUPPRESS:
            action = copy.copy(action)
            action.help = "(default: %(default)s)"
        return super()._format_action(action)


class Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        """A command with --config FILE takes the file's flags as its defaults, so that flags on the
        command line still win (vLLM's --config)."""
        ns, rest = super().parse_known_args(args, namespace)
        path = getattr(ns, "config", None)
        if path and any(a.dest == "config" for a in self._actions):
            try:
                self.set_defaults(**flags_from_file(path, self))
            except ConfigError as e:
                self.error(str(e))
            ns, rest = super().parse_known_args(args, namespace)
        return ns, rest


def build_parser() -> argparse.ArgumentParser:
    import pagedserve

    parser = Parser(prog="pagedserve", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"pagedserve {pagedserve.__version__}")
    sub = parser.add_subparsers(dest="command", parser_class=Parser, metavar="COMMAND")

    gen = sub.add_parser("generate", help="Generate completions offline (default: the built-in tiny model).")
    add_engine_args(gen)
    gen.add_argument("--prompt", action="append", help="A prompt (repeatable). Default: four sample prompts.")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--sampling-seed", type=int, default=None)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.set_defaults(func=cmd_generate)

    from pagedserve.server.cli import add_serve_parser

    add_serve_parser(sub)
    from pagedserve.bench.cli import add_bench_parser

    add_bench_parser(sub)
    from pagedserve.tune.cli import add_tune_parsers

    add_tune_parsers(sub)
    return parser


def flags_from_file(path: str, parser: argparse.ArgumentParser) -> dict:
    """--config FILE: a YAML mapping of flag names (with - or _) to values, for ``parser``'s defaults."""
    import yaml

    try:
        data = yaml.safe_load(open(path))
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"--config {path}: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: expected a mapping of flag names to values.")
    known = {a.dest for a in parser._actions}
    values = {str(k).lstrip("-").replace("-", "_"): v for k, v in data.items()}
    unknown = sorted(set(values) - known - {"config"})
    if unknown:
        raise ConfigError(f"--config {path}: unknown flag(s) {', '.join(unknown)} for `pagedserve {parser.prog.split()[-1]}`.")
    return values


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    ns = parser.parse_args(argv)
    if ns.command is None:
        parser.print_help()
        return
    ns.argv = argv  # recorded in results, to re-run them
    setup_logging(getattr(ns, "log_level", "INFO"))
    try:
        ns.func(ns)
    except (ConfigError, InvalidRequestError) as e:
        print(f"pagedserve {ns.command}: error: {e}", file=sys.stderr)
        sys.exit(2)
    except BenchmarkError as e:  # the load test could not run against the server
        print(f"pagedserve {ns.command}: error: {e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
