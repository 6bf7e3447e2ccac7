"""``pagedserve serve MODEL [flags]``: vLLM's flag names, uvicorn underneath."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import sys
import threading
import time

import uvicorn

logger = logging.getLogger(__name__)


class Server(uvicorn.Server):
    """uvicorn, with the engine's way of stopping: on SIGTERM/SIGINT it stops accepting connections and lets
    requests in flight finish for --shutdown-timeout seconds; those still running then are ended with an
    error (an error frame and [DONE] on a stream), so no client is cut off without a word. ``exit_code``:
    0 when everything drained, 1 when requests were cut or the engine died (a supervisor should know)."""

    def __init__(self, config: uvicorn.Config, engine, drain_timeout: float):
        super().__init__(config)
        self.engine, self.drain_timeout = engine, drain_timeout
        self.cut = 0

    @property
    def exit_code(self) -> int:
        return 1 if self.cut or self.engine.dead is not None else 0

    async def shutdown(self, sockets=None) -> None:
        drain = asyncio.create_task(self._drain())
        await super().shutdown(sockets)
        await drain

    async def _drain(self) -> None:
        from pagedserve.server.errors import ShuttingDownError

        if not await self.engine.wait_idle(self.drain_timeout):
            self.cut = self.engine.fail_requests(ShuttingDownError(
                f"The server is shutting down: this request did not finish within the {self.drain_timeout:g} s "
                f"it allows (--shutdown-timeout); retry it elsewhere."))
            logger.error("Shutdown: %d request(s) still running after %g s were ended with an error", self.cut,
                         self.drain_timeout)

    @contextlib.contextmanager
    def capture_signals(self):
        """Take SIGTERM/SIGINT as a request to drain; unlike uvicorn's own, do not re-raise the signal after
        the shutdown (the process would die of it instead of exiting with ``exit_code``)."""
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
    from pagedserve.args import add_engine_args, non_negative_float, non_negative_int, positive_int, tcp_port
    from pagedserve.server.tools import TOOL_CALL_PARSERS

    p = sub.add_parser("serve", help="Start the OpenAI-compatible server.")
    add_engine_args(p)
    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1", help="Address to bind (default: loopback only).")
    s.add_argument("--port", type=tcp_port, default=8000)
    s.add_argument("--served-model-name", nargs="+", default=None,
                   help="Name(s) clients use in the 'model' field (default: the model argument).")
    s.add_argument("--api-key", default=None,
                   help="Require 'Authorization: Bearer KEY' on every route but /health and /metrics.")
    s.add_argument("--max-num-queued-reqs", type=positive_int, default=None,
                   help="Most requests in flight (waiting + running); more get HTTP 503 with Retry-After.")
    s.add_argument("--max-num-queued-tokens", type=positive_int, default=None,
                   help="Most prompt tokens of requests not yet started (waiting or prefilling); more get 503. "
                        "vLLM's advice: the TTFT target times the measured prefill throughput.")
    s.add_argument("--profiles", default=None,
                   help="A degradation profiles file (YAML, as `pagedserve tune` writes): start in normal, "
                        "switch to protect when a trigger fires and back when it clears.")
    s.add_argument("--shutdown-timeout", type=non_negative_float, default=30.0,
                   help="On SIGTERM, seconds to let in-flight requests finish before exiting.")
    s.add_argument("--chat-template", default=None,
                   help="A chat template (a file, or the template itself) used instead of the tokenizer's.")
    s.add_argument("--trust-request-chat-template", action="store_true",
                   help="Render chat templates that requests send (a template is code: off by default).")
    s.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="Let the model decide when to call tools (tool_choice \"auto\"); needs --tool-call-parser.")
    s.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_CALL_PARSERS),
                   help="How the model writes tool calls (hermes: Qwen2.5, Qwen3, Hermes; llama3_json: Llama 3.1+; "
                        "mistral: Mistral's [TOOL_CALLS]; pythonic: Llama 3.2 and Llama 4's [f(x=1)] lists).")
    s.add_argument("--exclude-tools-when-tool-choice-none", action="store_true",
                   help="Leave the tools out of the prompt when a request's tool_choice is \"none\".")
    s.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="Add usage.prompt_tokens_details.cached_tokens: the prompt tokens the prefix cache gave.")
    s.add_argument("--record-lengths", default=None, metavar="FILE",
                   help="Append a JSON line for each finished request (arrival time, prompt tokens and those "
                        "the prefix cache gave, output tokens; no text): the traffic's shape, which `pagedserve "
                        "bench ... --dataset-name lengths --dataset-path FILE` replays.")
    s.add_argument("--allowed-origins", type=json_list, default=["*"],
                   help="Browser origins allowed to call the API (CORS), as a JSON list.")
    s.add_argument("--allowed-methods", type=json_list, default=["*"], help="CORS: allowed methods, a JSON list.")
    s.add_argument("--allowed-headers", type=json_list, default=["*"], help="CORS: allowed headers, a JSON list.")
    s.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials (cookies).")
    s.add_argument("--enable-request-id-headers", action="store_true",
                   help="Answer with an X-Request-Id header: the request's own, or a new id.")
    s.add_argument("--disable-fastapi-docs", action="store_true",
                   help="Serve no OpenAPI schema or docs pages (/openapi.json, /docs, /redoc).")
    s.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help="Logprobs name tokens as \"token_id:N\" instead of their text (exact for tokens that are "
                        "part of a character); a request's return_tokens_as_token_ids overrides it.")
    s.add_argument("--stream-interval", type=positive_int, default=1, metavar="N",
                   help="Streamed responses send a frame every N new tokens (the first token and the end at once): "
                        "fewer frames for the server to write at many requests in flight, coarser streams. "
                        "Default 1: a frame a token.")
    s.add_argument("--ssl-keyfile", default=None, help="Serve HTTPS with this private key (PEM); needs --ssl-certfile.")
    s.add_argument("--ssl-certfile", default=None, help="Serve HTTPS with this certificate (PEM).")
    s.add_argument("--ssl-ca-certs", default=None,
                   help="HTTPS: CA certificates that client certificates must chain to.")
    s.add_argument("--ssl-cert-reqs", type=int, default=0, choices=(0, 1, 2),
                   help="HTTPS: client certificates 0 not asked, 1 optional, 2 required (Python's ssl.CERT_*).")
    s.add_argument("--root-path", default="",
                   help="The path prefix a reverse proxy serves this server under and strips before forwarding "
                        "(e.g. /llm): the API docs and their schema name their URLs with it.")
    s.add_argument("--max-stored-responses", type=non_negative_int, default=0, metavar="N",
                   help="Keep the last N responses of /v1/responses in memory (0: none, the default), to be read "
                        "back (GET /v1/responses/ID) and continued with previous_response_id.")
    s.add_argument("--config", default=None, help="A YAML file of flags (names with - or _), as vLLM's; flags "
                                                  "on the command line win.")
    s.add_argument("--enable-log-requests", action="store_true", help="Log each request as it is admitted.")
    s.add_argument("--disable-log-requests", action="store_true",
                   help="Accepted for vLLM compatibility: requests are not logged unless --enable-log-requests.")
    s.add_argument("--log-level", default="INFO")
    s.add_argument("--uvicorn-log-level", default="info", help="uvicorn's own log level.")
    s.add_argument("--disable-log-stats", action="store_true", help="No periodic throughput/queue/KV log line.")
    p.set_defaults(func=cmd_serve)


def json_list(value: str) -> list[str]:
    """A flag's JSON list of strings, e.g. '["http://localhost:3000"]'."""
    try:
        parsed = json.loads(value)
    except ValueError:
        parsed = None
    if not isinstance(parsed, list) or not all(isinstance(v, str) for v in parsed):
        raise argparse.ArgumentTypeError(f"{value!r} is not a JSON list of strings, e.g. '[\"http://localhost:3000\"]'")
    return parsed


def load_chat_template(value: str | None) -> str | None:
    """--chat-template: a file's text, or the value itself; checked as Jinja now, not at the first request."""
    if value is None:
        return None
    from pathlib import Path

    import jinja2

    from pagedserve.errors import ConfigError

    path = Path(value)
    text = path.read_text() if path.is_file() else value
    if not path.is_file() and "{" not in value:
        raise ConfigError(f"--chat-template {value!r} is neither a file nor a Jinja template.")
    try:
        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as e:
        raise ConfigError(f"--chat-template: not a valid Jinja template (line {e.lineno}: {e.message}).") from e
    return text


def check_listen(host: str, port: int) -> None:
    """Fail before the model loads where the server could not listen: a host that does not resolve, or an
    address already in use (uvicorn would find out only after the weights and the KV cache are up)."""
    from pagedserve.errors import ConfigError

    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise ConfigError(f"--host {host}: no such address ({e.strerror}).") from None
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            probe.bind(address)
        except OSError as e:
            raise ConfigError(f"--host {host} --port {port}: cannot listen there ({e.strerror}); is another "
                              f"server on that port? Choose another --port.") from None


def build_server(ns: argparse.Namespace, worker=None):
    """The engine, the app and a configured uvicorn server (not yet running); ``worker`` as for
    ``EngineBase``."""
    from pagedserve.args import engine_args_from
    from pagedserve.errors import ConfigError, option
    from pagedserve.server.app import build_app
    from pagedserve.server.state import ServerSettings
    from pagedserve.server.async_engine import AsyncEngine

    profiles = None
    if ns.profiles is not None:
        from pagedserve.tune.profiles import load_profiles

        profiles = load_profiles(ns.profiles)
    if (ns.ssl_keyfile is None) != (ns.ssl_certfile is None):
        raise ConfigError("HTTPS needs both --ssl-keyfile and --ssl-certfile (or neither, for plain HTTP).")
    for name in ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs"):
        path = getattr(ns, name)
        if path is not None and not os.path.isfile(path):
            raise ConfigError(f"{option(name)} {path}: no such file.")
    if ns.api_key is not None and not ns.api_key.strip():
        raise ConfigError("--api-key is empty: give a key, or leave the flag out to serve without one.")
    if ns.served_model_name is not None and not all(name.strip() for name in ns.served_model_name):
        raise ConfigError(f"--served-model-name {ns.served_model_name}: a name is empty; give the names clients "
                          f"send as model, or leave the flag out to serve under the model's own name.")
    if ns.enable_auto_tool_choice and ns.tool_call_parser is None:
        raise ConfigError("--enable-auto-tool-choice needs --tool-call-parser: say how the model writes its calls "
                          "(hermes for Qwen2.5/Qwen3/Hermes, llama3_json for Llama 3.1+, mistral for Mistral, "
                          "pythonic for Llama 3.2 and Llama 4).")
    if ns.root_path and (not ns.root_path.startswith("/") or ns.root_path.endswith("/")):
        raise ConfigError(f"--root-path {ns.root_path!r}: give a path that starts with / and does not end with one, "
                          f"e.g. /llm.")
    check_listen(ns.host, ns.port)
    if ns.record_lengths is not None:
        from pagedserve.server.metrics import LengthRecorder

        LengthRecorder(ns.record_lengths).close()  # a file that cannot be appended to fails before the model loads
    config = engine_args_from(ns).create_config(serving=True)
    if profiles is not None:
        from pagedserve.tune.profiles import check_against_engine

        check_against_engine(profiles, config)  # before the model loads: a bad file fails in a second
    chat_template = load_chat_template(ns.chat_template)
    engine = AsyncEngine(config, worker)
    engine.inputs.chat_template = chat_template
    settings = ServerSettings(served_model_names=ns.served_model_name or [ns.model], api_key=ns.api_key,
                              max_num_queued_reqs=ns.max_num_queued_reqs,
                              max_num_queued_tokens=ns.max_num_queued_tokens, shutdown_timeout=ns.shutdown_timeout,
                              log_stats_interval=0.0 if ns.disable_log_stats else 10.0, profiles=profiles,
                              trust_request_chat_template=ns.trust_request_chat_template,
                              log_requests=ns.enable_log_requests,
                              tool_call_parser=ns.tool_call_parser if ns.enable_auto_tool_choice else None,
                              tools_when_none=not ns.exclude_tools_when_tool_choice_none,
                              prompt_tokens_details=ns.enable_prompt_tokens_details,
                              record_lengths=ns.record_lengths, max_stored_responses=ns.max_stored_responses,
                              cors={"allow_origins": ns.allowed_origins, "allow_methods": ns.allowed_methods,
                                    "allow_headers": ns.allowed_headers, "allow_credentials": ns.allow_credentials},
                              request_id_headers=ns.enable_request_id_headers, api_docs=not ns.disable_fastapi_docs,
                              tokens_as_ids=ns.return_tokens_as_token_ids, stream_interval=ns.stream_interval)
    app = build_app(engine, settings)
    # uvicorn's own deadline comes after ours, so it finds every stream already ended
    uv_config = uvicorn.Config(app, host=ns.host, port=ns.port, log_level=ns.uvicorn_log_level.lower(),
                               timeout_graceful_shutdown=int(ns.shutdown_timeout) + 10, access_log=False,
                               ssl_keyfile=ns.ssl_keyfile, ssl_certfile=ns.ssl_certfile, ssl_ca_certs=ns.ssl_ca_certs,
                               ssl_cert_reqs=ns.ssl_cert_reqs, root_path=ns.root_path)
    server = Server(uv_config, engine, ns.shutdown_timeout)

    def engine_died() -> None:  # exit, so that a supervisor restarts the server
        logger.error("The engine died: stopping the server (exit status 1)")
        server.should_exit = True

    engine.on_dead = engine_died
    return server


@contextlib.contextmanager
def serving_in_thread(server: Server, start_timeout: float = 120.0):
    """Run a built server in a thread of this process, from when it accepts connections until the block
    ends (for callers that drive it from outside: the tests, calibrate's timing of the host)."""
    thread = threading.Thread(target=server.run, name="http-server", daemon=True)  # the event loop's
    thread.start()
    deadline = time.monotonic() + start_timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the server did not start")
        time.sleep(0.05)
    try:
        yield server
    finally:
        server.should_exit = True
        thread.join(timeout=60)


def cmd_serve(ns: argparse.Namespace) -> None:
    server = build_server(ns)
    logger.info("serving %s on %s://%s:%d (SIGTERM or Ctrl-C drains in-flight requests, then exits)",
                ns.model, "https" if ns.ssl_certfile else "http", ns.host, ns.port)
    server.run()
    if server.exit_code:
        sys.exit(server.exit_code)
