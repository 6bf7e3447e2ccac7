"""What a step costs on one GPU, from what the step holds: a model fitted to steps measured there.

    step seconds = e + b * max(T*, T) + c * K + d * Q

T: tokens in the step (prompt and decode). The projections read every weight once whatever T is, and
compute 2 x params FLOPs a token: below T* tokens reading the weights is the cost, above it computing is
(a roofline), hence b * max(T*, T). K: context tokens the decodes' attention reads (their K/V bytes).
Q: for prompt chunks, query tokens x positions attended (prefill attention grows with both). e: what
every step pays (launches, sampling, the host's share). Fitted by least squares on relative error over
a scan of T*; each coefficient keeps a physical meaning, so a calibration can be read and checked.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path

import numpy as np

from pagedserve.errors import ConfigError
from pagedserve.model.step import StepInputs

FEATURES = ("tokens", "decode_context", "prefill_work")


def step_features(inp: StepInputs) -> tuple[int, int, int]:
    """(T, K, Q) of one step."""
    q, s = inp.query_lens, inp.seq_lens
    decode = q == 1
    return int(q.sum()), int(s[decode].sum()), int((q[~decode] * s[~decode]).sum())


@dataclass
class CostModel:
    breakpoint: float        # T*: tokens below which a step's projections cost the weights' read
    per_token: float         # b: seconds a token of projections above T* (and T* x b below it)
    per_context: float       # c: seconds a context token a decode reads
    per_prefill_work: float  # d: seconds a (prompt token x position) of prefill attention
    fixed: float             # e: seconds every step pays

    def seconds(self, tokens: int, decode_context: int, prefill_work: int) -> float:
        return (self.fixed + self.per_token * max(self.breakpoint, tokens) + self.per_context * decode_context
                + self.per_prefill_work * prefill_work)

    def step_seconds(self, inp: StepInputs) -> float:
        return self.seconds(*step_features(inp))

    @classmethod
    def fit(cls, samples: list[dict]) -> tuple["CostModel", float]:
        """Least squares on relative error over a scan of the breakpoint; returns the model and its mean
        absolute percentage error on ``samples`` ({"tokens", "decode_context", "prefill_work", "seconds"})."""
        if len(samples) < 5:
            raise ConfigError("A cost model needs at least five measured steps.")
        x = np.array([[s[f] for f in FEATURES] for s in samples], dtype=float)
        y = np.array([s["seconds"] for s in samples], dtype=float)
        best = None
        for bp in np.unique(np.concatenate([[1.0], np.geomspace(1, max(2.0, x[:, 0].max()), 64)])):
            a = np.column_stack([np.maximum(bp, x[:, 0]), x[:, 1], x[:, 2], np.ones(len(y))]) / y[:, None]
            coef = _nonnegative_lstsq(a, np.ones(len(y)))
            pred = np.column_stack([np.maximum(bp, x[:, 0]), x[:, 1], x[:, 2], np.ones(len(y))]) @ coef
            err = float(np.mean(np.abs(pred - y) / y))
            if best is None or err < best[0]:
                best = (err, bp, coef)
        err, bp, (b, c, d, e) = best
        return cls(float(bp), float(b), float(c), float(d), float(e)), err


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
    date: str = ""
    commit: str | None = None
    pagedserve_version: str = ""

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "Calibration":
        return cls(**{**data, "cost": CostModel(**data["cost"])})

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2))

    def describe(self) -> str:
        c = self.cost
        return (f"{self.model} ({self.dtype}, KV {self.kv_cache_dtype}) on {self.gpu}, measured {self.date}"
                f"{f' at {self.commit}' if self.commit else ''}: a step costs {1e3 * c.fixed:.3f} ms + "
                f"{1e6 * c.per_token:.2f} us x max({c.breakpoint:.0f}, tokens) + {1e9 * c.per_context:.2f} ns a "
                f"context token decoded + {1e12 * c.per_prefill_work:.3f} ps a prompt token x position "
                f"(fit error {100 * self.mape:.1f} %)")


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
    except (json.JSONDecodeError, TypeError, KeyError) as e:
        raise ConfigError(f"--simulate {path}: not a calibration file ({e}).") from e


def mape(predicted: list[float], measured: list[float]) -> float:
    return float(np.mean([abs(p - m) / m for p, m in zip(predicted, measured) if m > 0])) if measured else math.nan
