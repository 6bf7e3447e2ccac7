"""``pagedserve plan`` and ``pagedserve diagnose``."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys


def cmd_plan(ns: argparse.Namespace) -> None:
    from pagedserve.cli import engine_args_from
    from pagedserve.tune.plan import make_plan

    plan = make_plan(engine_args_from(ns), gpu=ns.gpu, gpu_memory_gib=ns.gpu_memory, input_len=ns.input_len,
                     output_len=ns.output_len)
    print(json.dumps(plan.to_json(), indent=2) if ns.json else plan.table())
    if plan.failures:
        sys.exit(1)  # scripts can gate a deployment on the plan


def cmd_diagnose(ns: argparse.Namespace) -> None:
    from pagedserve.tune.diagnose import diagnose, scrape_window

    samples = scrape_window(ns.url, ns.window, ns.interval)
    result = diagnose(samples, ns.max_num_seqs)
    print(json.dumps(dataclasses.asdict(result), indent=2) if ns.json else result.text())


def add_tune_parsers(sub) -> None:
    from pagedserve.cli import add_engine_args
    from pagedserve.tune.plan import GPU_PRESETS

    p = sub.add_parser("plan", help="The memory budget of a configuration, without a GPU.")
    add_engine_args(p)
    g = p.add_argument_group("plan")
    g.add_argument("--gpu", choices=list(GPU_PRESETS), default=None, help="A GPU preset (its total memory).")
    g.add_argument("--gpu-memory", type=float, default=None, help="Total GPU memory in GiB (overrides --gpu).")
    g.add_argument("--input-len", type=int, default=None, help="Typical prompt tokens (concurrency at this length).")
    g.add_argument("--output-len", type=int, default=None, help="Typical output tokens.")
    g.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_plan)

    d = sub.add_parser("diagnose", help="Read a running server's /metrics and name what limits it.")
    d.add_argument("--url", required=True, help="Base URL of the server, e.g. http://127.0.0.1:8000")
    d.add_argument("--window", type=float, default=10.0, help="Seconds to watch.")
    d.add_argument("--interval", type=float, default=1.0, help="Seconds between scrapes.")
    d.add_argument("--max-num-seqs", type=int, default=None,
                   help="The server's --max-num-seqs, to tell queueing at the cap from the token budget.")
    d.add_argument("--json", action="store_true")
    d.set_defaults(func=cmd_diagnose)
