"""Command-line pieces every subcommand shares: engine flags generated from ``EngineArgs`` (so the CLI,
the offline API and config validation share one list of names, defaults and help), the parser class
(every default shown; ``--config FILE``), output files, and logging."""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import logging
import math
import sys
import tempfile
import typing
from pathlib import Path

from pagedserve.config import EngineArgs
from pagedserve.errors import ConfigError, option


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
        name = option(f.name)
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
        name = option(f.name)
        if isinstance(value, bool):
            flags.append(name if value else "--no-" + name[2:])
        else:
            flags += [name, json.dumps(value) if isinstance(value, dict) else str(value)]
    return flags


_LOCAL_ONLY = "weights are never downloaded here: give a local checkpoint folder"
_XGRAMMAR = "structured output always compiles with xgrammar: leave it out"
_OVERRIDE = "vLLM's older flag: give the value in --hf-overrides, e.g. '{\"rope_scaling\": {...}}'"
# vLLM flags with no counterpart here, and what to do instead: launch scripts brought from vLLM name them
_VLLM_ONLY_FLAGS = {
    "--download-dir": _LOCAL_ONLY, "--revision": _LOCAL_ONLY, "--tokenizer-revision": _LOCAL_ONLY,
    "--code-revision": _LOCAL_ONLY, "--hf-token": _LOCAL_ONLY,
    "--tokenizer-mode": "the folder's tokenizer loads through transformers' AutoTokenizer: leave it out",
    "--swap-space": "a preempted request is recomputed, never swapped to host memory (as in vLLM V1): leave it out",
    "--cpu-offload-gb": "weights stay on the GPU: shard them with --tensor-parallel-size instead",
    "--pipeline-parallel-size": "only tensor parallelism here: use --tensor-parallel-size",
    "--data-parallel-size": "one engine a server: run a server for each GPU group behind a load balancer",
    "--distributed-executor-backend": "tensor-parallel ranks are local processes: leave it out",
    "--disable-custom-all-reduce": "ranks all-reduce through NCCL: leave it out",
    "--max-seq-len-to-capture": "vLLM's older name: use --max-cudagraph-capture-size",
    "--compilation-config": "steps replay CUDA graphs of the engine's own kernels, no torch.compile: leave it out "
                            "(--enforce-eager turns the graphs off)",
    "--async-scheduling": "the engine always schedules a step while the one before it runs: leave it out",
    "--rope-scaling": _OVERRIDE, "--rope-theta": _OVERRIDE,
    "--guided-decoding-backend": _XGRAMMAR, "--structured-outputs-config": _XGRAMMAR,
    "--disable-sliding-window": "a sliding-window model already runs, with whole-context attention, up to its "
                                "window: leave it out",
    "--enable-lora": "LoRA adapters are not served here",
    "--speculative-config": "speculative decoding is not done here",
    "--enable-expert-parallel": "a mixture of experts shards every expert's width over --tensor-parallel-size instead",
    "--limit-mm-per-prompt": "text models only: leave it out",
    "--api-server-count": "the API server is one event loop beside the engine's thread: leave it out",
    "--backend": "`bench serve` and `bench sweep` shape their requests by --endpoint: leave it out",
    "--max-log-len": "--enable-log-requests logs a request's lengths and parameters, never its text: leave it out",
}


def vllm_flag_hint(rest: list[str]) -> str:
    """What to do about the vLLM flags among the unknown ones."""
    names = [a.split("=")[0] for a in rest if a.startswith("-")]
    hints = [f"{n}: {_VLLM_ONLY_FLAGS[n]}" for n in names if n in _VLLM_ONLY_FLAGS]
    hints += [f"{n}: {_VLLM_ONLY_FLAGS['--compilation-config']}" for n in names if n.startswith("-O")]
    return f" (vLLM's {'; '.join(hints)})" if hints else ""


def positive_int(value: str) -> int:
    """An argparse type for a count: a whole number of at least 1 (argparse names the flag when it is not), so a
    bad one stops the command before a model loads."""
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"{value!r}: must be a whole number of at least 1")
    return int(value)


def non_negative_int(value: str) -> int:
    """As ``positive_int``, for counts that may be 0."""
    if not value.isdigit():
        raise argparse.ArgumentTypeError(f"{value!r}: must be a whole number of at least 0")
    return int(value)


def _finite(value: str) -> float:
    try:
        return float(value)
    except ValueError:
        return math.nan


def positive_float(value: str) -> float:
    """As ``positive_int``, for a size such as GiB: a finite number above 0."""
    number = _finite(value)
    if not (math.isfinite(number) and number > 0):
        raise argparse.ArgumentTypeError(f"{value!r}: must be a number above 0")
    return number


def non_negative_float(value: str) -> float:
    """As ``positive_float``, for a setting where 0 means none (seconds to wait, a sampling temperature)."""
    number = _finite(value)
    if not (math.isfinite(number) and number >= 0):
        raise argparse.ArgumentTypeError(f"{value!r}: must be a number of at least 0")
    return number


def tcp_port(value: str) -> int:
    """A TCP port, 1 to 65535."""
    if not value.isdigit() or not 0 < int(value) < 65536:
        raise argparse.ArgumentTypeError(f"{value!r}: must be a TCP port, 1 to 65535")
    return int(value)


def fraction(value: str) -> float:
    """As ``positive_float``, for a share of a whole: a number in [0, 1)."""
    number = _finite(value)
    if not 0 <= number < 1:  # nan fails it too
        raise argparse.ArgumentTypeError(f"{value!r}: must be a number in [0, 1)")
    return number


def output_dir(path: str | Path, flag: str, given: str | None = None) -> Path:
    """A folder a command writes into when its work is done, created before the work starts: one that cannot
    be fails now, naming ``flag`` (and ``given``, what the user gave it), not after minutes of work."""
    folder, given = Path(path), given or str(path)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"{flag} {given}: the folder {folder} cannot be created ({e.strerror}).") from None
    try:  # a file made and removed: permission bits alone say nothing to root, or of /proc and read-only mounts
        tempfile.TemporaryFile(dir=folder).close()
    except OSError as e:
        raise ConfigError(f"{flag} {given}: the folder {folder} is not writable ({e.strerror}).") from None
    return folder


def output_path(path: str | None, flag: str) -> Path | None:
    """A file a command writes when its work is done, its folder made ready now (``output_dir``)."""
    if path is None:
        return None
    out = Path(path)
    if out.is_dir():
        raise ConfigError(f"{flag} {path} is a folder; give a file name.")
    output_dir(out.parent, flag, path)
    return out


def setup_logging(level: str = "INFO") -> None:
    logging.basicConfig(level=level.upper(), format="%(levelname)s %(asctime)s [%(name)s] %(message)s",
                        datefmt="%m-%d %H:%M:%S", stream=sys.stderr)
    for chatty in ("httpx", "matplotlib"):  # a line per HTTP call or font scan drowns our own output
        logging.getLogger(chatty).setLevel(logging.WARNING)


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
        self._given = list(sys.argv[1:] if args is None else args)
        ns, rest = super().parse_known_args(args, namespace)
        path = getattr(ns, "config", None)
        if path and any(a.dest == "config" for a in self._actions):
            try:
                self.set_defaults(**flags_from_file(path, self))
            except ConfigError as e:
                self.error(str(e))
            ns, rest = super().parse_known_args(args, namespace)
        return ns, rest

    def error(self, message: str):
        """argparse's message, and for a value that begins with - (taken for a flag) how to give it."""
        if message.endswith("expected one argument"):
            flag = message.split()[1].rstrip(":")
            given = getattr(self, "_given", [])
            after = [b for a, b in zip(given, given[1:]) if a == flag and b.startswith("-")]
            if after:
                message += f" (a value that begins with - goes after an =: {flag}={after[0]!r})"
        super().error(message)


def flags_from_file(path: str, parser: argparse.ArgumentParser) -> dict:
    """--config FILE: a YAML mapping of flag names (with - or _) to values, for ``parser``'s defaults."""
    import yaml

    try:
        data = yaml.safe_load(open(path))
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"--config {path}: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: expected a mapping of flag names to values.")
    actions = {a.dest: a for a in parser._actions}
    values = {str(k).lstrip("-").replace("-", "_"): v for k, v in data.items()}
    unknown = sorted(set(values) - set(actions) - {"config"})
    if unknown:
        raise ConfigError(f"--config {path}: unknown flag(s) {', '.join(unknown)} for `pagedserve "
                          f"{parser.prog.split()[-1]}`{vllm_flag_hint([option(u) for u in unknown])}.")
    return {dest: _typed(actions[dest], value, path) for dest, value in values.items()}


def _typed(action: argparse.Action, value, path: str):
    """A --config value held to its flag's type and choices, as on the command line (argparse applies neither to
    defaults that are not strings). A switch takes a YAML boolean only: "false" as a string would turn it on."""
    try:
        if action.nargs == 0:
            if not isinstance(value, bool):
                raise argparse.ArgumentTypeError("a switch: give true or false")
            return value
        if action.nargs in ("+", "*"):
            return [_one_value(action, item) for item in (value if isinstance(value, list) else [value])]
        return _one_value(action, value)
    except (TypeError, ValueError, argparse.ArgumentTypeError) as e:
        flag = action.option_strings[0] if action.option_strings else action.dest
        raise ConfigError(f"--config {path}: {flag}: {value!r} is not valid here ({e}).") from None


def _one_value(action: argparse.Action, value):
    """One value as the command line would give it: a list or mapping goes to the flag's type as JSON text (a
    JSON flag takes it; a number refuses it)."""
    text = action.type in (None, str)
    if isinstance(value, (list, dict)):
        if text and isinstance(value, dict):
            return value  # a mapping flag, such as --override-generation-config
        value = json.dumps(value)
    if isinstance(value, bool) and text:
        raise argparse.ArgumentTypeError("YAML read a boolean: quote it to mean the text")
    if isinstance(value, (str, int, float)):  # a bool for a number is refused by the number's type
        value = str(value) if text else action.type(str(value))
    if action.choices is not None and value not in action.choices:
        raise argparse.ArgumentTypeError(f"not one of {', '.join(map(str, action.choices))}")
    return value
