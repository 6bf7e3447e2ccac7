"""A sweep's artefacts: sweep.json (everything), sweep.csv (a row a rung), summary.md (a table to paste
into a ticket), PNG plots (matplotlib) and report.html (one self-contained page, the plots inlined)."""

from __future__ import annotations

import base64
import csv
import html
import json
from pathlib import Path

from pagedserve.bench.knee import HOST_BOUND

CSV_FIELDS = (
    "ladder", "load", "completed", "failed", "duration", "request_throughput", "output_throughput",
    "total_token_throughput", "request_goodput",
    *(f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for s in ("mean", "p50", "p95", "p99")),
    "server_preemptions", "server_device_wait_share", "server_peak_kv_cache_usage", "server_peak_num_requests_running",
    "server_peak_num_requests_waiting", "server_peak_device_memory_bytes", "server_peak_nvml_device_memory_bytes",
    "signals",
)
PLOTS = ("throughput.png", "latency.png", "memory.png")


def _na(v, fmt) -> str:
    return "n/a" if v is None else fmt(v)


def _signals_at(ladder: dict, i: int) -> list[dict]:
    return [s for s in ladder["knee"]["signals"] if s["rung"] == i]


def table_rows(doc: dict, ladder: dict) -> list[list[str]]:
    knee = ladder["knee"]
    rows = []
    for i, r in enumerate(ladder["rungs"]):
        mark = []
        if i == knee["knee"]:
            mark.append("**knee**")
        if i == knee["recommendation"]:
            mark.append("**recommended**")
        for sig in _signals_at(ladder, i):
            name = sig["name"] + ("" if sig["enabled"] else " (info)")
            if name not in mark:
                mark.append(name)
        if r.get("server_prefix_cache_hit_rate"):  # prompts served from the cache, not prefilled
            mark.append(f"prefix cache {100 * r['server_prefix_cache_hit_rate']:.0f} %")
        run, wait = r.get("server_peak_num_requests_running"), r.get("server_peak_num_requests_waiting")
        rows.append([
            f"{r['load']:g}", f"{r['completed']}/{r['failed']}", f"{r['request_throughput']:.2f}",
            f"{r['output_throughput']:,.0f}", f"{r['total_token_throughput']:,.0f}", f"{r['p95_ttft_ms']:,.1f}",
            f"{r['p95_itl_ms']:,.1f}", _na(r.get("p99_itl_ms"), lambda v: f"{v:,.1f}"), f"{r['p95_e2el_ms']:,.0f}",
            _na(r.get("server_preemptions"), lambda v: f"{v:.0f}"),
            _na(r.get("server_peak_kv_cache_usage"), lambda v: f"{100 * v:.1f}"),
            f"{_na(run, lambda v: f'{v:.0f}')}/{_na(wait, lambda v: f'{v:.0f}')}",
            _na(r.get("server_peak_device_memory_bytes"), lambda v: f"{v / 2**30:.2f}"),
            ", ".join(mark)])
    return rows


def table_header(doc: dict) -> list[str]:
    return [doc["unit"], "ok/failed", "req/s", "out tok/s", "total tok/s", "p95 TTFT ms", "p95 ITL ms",
            "p99 ITL ms", "p95 E2EL ms", "preemptions", "peak KV %", "peak run/wait", "peak mem GiB", "notes"]


def _describe_target(doc: dict) -> str:
    t = doc["target"]
    if "simulated" in t:
        return f"`{' '.join(t['command'])}`, **simulated** ({t['simulated']})"
    if "base_url" in t:
        return f"the server at {t['base_url']}"
    return f"`{' '.join(t['command'])}` (started by the sweep)"


def _workload(doc: dict) -> str:
    d = doc["dataset"]
    if d["dataset_name"] == "random":
        spread = f" (±{100 * d['random_range_ratio']:.0f} %)" if d["random_range_ratio"] else ""
        prefix = f", a shared prefix of {d['random_prefix_len']}" if d["random_prefix_len"] else ""
        return (f"random prompts of {d['random_input_len']} tokens in, {d['random_output_len']} out{spread}{prefix}")
    if d["dataset_name"] == "lengths":
        return f"random prompts with the recorded lengths of {d['dataset_path']}"
    return f"{d['dataset_name']} prompts from {d['dataset_path']}"


def summary_markdown(doc: dict) -> str:
    lines = [f"# Load sweep: {doc['model_id']}", "",
             f"{doc['date']}, pagedserve {doc['pagedserve_version']}. Target: {_describe_target(doc)}. Workload: "
             f"{_workload(doc)}; {doc['unit']} {', '.join(f'{x:g}' for x in doc['loads'])}; "
             f"{', '.join(str(n) for n in doc['prompts_per_rung'])} prompts per rung"
             + (f", {doc['repeats']} repeats (medians)" if doc["repeats"] > 1 else "") + ".", ""]
    if doc["slo"]:
        lines += ["SLO: " + ", ".join(f"{k} ≤ {v:g} ms" for k, v in doc["slo"].items()), ""]
    rec = doc["recommendation"]
    lines += ["## Recommendation", "", f"**{rec['reason']}**" if rec else "**No recommendation.**", ""]
    header = table_header(doc)
    for ladder in doc["ladders"]:
        if len(doc["ladders"]) > 1:
            lines += [f"## {ladder['label']}", ""]
        knee = ladder["knee"]
        lines += [knee["reason"], ""]
        if len(doc["ladders"]) > 1:  # with one ladder its recommendation is the one above
            lines += [knee["recommendation_reason"], ""]
        lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(row) + " |" for row in table_rows(doc, ladder)]
        lines.append("")
    if len(doc["ladders"]) > 1:
        lines += ["## Grid comparison", "", f"| {doc['grid']['param']} | knee | recommended | out tok/s there | "
                  f"p95 TTFT ms | p95 ITL ms |", "|---|---|---|---|---|---|"]
        for ladder in doc["ladders"]:
            k = ladder["knee"]
            r = ladder["rungs"][k["recommendation"]] if k["recommendation"] is not None else None
            lines.append(f"| {ladder['grid_value']} | {_na(k['knee_load'], lambda v: f'{v:g}')} | "
                         f"{_na(k['recommended_load'], lambda v: f'{v:g}')} | "
                         f"{_na(r, lambda r: format(r['output_throughput'], ',.0f'))} | "
                         f"{_na(r, lambda r: format(r['p95_ttft_ms'], ',.1f'))} | "
                         f"{_na(r, lambda r: format(r['p95_itl_ms'], ',.1f'))} |")
        lines.append("")
    lines += ["Columns: throughputs over each rung's whole run; latencies are p95 (and ITL's p99, the stutter a "
              "stream feels when a prompt shares its step) over its requests (ITL pooled over streamed chunks, as "
              "vLLM bench); preemptions, peaks and memory are the server's, over the "
              "rung's window. Signals are explained in the README (Load sweep).", ""]
    return "\n".join(lines)


def write_csv(doc: dict, path: Path) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        w.writeheader()
        for ladder in doc["ladders"]:
            for i, r in enumerate(ladder["rungs"]):
                names = dict.fromkeys(s["name"] for s in _signals_at(ladder, i) if s["enabled"])
                w.writerow({**r, "ladder": ladder["label"], "signals": " ".join(names)})


def write_plots(doc: dict, folder: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import LogLocator, MaxNLocator, NullLocator, ScalarFormatter

    unit = doc["unit"]
    several = len(doc["ladders"]) > 1
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]

    def axis(ax, title: str, log_y: bool = False, integer: bool = False) -> None:
        ax.set_xscale("log", base=2)
        ax.set_xticks(doc["loads"], [f"{x:g}" for x in doc["loads"]])
        ax.minorticks_off()
        ax.set_xlabel(unit)
        ax.set_title(title)
        if log_y:  # ticks at 1-2-5 steps, written as plain numbers
            ax.set_yscale("log")
            ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
            ax.yaxis.set_major_formatter(ScalarFormatter())
            ax.yaxis.set_minor_locator(NullLocator())
        if integer:
            ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylim(bottom=None if log_y else 0)
        ax.grid(True, alpha=0.3)

    def series(ax, key) -> bool:
        """Each ladder's curve with its knee (red X) and recommendation (green star); with one ladder,
        dashed guides at both. False when no rung has a value (the server did not report it)."""
        drawn = False
        for j, ladder in enumerate(doc["ladders"]):
            pts = [(r["load"], key(r)) for r in ladder["rungs"] if key(r) is not None]
            if not pts:
                continue
            drawn = True
            color = colors[j % len(colors)]
            ax.plot(*zip(*pts), "-o", color=color, label=ladder["label"] if several else None)
            knee = ladder["knee"]
            for idx, style, label in ((knee["knee"], dict(marker="X", color="red", s=110), "knee"),
                                      (knee["recommendation"], dict(marker="*", color="green", s=220), "recommended")):
                if idx is None or key(ladder["rungs"][idx]) is None:
                    continue
                x = ladder["rungs"][idx]["load"]
                ax.scatter([x], [key(ladder["rungs"][idx])], zorder=5, label=None if several else label, **style)
                if not several:
                    ax.axvline(x, color=style["color"], linestyle="--", alpha=0.4)
        if not drawn:
            ax.text(0.5, 0.5, "n/a: the server's /metrics\ndid not report this", ha="center", va="center",
                    transform=ax.transAxes)
        return drawn

    def panel_row(name: str, title: str, panels) -> Path:
        fig, axes = plt.subplots(1, len(panels), figsize=(4.8 * len(panels), 4.3))
        for ax, (key, label, extra) in zip(axes, panels):
            series(ax, key)
            axis(ax, label, **extra.get("axis", {}))
            for y, text in extra.get("lines", ()):
                ax.axhline(y, color="purple", linestyle=":", label=text)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=8)
        fig.suptitle(f"{title} vs {unit}: {doc['model_id']}")
        return _save(fig, folder / name)

    def slo_lines(metric: str):
        return [(v, f"SLO {k} {v:g} ms") for k, v in doc["slo"].items() if k.startswith(metric + "_")]

    def scaled(field: str, factor: float):
        return lambda r: None if r.get(field) is None else factor * r[field]

    kv_limit = 100 * doc["knee_settings"]["kv_usage"]
    return [
        panel_row(PLOTS[0], "Throughput", [
            (lambda r: r["output_throughput"], "output tokens/s", {}),
            (lambda r: r["total_token_throughput"], "total tokens/s (prompt + output)", {}),
            (lambda r: r["request_throughput"], "requests/s", {}),
            (scaled("server_device_wait_share", 100), "engine waiting on the GPU (%)",
             {"lines": [(100 * HOST_BOUND, f"below {100 * HOST_BOUND:g} %: the host bounds the steps")]})]),
        panel_row(PLOTS[1], "p95 latency", [
            (lambda r, m=m: r.get(f"p95_{m}_ms"), f"p95 {m.upper()} (ms)",
             {"axis": {"log_y": True}, "lines": slo_lines(m)}) for m in ("ttft", "itl", "e2el")]),
        panel_row(PLOTS[2], "Memory", [
            (scaled("server_peak_kv_cache_usage", 100), "peak KV-cache usage (%)",
             {"lines": [(kv_limit, f"knee at {kv_limit:g} %")]}),
            (scaled("server_peak_device_memory_bytes", 2**-30), "peak device memory (GiB)", {}),
            (lambda r: r.get("server_preemptions"), "preemptions", {"axis": {"integer": True}})]),
    ]


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:2em auto;max-width:1180px;color:#222;padding:0 1em}
h1{font-size:1.5em;margin-bottom:.2em}.meta{color:#666;font-size:.9em}
.rec{background:#eefbea;border-left:6px solid #2e9d3a;padding:.8em 1em;margin:1em 0;font-size:1.1em}
.none{background:#fff4e5;border-left-color:#e08a00}
.knee{background:#fdecec;border-left:6px solid #d33;padding:.6em 1em;margin:.6em 0}
table{border-collapse:collapse;font-size:.85em;margin:.6em 0;width:100%}
th,td{border:1px solid #ddd;padding:4px 6px;text-align:right}th{background:#f3f3f3}
td:last-child,th:last-child{text-align:left}tr.kneerow{background:#fdecec}tr.recrow{background:#eefbea}
img{max-width:100%;border:1px solid #eee;margin:.4em 0}code{background:#f3f3f3;padding:1px 4px}
"""


def report_html(doc: dict, folder: Path) -> str:
    e = html.escape
    rec = doc["recommendation"]
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>Load sweep: {e(doc['model_id'])}</title>",
             f"<style>{_CSS}</style></head><body>",
             f"<h1>Load sweep: {e(doc['model_id'])}</h1>",
             f"<p class='meta'>{e(doc['date'])} · pagedserve {e(doc['pagedserve_version'])} · "
             f"{e(_describe_target(doc))} · {e(_workload(doc))}</p>",
             f"<div class='rec{'' if rec else ' none'}'><b>Recommendation:</b> "
             f"{e(rec['reason']) if rec else 'none: see the knee below.'}</div>"]
    if doc["slo"]:
        parts.append("<p>SLO: " + ", ".join(f"{e(k)} ≤ {v:g} ms" for k, v in doc["slo"].items()) + "</p>")
    header = table_header(doc)
    for ladder in doc["ladders"]:
        knee = ladder["knee"]
        if len(doc["ladders"]) > 1:
            parts.append(f"<h2>{e(ladder['label'])}</h2>")
        parts.append(f"<div class='knee'>{e(knee['reason'])}</div><p>{e(knee['recommendation_reason'])}</p>")
        parts.append("<table><tr>" + "".join(f"<th>{e(h)}</th>" for h in header) + "</tr>")
        for i, row in enumerate(table_rows(doc, ladder)):
            cls = "kneerow" if i == knee["knee"] else "recrow" if i == knee["recommendation"] else ""
            cells = "".join(f"<td>{e(c).replace('**', '')}</td>" for c in row)
            parts.append(f"<tr class='{cls}'>{cells}</tr>")
        parts.append("</table>")
        fired = knee["signals"]
        if fired:
            parts.append("<details><summary>Every signal that fired</summary><ul>" + "".join(
                f"<li>{e(s['name'])}{'' if s['enabled'] else ' (informational)'}: {e(s['message'])}</li>"
                for s in fired) + "</ul></details>")
    for name in PLOTS:
        path = folder / name
        if path.is_file():
            data = base64.b64encode(path.read_bytes()).decode()
            parts.append(f"<img alt='{e(name)}' src='data:image/png;base64,{data}'>")
    parts.append("<details><summary>Configuration and command</summary><pre>"
                 + e(json.dumps({k: doc[k] for k in ("command", "target", "mode", "loads", "prompts_per_rung",
                                                     "warmup", "repeats", "reset_prefix_cache", "dataset", "slo",
                                                     "knee_settings", "grid")}, indent=2))
                 + "</pre></details>")
    parts.append("</body></html>")
    return "\n".join(parts)


def write_artefacts(doc: dict, folder: Path) -> list[Path]:
    """Write every artefact into ``folder``; returns their paths."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = [folder / "sweep.json", folder / "sweep.csv", folder / "summary.md"]
    paths[0].write_text(json.dumps(doc, indent=2))
    write_csv(doc, paths[1])
    paths[2].write_text(summary_markdown(doc))
    paths += write_plots(doc, folder)
    (folder / "report.html").write_text(report_html(doc, folder))
    return [*paths, folder / "report.html"]
