"""What a step costs on one GPU, from what the step holds: a model fitted to steps measured there.

    device seconds = e + b * max(T*, T) + c * K + d * Q + f * L + p * [K > 0 and Q > 0]
    step seconds   = device seconds for a CUDA-graph replay, max(H, device seconds) for an eager step,
                     max(M, device seconds) for an eager step that mixes decodes and prompt chunks,
                     S + c * K for one sequence's decode; and never less than the server's host work,
                     g + h * R, which overlaps the device's

T: tokens in the step (prompt and decode). The projections read every weight once whatever T is, and compute
2 x params FLOPs a token: below T* tokens reading the weights is the cost, above it computing is (a
roofline), hence b * max(T*, T). K: context tokens the decodes' attention reads (their K/V bytes). Q: for
prompt chunks, query tokens x positions attended (prefill attention grows with both). L: for prompt chunks,
the positions attended: a short chunk over a long context is a few programs each walking every key in turn,
so its time follows the context, not the work. p: a step that holds decodes and prompt chunks runs both
attention paths in every layer (one launch whose two kinds of programs share the SMs; two, each with its
own tail, for an fp8 cache's decodes that fill the GPU alone), which a step of one kind does not; a constant,
so a calibration prices a long chunk's overlap with its decodes at the grid's mean. e: what every step
pays (sampling, the copy of the tokens back). H: an eager step (a decode batch without a graph, or more
prompt tokens than the largest prompt graph) cannot end before the host has launched its kernels one by one;
M: the same for a mixed step, which launches both attention paths in every layer. S: one sequence decodes on
the one-row GEMV path, its own weights' read. R: requests in the step; g and h: the server's scheduling,
output processing and streaming, which run while the device computes and bound the step when they take
longer (small models). Apart from steps, a request reaches the engine a fixed time after it is sent (the
HTTP request, tokenizing, admission), and requests sent at once reach it one after another, a fixed spacing
apart: the client and the server's way in handle one request at a time. A token reaches the client a random
delay after its step ends (exponential, its mean growing with the requests in the step: the server writes
the streams one by one between other work), which spreads the inter-token latencies the client sees without
slowing the engine. H and M are the launches of such steps as timed (a device-bound step's time says nothing
of its floor); the rest is fitted by least squares on relative error over a scan of T* (the host's terms on their
own measurements); each coefficient keeps a physical meaning, so a calibration can be read and checked.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path

import numpy as np

from pagedserve.errors import ConfigError
from pagedserve.model.step import StepInputs

# a sample's "computed" is its tokens as the step computed them: a graph replay pads up to the graph's size
FEATURES = ("computed", "decode_context", "prefill_work", "prefill_keys")
# a step launched kernel by kernel that took no longer than this times its own launch waited on the host: its time
# says nothing of the device's
HOST_BOUND = 1.05
GRAPHED = ("single", "graph")  # step kinds replayed as CUDA graphs: the host prepares them ahead
# A graph step's launch hides behind the step before only where the host's work a step (the server's at one
# request, and the launch) is at most this share of one sequence's decode on the device. In a server the
# host's parts cost more together than timed apart (the engine's thread and the event loop take turns on
# the interpreter's lock), so a model whose steps are not several times the host's is host-bound, and
# its launch runs in series with the step. (Measured on an H200 and an H100: 0.06-0.13 for Qwen3-8B, and
# 0.26-0.58 for Qwen3-0.6B, whose ladders a hidden launch prices fast.)
LAUNCH_HIDES = 1 / 5


def step_features(inp: StepInputs) -> tuple[int, int, int, int]:
    """(T, K, Q, L) of one step."""
    q, s = inp.query_lens, inp.seq_lens
    decode = q == 1
    return int(q.sum()), int(s[decode].sum()), int((q[~decode] * s[~decode]).sum()), int(s[~decode].sum())


def computed_tokens(tokens: int, kind: str, decode_only: bool, sizes: tuple[list[int], list[int]]) -> int:
    """The tokens a step computes: a graph replay's are its graph's size (``sizes`` as ``model.runner.graph_sizes``)."""
    if kind not in GRAPHED:
        return tokens
    graphs = sizes[0] if decode_only else sizes[1]
    i = bisect.bisect_left(graphs, tokens)
    return graphs[i] if i < len(graphs) else tokens


def step_kind(inp: StepInputs, sizes: tuple[list[int], list[int]]) -> str:
    """"single" (one sequence's decode graph), "graph" (a larger decode graph, or a step with prompt
    tokens replayed as one), "mixed" (decodes and prompt chunks, launched kernel by kernel) or "eager"
    (launched kernel by kernel); ``sizes`` as ``model.runner.graph_sizes``."""
    decode, prompt = sizes
    if inp.decode_only and decode and len(inp.query_lens) <= decode[-1]:
        return "single" if len(inp.query_lens) == 1 else "graph"
    if not inp.decode_only and prompt and len(inp.ids) <= prompt[-1]:
        return "graph"
    decode = inp.query_lens == 1
    return "mixed" if decode.any() and not decode.all() else "eager"


def priced_step(inp: StepInputs, sizes: tuple[list[int], list[int]]) -> tuple[str, tuple[int, int, int, int]]:
    """A step's kind and its (T, K, Q, L) as the cost model takes them, T as the step computes it (``sizes`` as
    ``model.runner.graph_sizes``): what the simulator prices and the calibration times alike."""
    tokens, *rest = step_features(inp)
    kind = step_kind(inp, sizes)
    return kind, (computed_tokens(tokens, kind, inp.decode_only, sizes), *rest)


@dataclass
class CostModel:
    breakpoint: float        # T*: tokens below which a step's projections cost the weights' read
    per_token: float         # b: seconds a token of projections above T* (and T* x b below it)
    per_context: float       # c: seconds a context token a decode reads
    per_prefill_work: float  # d: seconds a (prompt token x position) of prefill attention
    fixed: float             # e: seconds every step's device work pays
    eager_floor: float       # H: seconds an eager step takes at least (the host launching its kernels)
    mixed_floor: float       # M: the same for a step that mixes decodes and prompt chunks
    single: float            # S: seconds of one sequence's decode step before its context
    per_prefill_key: float = 0.0  # f: seconds a position a prompt chunk attends (its keys' serial walk)
    both_paths: float = 0.0       # p: seconds a step with decodes and prompt chunks pays for both attention paths
    host_fixed: float = 0.0       # the server's own work a step (scheduling, inputs, outputs, streaming) ...
    host_per_seq: float = 0.0     # ... and a request in the step: a step takes at least this host time
    request_latency: float = 0.0  # from a client sending a request to the engine taking it in (HTTP, tokenizing)
    ingress_spacing: float = 0.0  # between two requests sent at once reaching the engine
    delivery_jitter: float = 0.0          # mean delay from a step's end to its token at the client ...
    delivery_jitter_per_seq: float = 0.0  # ... and its growth a request in the step
    # the host's part of a graph step (its inputs, the launch), done while the step before runs: the
    # device's terms above are then what remains of the step
    launch_fixed: float = 0.0
    launch_per_seq: float = 0.0
    launch_prompt: float = 0.0  # more for a step with prompt tokens (its attention tiles, tables, fills)
    launch_hidden: bool = True  # False: the launch runs in series with the step (a host-bound model)
    # S_B: seconds of the decode graph of B > 1 sequences before its context, for each size timed. The kernels
    # change with the rows (a GEMV for two, the tensor cores up to 16, cuBLAS above), which a line through the
    # token counts misprices; sizes between two timed ones are interpolated, others take the terms above.
    decode_graphs: dict[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.decode_graphs = {int(b): float(t) for b, t in sorted(self.decode_graphs.items(), key=lambda i: int(i[0]))}
        self._graph_sizes = np.array(list(self.decode_graphs), dtype=float)
        self._graph_times = np.array(list(self.decode_graphs.values()))

    def on_faster_gpu(self, compute: float, bandwidth: float) -> "CostModel":
        """This model on a GPU ``compute`` times as fast at 16-bit tensor math and ``bandwidth`` times as
        fast at reading memory (ratios below 1: slower). What computes (tokens above T*, prefill
        attention) scales with the compute; the rest of the device's work with the bandwidth: the weights'
        read below T*, the decodes' context, a prompt chunk's walk over its keys, one sequence's decode,
        the fixed part and the second attention path's (small kernels, whose time is memory traffic; the
        fit also puts part of the weights' read there). The launch floors and the server's terms belong to
        the host and are kept. First order: the fractions of the peaks that kernels reach differ between
        GPUs."""
        return dataclasses.replace(
            self, breakpoint=self.breakpoint * compute / bandwidth, per_token=self.per_token / compute,
            per_context=self.per_context / bandwidth, per_prefill_work=self.per_prefill_work / compute,
            per_prefill_key=self.per_prefill_key / bandwidth, single=self.single / bandwidth,
            fixed=self.fixed / bandwidth, both_paths=self.both_paths / bandwidth,
            decode_graphs={b: t / bandwidth for b, t in self.decode_graphs.items()})

    def host_seconds(self, seqs: int) -> float:
        return self.host_fixed + self.host_per_seq * seqs

    def step_seconds(self, features: tuple[int, int, int, int], kind: str, seqs: int) -> tuple[float, float]:
        """(the device's part, the host's) of a step: the engine's one step in flight overlaps them, so the
        longer of the two is what the step takes. The launch is the host's where it hides behind the step
        before, else it is in series with the device's part."""
        prompt = features[2] > 0  # the step has prefill work: prompt tokens
        device, launch = self.seconds(*features, kind), self.launch_seconds(kind, seqs, prompt)
        if self.launch_hidden:
            return device, self.host_seconds(seqs) + launch
        return device + launch, self.host_seconds(seqs)

    def launch_seconds(self, kind: str, seqs: int, prompt: bool) -> float:
        """The host's part of a graph step (``prompt``: it carries prompt tokens); a step launched kernel by
        kernel is held up by its launch alone, which its floor prices."""
        if kind not in GRAPHED:
            return 0.0
        return self.launch_fixed + self.launch_per_seq * seqs + (self.launch_prompt if prompt else 0.0)

    def device_seconds(self, tokens: int, decode_context: int, prefill_work: int, prefill_keys: int) -> float:
        return (self.fixed + self.per_token * max(self.breakpoint, tokens) + self.per_context * decode_context
                + self.per_prefill_work * prefill_work + self.per_prefill_key * prefill_keys
                + (self.both_paths if decode_context and prefill_work else 0.0))

    def seconds(self, tokens: int, decode_context: int, prefill_work: int, prefill_keys: int, kind: str) -> float:
        if kind == "single":
            return self.single + self.per_context * decode_context
        if kind == "graph" and not prefill_work and len(self._graph_sizes) and \
                self._graph_sizes[0] <= tokens <= self._graph_sizes[-1]:
            return float(np.interp(tokens, self._graph_sizes, self._graph_times)) + self.per_context * decode_context
        device = self.device_seconds(tokens, decode_context, prefill_work, prefill_keys)
        return device if kind == "graph" else max(self.mixed_floor if kind == "mixed" else self.eager_floor, device)

    @classmethod
    def fit_steps(cls, samples: list[dict], host_samples: list[dict]) -> tuple["CostModel", float]:
        """The device's terms fitted to the timed steps (less a graph step's launch, timed apart) and the
        host's to the server runs, with the launch hidden behind the step before where the host's work
        allows it (``LAUNCH_HIDES``), else in series with the step; and the fit's mean absolute percentage
        error."""
        cost, err = cls.fit(samples)
        cost = cost.with_launch(samples).with_host(host_samples)
        if cost.host_seconds(1) + cost.launch_seconds("single", 1, False) > LAUNCH_HIDES * cost.single:
            cost = dataclasses.replace(cost, launch_hidden=False)
        return cost, err

    @classmethod
    def fit(cls, samples: list[dict]) -> tuple["CostModel", float]:
        """Least squares on relative error over a scan of the breakpoint (and of the floors where their
        launches were not timed); returns the model and its mean absolute percentage error on ``samples``
        ({"computed", "decode_context", "prefill_work", "prefill_keys", "kind", "seconds", and optionally
        "launch": the host's part before the launch returns, which for a graph step is not the device's). For
        each pair of floors, the device terms are fitted to the
        steps they do not hold up (graph replays, and eager steps measured above their floor); S is then the
        median of the single decodes' time less their context's, and S_B the same for each decode graph size."""
        if len(samples) < 5:
            raise ConfigError("A cost model needs at least five measured steps.")
        x = np.array([[s[f] for f in FEATURES] for s in samples], dtype=float)
        y = np.array([_device_part(s) for s in samples])
        kind = np.array([s["kind"] for s in samples])
        eager, mixed, single = kind == "eager", kind == "mixed", kind == "single"
        decode_graph = (kind == "graph") & (x[:, 2] == 0)
        graph_rows = {int(b): decode_graph & (x[:, 0] == b) for b in np.unique(x[decode_graph, 0])}

        launched = np.array([s.get("launch", 0.0) for s in samples])

        def candidates(mask: np.ndarray) -> np.ndarray:
            """The kind's floor: its launches as timed on a GPU (their median); where none were (a CPU, whose
            launch computes the step), 0 or a time measured in the lower half of the kind."""
            if (timed := mask & (launched > 0)).any():
                return np.array([np.median(launched[timed])])
            return np.concatenate([[0.0], np.unique(y[mask & (y <= np.median(y[mask]))])]) if mask.any() else np.zeros(1)

        bps = np.unique(np.concatenate([[1.0], np.geomspace(1, max(2.0, x[:, 0].max()), 64)]))
        both = ((x[:, 1] > 0) & (x[:, 2] > 0)).astype(float)
        a_all = [np.column_stack([np.maximum(bp, x[:, 0]), x[:, 1], x[:, 2], x[:, 3], both, np.ones(len(y))])
                 for bp in bps]
        best = None
        for h in candidates(eager):
            for m in candidates(mixed):
                floor = np.where(eager, h, np.where(mixed, m, 0.0))
                held = np.where(eager | mixed, np.where(launched > 0, HOST_BOUND * launched, floor), 0.0)
                free = (y > held) & ~single
                for bp, a in zip(bps, a_all):
                    coef = _nonnegative_lstsq(a[free] / y[free, None], np.ones(int(free.sum())))
                    pred = np.maximum(floor, a @ coef)
                    one = float(np.median(y[single] - coef[1] * x[single, 1])) if single.any() else 0.0
                    pred[single] = one + coef[1] * x[single, 1]
                    err = float(np.mean(np.abs(pred - y) / y))
                    if best is None or err < best[0]:
                        best = (err, h, m, one, bp, coef, pred)
        _, h, m, one, bp, (b, c, d, f, p, e), pred = best
        # the line's terms chosen as if decode graphs were on it; each timed size then gets its own S_B
        graphs = {}
        for size, rows in graph_rows.items():
            graphs[size] = float(np.median(y[rows] - c * x[rows, 1]))
            pred[rows] = graphs[size] + c * x[rows, 1]
        return cls(float(bp), float(b), float(c), float(d), float(e), float(h), float(m), one, float(f),
                   float(p), decode_graphs=graphs), float(np.mean(np.abs(pred - y) / y))

    def with_launch(self, samples: list[dict]) -> "CostModel":
        """This model with the launch terms fitted (least squares on relative error, non-negative, as the
        device's: the many short launches count as much as the few long ones) to the graph steps of
        ``samples`` that carry their host part ({"seqs", "prefill_work", "launch"}). A prompt step's inputs
        cost the host a step's worth more whatever its tokens (a line through the tokens, fitted on small
        steps, overprices a large graph step several times)."""
        timed = [s for s in samples if s["kind"] in GRAPHED and s.get("launch")]
        if not timed:
            return self
        y = np.array([s["launch"] for s in timed])
        a = np.array([[1.0, s["seqs"], float(s["prefill_work"] > 0)] for s in timed]) / y[:, None]
        fixed, per_seq, prompt = _nonnegative_lstsq(a, np.ones(len(timed)))
        return dataclasses.replace(self, launch_fixed=float(fixed), launch_per_seq=float(per_seq),
                                   launch_prompt=float(prompt))

    def with_host(self, samples: list[dict]) -> "CostModel":
        """This model with the host terms fitted (least squares, non-negative) to ``samples`` ({"seqs",
        "seconds"}: the mean host time a step at that many requests a step)."""
        a = np.array([[1.0, s["seqs"]] for s in samples])
        fixed, per_seq = _nonnegative_lstsq(a, np.array([s["seconds"] for s in samples]))
        return dataclasses.replace(self, host_fixed=float(fixed), host_per_seq=float(per_seq))

    def with_request_latency(self, seconds: float) -> "CostModel":
        return dataclasses.replace(self, request_latency=max(0.0, float(seconds)))

    def with_ingress_spacing(self, seconds: float) -> "CostModel":
        return dataclasses.replace(self, ingress_spacing=max(0.0, float(seconds)))

    def delivery_seconds(self, seqs: int) -> float:
        """The mean delay of a step's tokens on their way to the client."""
        return self.delivery_jitter + self.delivery_jitter_per_seq * seqs

    def with_delivery(self, runs: list[dict]) -> "CostModel":
        """This model with the delivery terms fitted (least squares, non-negative) to runs over equal steps
        ({"seqs", "itl_spread"}: requests a step, and the p95 less the p5 of the client's inter-token
        latencies). With exponential delays of mean m the latencies are the step plus the difference of two
        delays, whose p95 less p5 is 2 ln(10) m."""
        a = np.array([[1.0, r["seqs"]] for r in runs])
        mean = np.array([r["itl_spread"] for r in runs]) / (2 * np.log(10))
        fixed, per_seq = _nonnegative_lstsq(a, mean)
        return dataclasses.replace(self, delivery_jitter=float(fixed), delivery_jitter_per_seq=float(per_seq))


def _device_part(sample: dict) -> float:
    """What a measured step holds the device for: its time to its tokens, less the host's part before the
    launch returns for a graph step (a step launched kernel by kernel is held up by its launch, which the
    floors price)."""
    if sample["kind"] not in GRAPHED:
        return sample["seconds"]
    return sample["seconds"] - sample.get("launch", 0.0)


def _nonnegative_lstsq(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0: a coefficient the fit wants negative is dropped and the
    rest refitted (a cost cannot make a step faster)."""
    keep = list(range(a.shape[1]))
    while True:
        coef = np.zeros(a.shape[1])
        coef[keep] = np.linalg.lstsq(a[:, keep], y, rcond=None)[0]
        negative = [i for i in keep if coef[i] < 0]
        if not negative:
            return coef
        keep.remove(min(negative, key=lambda i: coef[i]))


@dataclass
class Calibration:
    """A cost model and what it was measured on (the file ``pagedserve calibrate`` writes)."""

    model: str
    dtype: str
    kv_cache_dtype: str
    gpu: str
    gpu_memory_bytes: int
    engine_args: dict
    cost: CostModel
    mape: float                   # the fit's mean absolute percentage error on its own samples
    samples: list[dict] = field(default_factory=list)
    host_samples: list[dict] = field(default_factory=list)  # the server's host time a step, by requests
    way_in_samples: list[dict] = field(default_factory=list)  # one request at a time, then a burst at once
    date: str = ""
    commit: str | None = None
    pagedserve_version: str = ""
    notes: list[str] = field(default_factory=list)  # what was added after the GPU's run, and where it was timed

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "Calibration":
        return cls(**{**data, "cost": CostModel(**data["cost"])})

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2))

    def first_launched_prompt_step(self) -> int | None:
        """The fewest tokens of a prompt-carrying step this calibration timed launched kernel by kernel, where
        it timed smaller ones as graph replays (its engine's capture size lies between); None without both."""
        graphs = any(s["kind"] in GRAPHED and s["prefill_work"] for s in self.samples)
        launched = [s["tokens"] for s in self.samples if s["kind"] not in GRAPHED and s["prefill_work"]]
        return min(launched) if graphs and launched else None

    def describe(self) -> str:
        c = self.cost
        return (f"{self.model} ({self.dtype}, KV {self.kv_cache_dtype}) on {self.gpu}, measured {self.date}"
                f"{f' at {self.commit}' if self.commit else ''}: a step's device time is {1e3 * c.fixed:.3f} ms + "
                f"{1e6 * c.per_token:.2f} us x max({c.breakpoint:.0f}, tokens) + {1e9 * c.per_context:.2f} ns a "
                f"context token decoded + {1e12 * c.per_prefill_work:.3f} ps a prompt token x position + "
                f"{1e9 * c.per_prefill_key:.1f} ns a position a prompt chunk attends + {1e3 * c.both_paths:.3f} ms "
                f"a step with decodes and prompt chunks (both attention paths); an eager "
                f"step takes at least {1e3 * c.eager_floor:.2f} ms, a mixed one {1e3 * c.mixed_floor:.2f} ms; one "
                f"sequence's decode {1e3 * c.single:.3f} ms + its context"
                + (f", of {', '.join(map(str, c.decode_graphs))} sequences "
                   f"{', '.join(f'{1e3 * t:.3f}' for t in c.decode_graphs.values())} ms + theirs"
                   if c.decode_graphs else "")
                + f" (fit error {100 * self.mape:.1f} %)"
                + (f"; the server's host work a step {1e3 * c.host_fixed:.3f} ms + {1e3 * c.host_per_seq:.4f} ms a "
                   f"request in it, a request's way in {1e3 * c.request_latency:.2f} ms"
                   + (f", requests sent at once {1e3 * c.ingress_spacing:.2f} ms apart" if c.ingress_spacing else "")
                   + (f", a token reaches the client {1e3 * c.delivery_jitter:.3f} ms + "
                      f"{1e6 * c.delivery_jitter_per_seq:.2f} us a request in its step after the step ends (mean)"
                      if c.delivery_jitter or c.delivery_jitter_per_seq else "")
                   if self.host_samples
                   else "; the server's host work not measured")
                + (f"; a graph step's inputs and launch {1e3 * c.launch_fixed:.3f} ms + "
                   f"{1e3 * c.launch_per_seq:.4f} ms a request, {1e3 * c.launch_prompt:.3f} ms more with prompt "
                   f"tokens, "
                   + ("hidden behind the step before" if c.launch_hidden
                      else "in series with the step (the host bounds this model's steps)")
                   if c.launch_fixed or c.launch_per_seq or c.launch_prompt else "")
                + "".join(f" ({note})" for note in self.notes))


def shipped() -> dict[str, Path]:
    """The calibrations that come with the package, by short name (e.g. h200-qwen3-8b-bf16)."""
    folder = resources.files("pagedserve.sim") / "calibrations"
    return {p.name.removesuffix(".json"): Path(str(p)) for p in folder.iterdir() if p.name.endswith(".json")}


def load_calibration(name_or_path: str) -> Calibration:
    """A calibration file, or one the package ships by its short name."""
    known = shipped()
    path = known.get(name_or_path) or Path(name_or_path)
    if not path.is_file():
        raise ConfigError(f"--simulate {name_or_path!r}: neither a calibration file nor one of the shipped ones "
                          f"({', '.join(sorted(known)) or 'none'}); `pagedserve calibrate` makes one on a GPU.")
    try:
        return Calibration.from_json(json.loads(path.read_text()))
    except (json.JSONDecodeError, TypeError, KeyError, ValueError) as e:
        raise ConfigError(f"--simulate {path}: not a calibration file ({e}).") from e
