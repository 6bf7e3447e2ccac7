"""Benchmark workloads: random, ShareGPT-format JSON, and custom JSONL (vLLM bench's datasets), and the
lengths a server recorded (``serve --record-lengths``): production's shape of traffic, without its text."""

from __future__ import annotations

import functools
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pagedserve.errors import ConfigError

# Without a tokenizer the client cannot know the vocabulary: ids below this bound exist in every model
# (byte-level vocabularies start with the 256 bytes).
NO_TOKENIZER_VOCAB = 256
# datasets whose outputs are lengths to reproduce, not answers: their requests run with ignore_eos
LENGTH_DATASETS = ("random", "lengths")


@dataclass
class SampleRequest:
    prompt: str | list[int]
    prompt_len: int
    expected_output_len: int


def client_tokenizer(tokenizer: str | None, model: str | None):
    """The tokenizer a benchmark client counts and makes text prompts with: ``tokenizer``, else the model
    if it is a local folder (or the built-in tiny model); None when there is none (token-id prompts)."""
    from pagedserve.builtin.tiny import TINY_MODEL_NAMES, ensure_tiny_model

    path = tokenizer or model
    if path in TINY_MODEL_NAMES:
        path = str(ensure_tiny_model())
    if path and (Path(path) / "tokenizer_config.json").is_file():
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path)
    if tokenizer:
        raise ConfigError(f"--tokenizer {tokenizer!r} is not a tokenizer folder.")
    return None


def _lengths(rng: np.random.Generator, mean: int, ratio: float, n: int, minimum: int) -> np.ndarray:
    """Integers uniform in [floor(mean(1-r)), ceil(mean(1+r))], at least ``minimum``."""
    low, high = math.floor(mean * (1 - ratio)), math.ceil(mean * (1 + ratio))
    return np.maximum(rng.integers(low, high + 1, size=n), minimum)


def random_dataset(num_prompts: int, input_len: int, output_len: int, range_ratio: float = 0.0,
                   prefix_len: int = 0, seed: int = 0, tokenizer=None) -> list[SampleRequest]:
    """Prompts of random tokens. With a tokenizer they are decoded to text (and re-encoded to keep the
    length exact where the tokenizer allows); without one they are sent as token ids."""
    if not 0.0 <= range_ratio < 1.0:
        raise ConfigError(f"--random-range-ratio must be in [0, 1), got {range_ratio}.")
    if input_len < 1 or output_len < 1 or prefix_len < 0:
        raise ConfigError("--random-input-len and --random-output-len must be >= 1, --random-prefix-len >= 0.")
    rng = np.random.default_rng(seed)
    allowed = _allowed_ids(tokenizer)
    prefix = allowed[rng.integers(0, len(allowed), size=prefix_len)].tolist()
    in_lens = _lengths(rng, input_len, range_ratio, num_prompts, 1)
    out_lens = _lengths(rng, output_len, range_ratio, num_prompts, 1)
    return _random_prompts(rng, allowed, [prefix] * num_prompts, in_lens, out_lens, tokenizer)


@functools.lru_cache(maxsize=4)
def _allowed_ids(tokenizer) -> np.ndarray:
    """The token ids random prompts are made of: the first 256 without a tokenizer; with one, every id that is
    not special and decodes to text of its own. A lone byte of a multi-byte character decodes to U+FFFD:
    runs of those re-encode to the same text, and prompts made of them would share their prefix blocks.
    Once a tokenizer (decoding a whole vocabulary is not free, and a ladder draws prompts every rung)."""
    if tokenizer is None:
        ids = np.arange(NO_TOKENIZER_VOCAB)
    else:
        special = set(tokenizer.all_special_ids)
        candidates = [i for i in range(len(tokenizer)) if i not in special]
        texts = tokenizer.batch_decode([[i] for i in candidates])
        ids = np.array([i for i, text in zip(candidates, texts) if "\ufffd" not in text])
    ids.flags.writeable = False  # shared by every caller
    return ids


def _random_prompts(rng: np.random.Generator, allowed: np.ndarray, prefixes: list[list[int]], in_lens, out_lens,
                    tokenizer) -> list[SampleRequest]:
    """Prompts of each one's prefix and then random tokens of the given lengths, each drawn on its own (runs
    of consecutive ids from a random start would repeat whole prompts once prompts outnumber the ids, and a
    repeated prompt is served from the prefix cache). With a tokenizer they are decoded to text (and
    re-encoded to keep the length exact where the tokenizer allows); without one they are token ids."""
    samples = []
    for prefix, n, out in zip(prefixes, in_lens, out_lens):
        ids = prefix + allowed[rng.integers(0, len(allowed), size=n)].tolist()
        if tokenizer is None:
            samples.append(SampleRequest(ids, len(ids), int(out)))
            continue
        text = tokenizer.decode(ids)
        re_ids = tokenizer.encode(text, add_special_tokens=False)[: len(ids)]
        text = tokenizer.decode(re_ids)
        samples.append(SampleRequest(text, len(re_ids), int(out)))
    return samples


def lengths_dataset(path: str, num_prompts: int, seed: int = 0, tokenizer=None) -> list[SampleRequest]:
    """Prompts of random tokens with the lengths of requests a server recorded (``--record-lengths``),
    drawn at random from them (with repeats when asked for more than were recorded)."""
    rows = read_recorded_lengths(path)
    rng = np.random.default_rng(seed)
    picked = rng.choice(len(rows), size=num_prompts, replace=num_prompts > len(rows))
    return _recorded_prompts(rng, [rows[i] for i in picked], tokenizer)


def _recorded_prompts(rng: np.random.Generator, rows: list[dict], tokenizer) -> list[SampleRequest]:
    """Each recorded request as a prompt of its length that runs to its output length. Requests recorded
    with the same number of prompt tokens from the prefix cache share a random prefix of that length (most
    likely they shared a system prompt), so a replay hits the cache about as the traffic did."""
    allowed = _allowed_ids(tokenizer)
    shared: dict[int, list[int]] = {}
    prefixes, in_lens = [], []
    for r in rows:
        cached = min(r.get("cached_tokens") or 0, r["prompt_tokens"] - 1)
        if cached > 0 and cached not in shared:
            shared[cached] = allowed[rng.integers(0, len(allowed), size=cached)].tolist()
        prefixes.append(shared.get(cached, []))
        in_lens.append(r["prompt_tokens"] - len(prefixes[-1]))
    return _random_prompts(rng, allowed, prefixes, in_lens, [r["output_tokens"] for r in rows], tokenizer)


def replayed_lengths(path: str, num_prompts: int | None, speed: float = 1.0,
                     tokenizer=None) -> tuple[list[SampleRequest], list[float]]:
    """The first ``num_prompts`` recorded requests (None: all) in arrival order, as prompts of their
    lengths, and when each is sent: its recorded offset from the first, divided by ``speed`` (2: twice as
    fast)."""
    if speed <= 0:
        raise ConfigError(f"--replay-speed must be positive, got {speed}.")
    rows = read_recorded_lengths(path)
    if any(not isinstance(r.get("arrival"), (int, float)) for r in rows):
        raise ConfigError(f"--dataset-path {path}: some lines have no arrival time to replay (write it with "
                          f"`serve --record-lengths`), or leave out --replay-arrivals.")
    if num_prompts is not None and num_prompts > len(rows):
        raise ConfigError(f"--num-prompts {num_prompts}: {path} holds {len(rows)} requests to replay; ask for "
                          f"at most that many.")
    rows = sorted(rows, key=lambda r: r["arrival"])[:num_prompts]
    samples = _recorded_prompts(np.random.default_rng(0), rows, tokenizer)
    return samples, [(r["arrival"] - rows[0]["arrival"]) / speed for r in rows]


def read_recorded_lengths(path: str, flag: str = "--dataset-path") -> tuple[dict, ...]:
    """The requests of a ``--record-lengths`` file that produced output: {"arrival", "prompt_tokens",
    "output_tokens", ...} each. Aborted ones are left out: their length is where they were stopped.
    ``flag``: the option that named the file, for the errors. A file is parsed once while it is unchanged
    (a sweep draws from it at every rung)."""
    try:
        stat = os.stat(path)
        stamp = (stat.st_mtime_ns, stat.st_size)
    except OSError:
        stamp = None  # _lines names the missing file
    return _parse_recorded_lengths(path, flag, stamp)


@functools.lru_cache(maxsize=8)
def _parse_recorded_lengths(path: str, flag: str, stamp: tuple | None) -> tuple[dict, ...]:
    rows = []
    for lineno, line in _lines(path, flag):
        try:
            row = json.loads(line)
            ok = all(isinstance(row[k], int) and row[k] >= 0 for k in ("prompt_tokens", "output_tokens"))
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            ok, row = False, str(e)
        if not ok:
            raise ConfigError(f"{flag} {path}:{lineno}: expected a line of `serve --record-lengths` "
                              f"({{\"prompt_tokens\": N, \"output_tokens\": M, ...}}), got {line[:120]!r}.")
        if row["prompt_tokens"] >= 1 and row["output_tokens"] >= 1 and row.get("finish_reason") != "abort":
            rows.append(row)
    if not rows:
        raise ConfigError(f"{flag} {path}: no recorded request with a prompt and an output.")
    return tuple(rows)


def describe_recorded_lengths(rows: list[dict]) -> str:
    """What a recording says about the traffic: its rate and burstiness (the gamma shape of the gaps
    between arrivals, as --burstiness takes it: 1 / their squared coefficient of variation) and its
    length percentiles."""
    prompt = np.array([r["prompt_tokens"] for r in rows])
    output = np.array([r["output_tokens"] for r in rows])
    arrivals = np.sort([r["arrival"] for r in rows if isinstance(r.get("arrival"), (int, float))])
    lengths = (f"prompt tokens p50 {np.percentile(prompt, 50):,.0f} / p95 {np.percentile(prompt, 95):,.0f}, "
               f"output tokens p50 {np.percentile(output, 50):,.0f} / p95 {np.percentile(output, 95):,.0f}")
    gaps = np.diff(arrivals)
    if len(gaps) < 2 or gaps.sum() <= 0 or gaps.mean() <= 0:
        return f"{len(rows):,} recorded requests: {lengths}"
    rate, cv = len(gaps) / gaps.sum(), gaps.std() / gaps.mean()
    burst = f", burstiness {1 / cv**2:.2f}" if cv > 0 else ""
    return (f"{len(rows):,} recorded requests over {gaps.sum():,.0f} s: {rate:.2f} req/s{burst} "
            f"(--request-rate and --burstiness replay that arrival process); {lengths}")


def sharegpt_dataset(path: str, num_prompts: int, tokenizer=None, output_len: int | None = None,
                     seed: int = 0) -> list[SampleRequest]:
    """First human turn as the prompt, the reply's length as the output length (ShareGPT JSON)."""
    data = _read_json(path)
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(data))
    samples = []
    for i in order:
        conv = data[i].get("conversations") or data[i].get("conversation") or []
        if len(conv) < 2:
            continue
        prompt, reply = conv[0].get("value", ""), conv[1].get("value", "")
        p_len = _count_tokens(prompt, tokenizer)
        o_len = output_len or _count_tokens(reply, tokenizer)
        if p_len < 4 or o_len < 4:  # vLLM drops very short pairs too
            continue
        samples.append(SampleRequest(prompt, p_len, o_len))
        if len(samples) == num_prompts:
            break
    if len(samples) < num_prompts:
        raise ConfigError(f"--dataset-path {path}: only {len(samples)} usable conversations for "
                          f"--num-prompts {num_prompts}.")
    return samples


def custom_dataset(path: str, num_prompts: int, tokenizer=None, output_len: int = 256) -> list[SampleRequest]:
    """JSONL: one {"prompt": ..., "output_len": N} per line (output_len optional)."""
    samples = []
    for lineno, line in _lines(path):
        try:
            row = json.loads(line)
            prompt = row["prompt"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ConfigError(f"--dataset-path {path}:{lineno}: expected a JSON object with a 'prompt' ({e}).") from e
        p_len = len(prompt) if isinstance(prompt, list) else _count_tokens(prompt, tokenizer)
        samples.append(SampleRequest(prompt, p_len, int(row.get("output_len", output_len))))
        if len(samples) == num_prompts:
            break
    if len(samples) < num_prompts:
        raise ConfigError(f"--dataset-path {path}: {len(samples)} prompts for --num-prompts {num_prompts}.")
    return samples


def _count_tokens(text: str, tokenizer) -> int:
    """Exact with a tokenizer; without one, ~4 characters a token (lengths only steer output sizes)."""
    return len(tokenizer.encode(text)) if tokenizer else max(1, len(text) // 4)


def _read_text(path: str, flag: str = "--dataset-path") -> str:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{flag} {path!r} is not a file.")
    return p.read_text()


def _lines(path: str, flag: str = "--dataset-path"):
    """(line number, line) of a JSONL file's non-blank lines."""
    return ((n, line) for n, line in enumerate(_read_text(path, flag).splitlines(), 1) if line.strip())


def _read_json(path: str):
    text = _read_text(path)
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"--dataset-path {path}: not valid JSON ({e}).") from e


def require_recording(ns, flag: str) -> None:
    """``flag`` replays a ``--record-lengths`` recording: the dataset flags must name one."""
    if ns.dataset_name != "lengths" or ns.dataset_path is None:
        raise ConfigError(f"{flag} replays a recording: give --dataset-name lengths --dataset-path FILE (a `serve "
                          f"--record-lengths` file).")


def _dataset_path(ns) -> str:
    if ns.dataset_path is None:
        raise ConfigError(f"--dataset-name {ns.dataset_name} needs --dataset-path.")
    return ns.dataset_path


def announce_dataset(ns) -> None:
    """Check the dataset flags up front, so that a missing file fails before any server starts or model loads;
    a recording is read whole, and the traffic it holds described."""
    if ns.dataset_name == "random":
        return
    path = _dataset_path(ns)
    if ns.dataset_name == "lengths":
        print(f"Dataset: {describe_recorded_lengths(read_recorded_lengths(path))}")
    elif not Path(path).is_file():
        raise ConfigError(f"--dataset-path {path!r} is not a file.")


def load_dataset(ns, tokenizer) -> list[SampleRequest]:
    """The dataset the flags ask for (shared by bench serve and bench throughput)."""
    name = ns.dataset_name
    if name == "random":
        return random_dataset(ns.num_prompts, ns.random_input_len, ns.random_output_len, ns.random_range_ratio,
                              ns.random_prefix_len, ns.seed, tokenizer)
    path = _dataset_path(ns)
    if name == "sharegpt":
        return sharegpt_dataset(path, ns.num_prompts, tokenizer, ns.sharegpt_output_len, ns.seed)
    if name == "lengths":
        return lengths_dataset(path, ns.num_prompts, ns.seed, tokenizer)
    return custom_dataset(path, ns.num_prompts, tokenizer, ns.custom_output_len)
