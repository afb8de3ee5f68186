"""Start and stop a real ``vllm serve`` process on loopback for the remote tests."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx

from hotweights.serve import server_command

#: CPU-sized engine settings (see /work/shared/VLLM_NOTES.md): fp32, no tokenizer, small KV cache, prefix caching.
CPU_FLAGS = [
    "--dtype", "float32", "--skip-tokenizer-init", "--enforce-eager", "--max-model-len", "512",
    "--kv-cache-memory-bytes", str(64 << 20), "--block-size", "32", "--enable-prefix-caching",
    "--max-num-seqs", "4", "--seed", "0",
]  # fmt: skip
START_TIMEOUT = 240.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    """One server process (its own process group, so that stopping it takes vLLM's engine core too)."""

    proc: subprocess.Popen[bytes]
    url: str
    model: str
    log: Path

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)

    def client(self, timeout: float = 60.0) -> httpx.Client:
        """An HTTP client for this server (over its Unix socket for a ``unix://`` URL)."""
        if self.url.startswith("unix://"):
            uds = httpx.HTTPTransport(uds=self.url.removeprefix("unix://"))
            return httpx.Client(base_url="http://localhost", transport=uds, trust_env=False, timeout=timeout)
        return httpx.Client(base_url=self.url, trust_env=False, timeout=timeout)

    def generate(self, prompt: list[int], max_tokens: int = 8) -> dict[str, Any]:
        """vLLM's token-in/token-out route (``--enable-scale-out``): its JSON answer, weight versions included."""
        body = {"token_ids": prompt, "sampling_params": {"temperature": 0.0, "max_tokens": max_tokens,
                                                         "ignore_eos": True}}  # fmt: skip
        with self.client() as client:
            answer = client.post("/inference/v1/generate", json=body)
            answer.raise_for_status()
            result: dict[str, Any] = answer.json()
            return result

    def completions(self, prompts: list[list[int]], max_tokens: int = 8) -> list[list[int]]:
        """Greedy token ids for each prompt, through ``/v1/completions``."""
        out = []
        with self.client() as client:
            for prompt in prompts:
                body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                        "ignore_eos": True, "return_token_ids": True}  # fmt: skip
                answer = client.post("/v1/completions", json=body)
                answer.raise_for_status()
                out.append(list(answer.json()["choices"][0]["token_ids"]))
        return out


S = TypeVar("S", bound=Server)


def start_server(
    model: Path, log: Path, setup: str = "extension", uds: Path | None = None, extra: Sequence[str] = ()
) -> Server:
    """Start a server on an ephemeral loopback port (or the Unix socket ``uds``) and wait until it serves
    ``/v1/models``; ``extra``: more of vLLM's server flags."""
    port = free_port()
    flags = [*CPU_FLAGS, *extra]
    cmd = server_command(str(model), port=port, uds=str(uds) if uds else None, setup=setup, extra=flags)
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    env.pop("VLLM_ALLOW_INSECURE_SERIALIZATION", None)
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    server = Server(proc, f"unix://{uds}" if uds else f"http://127.0.0.1:{port}", str(model), log)
    return serving(server, "vllm serve")


def serving(server: S, what: str) -> S:
    """``server`` once it serves ``/v1/models`` (through its own :meth:`Server.client`); killed if it never does."""
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if not server.alive():
            raise RuntimeError(f"{what} exited with {server.proc.returncode}:\n{server.log.read_text()[-3000:]}")
        with contextlib.suppress(httpx.HTTPError), server.client(timeout=2.0) as client:
            if client.get("/v1/models").is_success:
                return server
        time.sleep(0.5)
    server.kill()
    raise RuntimeError(f"{what} did not come up within {START_TIMEOUT} s:\n{server.log.read_text()[-3000:]}")
