"""`splash serve`: the OpenAI-compatible HTTP server on one model.

The listening socket is bound before the model loads, so a taken port fails in a second rather than
after the load, and `--port 0` works (the chosen port is printed). SIGINT/SIGTERM stop accepting
connections, let open requests end (bounded by --graceful-timeout), shut the engine down and exit 0.
"""

from __future__ import annotations

import argparse
import logging
import signal
import socket
import sys
import threading
import time
from typing import Any

from splash.config import EngineConfig


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, metrics)",
                       description="Serve a model over the OpenAI API on http://HOST:PORT/v1.")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (0 picks a free one)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
    p.add_argument("--served-model-name", default=None,
                   help="name clients send as `model` (default: the --model value)")
    p.add_argument("--arrival-gap-ms", type=float, default=3.0, metavar="MS",
                   help="an idle engine woken by a request waits for the rest of its burst (requests less "
                        "than MS apart, up to 10 x MS) before stepping; 0 steps at once (default 3)")
    p.add_argument("--graceful-timeout", type=float, default=5.0,
                   help="seconds open requests get to finish after SIGINT/SIGTERM")
    p.add_argument("--log-level", default="warning",
                   choices=("critical", "error", "warning", "info", "debug"))
    EngineConfig.add_cli_args(p)  # every engine option (splash/config.py), --model required below
    p.set_defaults(func=run)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The server's engine options: a server's batch defaults, memory release only with the flag (as
    SGLang)."""
    return EngineConfig.from_cli_args(args, serving=True,
                                      enable_memory_saver=bool(getattr(args, "enable_memory_saver", False)),
                                      arrival_gap_ms=max(0.0, getattr(args, "arrival_gap_ms", 0.0)))


def _bind(host: str, port: int, flag: str = "--port") -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise SystemExit(f"splash serve: cannot listen on {host}:{port}: {e.strerror}; "
                         f"choose another {flag}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def build_engine(args: argparse.Namespace) -> Any:
    """Construct the AsyncEngine from the options given (unset ones keep the engine's defaults)."""
    from splash.engine.async_engine import AsyncEngine

    return AsyncEngine.from_config(engine_config(args))


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from splash.server.app import create_app
    from splash.worker.host_malloc import freeze_heap

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    if args.port < 0 or args.port > 65535:
        print(f"splash serve: --port must be in [0, 65535], got {args.port}", file=sys.stderr)
        return 2
    if args.model is None:
        print("splash serve: give --model (a checkpoint directory, or a built-in model such as tiny)",
              file=sys.stderr)
        return 2
    try:  # a node without rank 0 serves its ranks only; node 0 runs the HTTP server
        from splash.engine.group import follow_if_worker

        config = engine_config(args)
        if follow_if_worker(config):
            return 0
    except ValueError as e:
        print(f"splash serve: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:  # WorkerError: a rank of this node failed
        print(f"splash serve: {str(e).splitlines()[0]}", file=sys.stderr)
        return 1
    sock = _bind(args.host, args.port)
    host, port = sock.getsockname()[:2]
    # a prefill's bootstrap server (prefill/decode disaggregation): a second socket of the same server,
    # on the API's host, bound before the model loads as the API's is
    boot = (_bind(args.host, config.disaggregation_bootstrap_port, "--disaggregation-bootstrap-port")
            if config.disaggregation_mode == "prefill" else None)
    sockets = [sock] if boot is None else [sock, boot]
    try:
        engine = build_engine(args)
    except (ValueError, FileNotFoundError, OSError) as e:
        for s in sockets:
            s.close()
        print(f"splash serve: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:  # a rank failed to start (WorkerError, DistError)
        for s in sockets:
            s.close()
        print(f"splash serve: {str(e).splitlines()[0]}", file=sys.stderr)
        return 1
    name = args.served_model_name or args.model
    url_host = f"[{host}]" if ":" in host else host

    def announce() -> None:
        print(f"splash: serving {name!r} on http://{url_host}:{port}/v1 (Ctrl-C to stop)", flush=True)

    app = create_app(engine, model_name=name, api_key=args.api_key, on_ready=announce,
                     launch={"host": host, "port": port, "dist_init_addr": args.dist_init_addr})
    # Everything built so far (the model, the tokenizer, the app) lives as long as the server, as
    # vLLM's engine does it: out of the collector's generations.
    asgi: Any = app
    if boot is not None:
        from splash.server.pd_rooms import PortDispatch, bootstrap_app

        asgi = PortDispatch(app, bootstrap_app(app.state.serving.pd, config.page_size),
                            boot.getsockname()[1])
    freeze_heap()

    uv_config = uvicorn.Config(asgi, log_level=args.log_level,
                               timeout_graceful_shutdown=args.graceful_timeout,
                               access_log=args.log_level in ("info", "debug"))
    server = uvicorn.Server(uv_config)
    # uvicorn re-raises the signal it caught once it has shut down; with these no-op handlers in place
    # the re-raise is absorbed and a requested shutdown exits 0.
    previous = {s: signal.signal(s, lambda *_: None) for s in (signal.SIGINT, signal.SIGTERM)}
    died = threading.Event()
    threading.Thread(target=_watch, args=(server, engine, died, args.graceful_timeout),
                     name="splash-watchdog", daemon=True).start()
    try:
        server.run(sockets=sockets)
    finally:
        for sig, h in previous.items():
            signal.signal(sig, h)
        for s in sockets:
            s.close()
    if died.is_set():
        print("splash: server stopped: the engine died (see the log above); restart it", file=sys.stderr,
              flush=True)
        return 1
    print("splash: server stopped", flush=True)
    return 0 if server.started else 1


def _watch(server: Any, engine: Any, died: threading.Event, grace_s: float, every_s: float = 0.1) -> None:
    """Two jobs while the server runs. As vLLM does: once the engine can never step again (its rank group
    failed), stop serving and exit non-zero, so a supervisor restarts the server instead of it answering
    503 for ever. And on a shutdown signal: give open requests most of `--graceful-timeout`, then end
    the rest with an error event and [DONE] (uvicorn would cancel them mid-response when it expires)."""
    while not server.should_exit:
        if server.started and not engine.is_healthy:  # (a dead engine is never healthy)
            logging.getLogger("splash.server").error("the engine died; stopping the server")
            died.set()
            server.should_exit = True
            return
        time.sleep(every_s)
    deadline = time.monotonic() + max(0.0, grace_s - 1.0)  # a second left for the error events to go out
    while engine.num_open_streams and time.monotonic() < deadline and not server.force_exit:
        time.sleep(every_s)
    if engine.num_open_streams:
        engine.end_open_streams(f"the server is shutting down (--graceful-timeout {grace_s:g} s passed)")
