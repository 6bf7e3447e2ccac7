"""``pagedserve serve MODEL [flags]``: vLLM's flag names, uvicorn underneath."""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import threading

import uvicorn

logger = logging.getLogger(__name__)


class _Server(uvicorn.Server):
    """uvicorn, except that a drained SIGTERM/SIGINT exits with status 0 (uvicorn re-raises the signal
    after its graceful shutdown, which makes the process die of it)."""

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def add_serve_parser(sub) -> None:
    from pagedserve.cli import add_engine_args

    p = sub.add_parser("serve", help="Start the OpenAI-compatible server.")
    add_engine_args(p)
    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1", help="Address to bind (default: loopback only).")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--served-model-name", nargs="+", default=None,
                   help="Name(s) clients use in the 'model' field (default: the model argument).")
    s.add_argument("--api-key", default=None,
                   help="Require 'Authorization: Bearer KEY' on every route but /health and /metrics.")
    s.add_argument("--max-num-queued-reqs", type=int, default=None,
                   help="Most requests in flight (waiting + running); more get HTTP 503 with Retry-After.")
    s.add_argument("--max-num-queued-tokens", type=int, default=None,
                   help="Most prompt tokens of requests not yet started (waiting or prefilling); more get 503. "
                        "vLLM's advice: the TTFT target times the measured prefill throughput.")
    s.add_argument("--profiles", default=None,
                   help="A degradation profiles file (YAML, as `pagedserve tune` writes): start in normal, "
                        "switch to protect when a trigger fires and back when it clears.")
    s.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="On SIGTERM, seconds to let in-flight requests finish before exiting.")
    s.add_argument("--log-level", default="INFO")
    s.add_argument("--disable-log-stats", action="store_true", help="No periodic throughput/queue/KV log line.")
    p.set_defaults(func=cmd_serve)


def build_server(ns: argparse.Namespace):
    """The engine, the app and a configured uvicorn server (not yet running)."""
    from pagedserve.cli import engine_args_from
    from pagedserve.errors import ConfigError
    from pagedserve.server.app import build_app
    from pagedserve.server.state import ServerSettings
    from pagedserve.server.async_engine import AsyncEngine

    for name in ("max_num_queued_reqs", "max_num_queued_tokens"):
        if getattr(ns, name) is not None and getattr(ns, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be at least 1.")
    profiles = None
    if ns.profiles is not None:
        from pagedserve.tune.profiles import load_profiles

        profiles = load_profiles(ns.profiles)
    if ns.api_key is not None and not ns.api_key.strip():
        raise ConfigError("--api-key is empty: give a key, or leave the flag out to serve without one.")
    if not 0 < ns.port < 65536:
        raise ConfigError(f"--port {ns.port} is not a TCP port.")
    config = engine_args_from(ns).create_config()
    if profiles is not None:
        from pagedserve.tune.profiles import check_against_engine

        check_against_engine(profiles, config)  # before the model loads: a bad file fails in a second
    engine = AsyncEngine(config)
    settings = ServerSettings(served_model_names=ns.served_model_name or [ns.model], api_key=ns.api_key,
                              max_num_queued_reqs=ns.max_num_queued_reqs,
                              max_num_queued_tokens=ns.max_num_queued_tokens, shutdown_timeout=ns.shutdown_timeout,
                              log_stats_interval=0.0 if ns.disable_log_stats else 10.0, profiles=profiles)
    app = build_app(engine, settings)
    uv_config = uvicorn.Config(app, host=ns.host, port=ns.port, log_level=ns.log_level.lower(),
                               timeout_graceful_shutdown=int(ns.shutdown_timeout), access_log=False)
    return _Server(uv_config)


def cmd_serve(ns: argparse.Namespace) -> None:
    server = build_server(ns)
    logger.info("serving %s on http://%s:%d (SIGTERM or Ctrl-C drains in-flight requests, then exits)",
                ns.model, ns.host, ns.port)
    server.run()
