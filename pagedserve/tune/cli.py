"""``pagedserve plan``, ``pagedserve diagnose`` and ``pagedserve tune``."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys


def cmd_plan(ns: argparse.Namespace) -> None:
    from pagedserve.args import engine_args_from
    from pagedserve.tune.plan import make_plan

    recorded = None
    if ns.lengths_from is not None:
        from pagedserve.bench.datasets import read_recorded_lengths

        recorded = [r["prompt_tokens"] + r["output_tokens"]
                    for r in read_recorded_lengths(ns.lengths_from, "--lengths-from")]
    plan = make_plan(engine_args_from(ns), gpu=ns.gpu, gpu_memory_gib=ns.gpu_memory, input_len=ns.input_len,
                     output_len=ns.output_len, recorded=recorded)
    print(json.dumps(plan.to_json(), indent=2) if ns.json else plan.table())
    if plan.failures:
        sys.exit(1)  # scripts can gate a deployment on the plan


def cmd_diagnose(ns: argparse.Namespace) -> None:
    from pagedserve.tune.diagnose import diagnose, scrape_window

    samples, failed = scrape_window(ns.url, ns.window, ns.interval)
    result = diagnose(samples, ns.max_num_seqs, ns.url.rstrip("/"), failed, ns.max_num_batched_tokens)
    print(json.dumps(dataclasses.asdict(result), indent=2) if ns.json else result.text())


def gpu_facts() -> tuple[int, str] | None:
    """(total memory as torch reports it, name) of the first GPU, read in a child process: the client of a
    server it starts must hold no CUDA context (hundreds of MiB) on the server's device."""
    import subprocess
    import sys

    code = ("import torch\nif torch.cuda.is_available():\n"
            "    print(torch.cuda.mem_get_info(0)[1]); print(torch.cuda.get_device_name(0))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stdout.split("\n")
    return (int(out[0]), out[1]) if out and out[0].strip().isdigit() else None


def memory_plan(args, gpu: tuple[int, str] | None) -> tuple[str, str]:
    """(device name, the planner's table) for the device the server will run on."""
    import dataclasses as dc
    import os

    from pagedserve.errors import ConfigError
    from pagedserve.memory import GiB
    from pagedserve.tune.plan import make_plan

    if gpu is not None:
        plan = make_plan(args, gpu_memory_gib=gpu[0] / GiB)
        device = gpu[1]
    else:
        config = args.create_config()
        plan = make_plan(dc.replace(args, kv_cache_memory=config.kv_cache_memory))
        device = f"CPU ({os.cpu_count()} cores)"
    if plan.failures:
        raise ConfigError(f"The memory plan fails at start-up: {plan.failures[0]}")
    return device, plan.table()


def cmd_tune(ns: argparse.Namespace) -> None:
    """Plan, measure the ladder, pick the recommendation, and write profiles, runbook and alerts."""
    from pagedserve.bench.knee import LADDERS
    from pagedserve.bench.sweep import plan_from, result_dir, run_sweep
    from pagedserve.args import engine_args_from, engine_flags
    from pagedserve.tune.derive import derive
    from pagedserve.tune.profiles import check_against_engine, dump_profiles
    from pagedserve.tune.runbook import alert_rules, runbook

    from pagedserve.config import resolve_model
    from pagedserve.errors import ConfigError

    args = engine_args_from(ns)
    resolve_model(args.model, args.load_format)  # e.g. a built-in name without --load-format dummy
    flags = engine_flags(args)
    simulate = None
    if ns.simulate:
        from pagedserve.sim.ladder import Simulation

        simulate = Simulation.load(ns.simulate, ns.gpu_memory, ns.gpu)
        simulate.engine(args.model, flags)
        gpu = (simulate.gpu_memory_bytes, f"{simulate.gpu} (simulated)")
    elif ns.gpu_memory is not None or ns.gpu is not None:
        raise ConfigError("--gpu and --gpu-memory size a simulated GPU: give them with --simulate.")
    else:
        gpu = gpu_facts() if args.device != "cpu" else None
    config = args.create_config(plan_for="cuda" if gpu else None, serving=True)  # as the server will resolve it
    plan = plan_from(ns)
    if plan.mode != "concurrency":  # before any server starts: derive sizes the profiles from concurrency
        raise ConfigError(f"tune sizes max_num_seqs from a concurrency ladder: use --concurrency, not "
                          f"{LADDERS[plan.mode][0]} (bench sweep runs that ladder).")
    folder = result_dir(ns.result_dir, "tune")
    device, plan_text = memory_plan(args, gpu)
    (folder / "plan.txt").write_text(plan_text + "\n")
    print(f"Memory plan on {device}:\n{plan_text}\n", flush=True)

    ns.api_key = None
    doc = run_sweep(ns, plan, folder, serve_flags=flags, runs=[("server", None, flags)], simulate=simulate)
    d = derive(doc, config, model=args.model)
    check_against_engine(d.spec, config)  # what serve --profiles will check
    serve = " ".join(["pagedserve", "serve", args.model, *flags])
    header = (f"Degradation profiles for {args.model} on {device}, from the ladder measured by\n"
              f"{' '.join(doc['command'])} on {doc['date']}.\nServe: {serve} --profiles profiles.yaml\n"
              f"Every value's source is in RUNBOOK.md.")
    (folder / "profiles.yaml").write_text(dump_profiles(d.spec, header))
    (folder / "RUNBOOK.md").write_text(runbook(d, doc, model=args.model, device=device, serve_command=serve,
                                               plan_text=plan_text, simulated=simulate is not None))
    (folder / "alerts.yaml").write_text(alert_rules(d, args.model))
    normal, protect = d.spec.profiles["normal"], d.spec.profiles["protect"]
    print(f"\nnormal:  --max-num-seqs {normal.max_num_seqs} --max-num-batched-tokens {normal.max_num_batched_tokens}, "
          f"{normal.max_num_queued_reqs} in flight\nprotect: --max-num-seqs {protect.max_num_seqs} "
          f"--max-num-batched-tokens {protect.max_num_batched_tokens}, prompts up to {protect.max_input_tokens} tokens, "
          f"{protect.max_num_queued_reqs} in flight"
          + (f", priorities above {protect.max_priority} shed" if protect.max_priority is not None else "") + "\n"
          f"Wrote {folder}/profiles.yaml, RUNBOOK.md, alerts.yaml and the ladder's report.html.\n"
          f"Serve with: {serve} --profiles {folder}/profiles.yaml")


def add_tune_parsers(sub) -> None:
    from pagedserve.args import add_engine_args, non_negative_float, positive_float, positive_int
    from pagedserve.tune.plan import GPU_PRESETS

    p = sub.add_parser("plan", help="The memory budget of a configuration, without a GPU.")
    add_engine_args(p)
    g = p.add_argument_group("plan")
    g.add_argument("--gpu", choices=list(GPU_PRESETS), default=None, help="A GPU preset (its total memory).")
    g.add_argument("--gpu-memory", type=positive_float, default=None,
                   help="Total GPU memory in GiB (overrides --gpu).")
    g.add_argument("--input-len", type=positive_int, default=None,
                   help="Typical prompt tokens (concurrency at this length).")
    g.add_argument("--output-len", type=positive_int, default=None, help="Typical output tokens.")
    g.add_argument("--lengths-from", default=None, metavar="FILE",
                   help="A `serve --record-lengths` file: the concurrency at its requests' p50, p95 and largest "
                        "context, and the --max-num-seqs warning judged at its p95.")
    g.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_plan)

    d = sub.add_parser("diagnose", help="Read a running server's /metrics and name what limits it.")
    d.add_argument("--url", required=True, help="Base URL of the server, e.g. http://127.0.0.1:8000")
    d.add_argument("--window", type=non_negative_float, default=10.0,
                   help="Seconds to watch (0: one scrape).")
    d.add_argument("--interval", type=positive_float, default=1.0, help="Seconds between scrapes.")
    d.add_argument("--max-num-seqs", type=positive_int, default=None,
                   help="The server's --max-num-seqs, to tell queueing at the cap from the token budget "
                        "(default: what a pagedserve server reports in force; give it for vLLM).")
    d.add_argument("--max-num-batched-tokens", type=positive_int, default=None,
                   help="The server's --max-num-batched-tokens, to show how full its steps run (default: as "
                        "for --max-num-seqs).")
    d.add_argument("--json", action="store_true")
    d.set_defaults(func=cmd_diagnose)

    from pagedserve.bench.cli import add_ladder_args, add_simulate_args

    t = sub.add_parser("tune", help="One command: plan the memory, start the server, run the concurrency ladder, "
                                    "and write normal/protect profiles, a runbook and alert rules.")
    add_engine_args(t)
    add_ladder_args(t, client=False)
    add_simulate_args(t)
    t.set_defaults(func=cmd_tune)
