"""How close a simulated ladder comes to a measured one: rung by rung, the simulated value against the
measured one for output throughput and the p95 latencies, and the knee and recommendation of each.

python -m benchmarks.sim.accuracy MEASURED_DIR SIMULATED_DIR

Both folders are `bench sweep` (or `tune`) results of the same ladder: run the simulated one with the
measured one's flags and `--simulate CALIBRATION`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.args import run_main

METRICS = (("output_throughput", "out tok/s", "{:,.0f}"), ("p95_ttft_ms", "p95 TTFT ms", "{:,.0f}"),
           ("p95_itl_ms", "p95 ITL ms", "{:.2f}"), ("p95_e2el_ms", "p95 E2EL ms", "{:,.0f}"))


def compare(measured: dict, simulated: dict) -> tuple[list[str], dict[str, list[float]]]:
    """Markdown lines (one table per ladder) and each metric's relative errors."""
    lines, errors = [], {m: [] for m, _, _ in METRICS}
    for lm, ls in zip(measured["ladders"], simulated["ladders"]):
        lines += [f"### {lm['label']}", "", "| load | " + " | ".join(f"{h} (measured / simulated)" for _, h, _ in METRICS)
                  + " |", "|---" * (len(METRICS) + 1) + "|"]
        for rm, rs in zip(lm["rungs"], ls["rungs"]):
            cells = []
            for key, _, fmt in METRICS:
                m, s = rm[key], rs[key]
                errors[key].append((s - m) / m if m else 0.0)
                cells.append(f"{fmt.format(m)} / {fmt.format(s)} ({100 * (s - m) / m:+.0f} %)" if m else "n/a")
            lines.append(f"| {rm['load']:g} | " + " | ".join(cells) + " |")
        km, ks = lm["knee"], ls["knee"]
        lines += ["", f"Knee: measured {km['knee_load']}, simulated {ks['knee_load']}; recommendation: measured "
                      f"{km['recommended_load']}, simulated {ks['recommended_load']}.", ""]
    rm, rs = measured.get("recommendation"), simulated.get("recommendation")
    if rm and rs:
        lines += [f"Recommendation: measured {rm['label']} at {rm['concurrency']}, simulated {rs['label']} at "
                  f"{rs['concurrency']}.", ""]
    return lines, errors


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("measured")
    ap.add_argument("simulated")
    ns = ap.parse_args()
    measured, simulated = (json.loads((Path(d) / "sweep.json").read_text()) for d in (ns.measured, ns.simulated))
    if [r["load"] for l in measured["ladders"] for r in l["rungs"]] != [r["load"] for l in simulated["ladders"]
                                                                         for r in l["rungs"]]:
        raise SystemExit("The two sweeps have different ladders: run the simulated one with the measured one's flags.")
    lines, errors = compare(measured, simulated)
    print("\n".join(lines))
    for (key, head, _) in METRICS:
        e = errors[key]
        print(f"{head}: mean absolute error {100 * sum(map(abs, e)) / len(e):.1f} %, worst {100 * max(e, key=abs):+.0f} %")


if __name__ == "__main__":
    run_main(main)
