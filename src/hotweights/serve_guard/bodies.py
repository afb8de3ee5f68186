"""What the guard reads of a request body: a ``/collective_rpc`` or ``/init_weight_transfer_engine`` call checked
(and maybe rewritten, a timeout capped) by :func:`check_body`, and a family probe's body."""

from __future__ import annotations

import json
import math
from typing import Any

from hotweights.serve_guard.asgi import Refusal
from hotweights.serve_guard.config import HOSTS_ENV, GuardConfig

__all__ = [
    "COLLECTIVE_RPC",
    "ENGINE_OP",
    "INIT_INFO_HOSTS",
    "INIT_TRANSFER",
    "RENDEZVOUS",
    "RPC_METHODS",
    "TRANSFER_INIT",
    "check_body",
    "engine_facts",
    "probe_ids",
    "probe_label",
]

COLLECTIVE_RPC = "/collective_rpc"
INIT_TRANSFER = "/init_weight_transfer_engine"
ENGINE_OP = "hotweights_engine"
#: The ``hotweights_engine`` operation that makes the workers connect to a host (the collective rendezvous).
RENDEZVOUS = "join_group"
TRANSFER_INIT = "init_weight_transfer_engine"
#: The worker methods ``/collective_rpc`` runs for a caller: hotweights' session and engine operations, and the vLLM
#: calls an install makes (its weight-transfer API, and ``reload_weights`` of a checkpoint hotweights wrote). Any
#: other method is 403: the token opens installs, not every method of the workers.
RPC_METHODS = frozenset(
    {
        "hotweights_begin",
        "hotweights_stage",
        "hotweights_prepare",
        "hotweights_commit",
        "hotweights_abort",
        ENGINE_OP,
        TRANSFER_INIT,
        "shutdown_weight_transfer_engine",
        "start_weight_update",
        "update_weights",
        "finish_weight_update",
        "reload_weights",
    }
)
#: Keys of an ``init_info`` that name the host a worker connects to (hotweights' backend; vLLM's NCCL backend).
INIT_INFO_HOSTS = ("host", "master_address")


def probe_ids(body: bytes, vocab: int) -> list[int]:
    """The token ids of a probe body, checked: 2 to ``MAX_PROBE_TOKENS`` ids, each in ``[0, vocab)`` (else 400)."""
    from hotweights.vllm.scoring import MAX_PROBE_TOKENS

    try:
        ids = json.loads(body or b"{}").get("token_ids")
    except (ValueError, AttributeError):
        ids = None
    if (
        not isinstance(ids, list)
        or not 2 <= len(ids) <= MAX_PROBE_TOKENS
        or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab for i in ids)
    ):
        raise Refusal(400, f"hotweights guard: a probe is {{'token_ids': [2 to {MAX_PROBE_TOKENS} ids < {vocab}]}}")
    return ids


def probe_label(body: bytes) -> str | None:
    """The version label of a probe body (what requests in flight carry while it runs), at most 64 characters."""
    label = json.loads(body or b"{}").get("label")
    if label is not None and (not isinstance(label, str) or len(label) > 64):
        raise Refusal(400, "hotweights guard: a probe's label is a string of at most 64 characters")
    return label


def engine_facts(engine: Any) -> dict[str, Any]:
    """What the trainer needs to build the family probe's reference for ``engine`` (an ``AsyncLLM``)."""
    from hotweights.vllm import compat

    config = engine.model_config.hf_config
    names = getattr(config, "architectures", None) or [None]
    return {
        "family": [names[0], compat.vllm_version(), compat.device_kind()],
        "config": config.to_json_string(use_diff=False),
        "dtype": str(engine.model_config.dtype).removeprefix("torch."),
    }


def check_body(path: str, body: bytes, caller: str | None, config: GuardConfig) -> bytes | None:
    """Check a ``/collective_rpc`` or ``/init_weight_transfer_engine`` body from ``caller``.

    Returns:
        None to pass ``body`` on as it is, or the re-encoded body (a timeout capped).

    Raises:
        Refusal: 400 for a body that is not a JSON object or a timeout that is not a number of seconds, 403 for a
            rendezvous host that is not allowed, a worker method an install does not call (:data:`RPC_METHODS`), or
            a ``reload_weights`` of anything but a hotweights checkpoint in shared memory.
    """
    try:
        request = json.loads(body)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise Refusal(400, f"hotweights guard: the {path} body is not JSON ({exc})") from None
    if not isinstance(request, dict):
        raise Refusal(400, f"hotweights guard: the {path} body must be a JSON object")
    if path == INIT_TRANSFER:
        info = request.get("init_info")
        changed = isinstance(info, dict) and _check_init_info(info, caller, config, path)
        return json.dumps(request).encode() if changed else None
    method = request.get("method")
    args, kwargs = request.get("args", []), request.get("kwargs", {})
    if not isinstance(method, str):
        raise Refusal(400, f"hotweights guard: 'method' must be a string, not {method!r}")
    if method not in RPC_METHODS:
        raise Refusal(
            403,
            f"hotweights guard: /collective_rpc runs only the methods an install needs "
            f"({', '.join(sorted(RPC_METHODS))}), not {method[:80]!r}",
        )
    if not isinstance(args, list) or not isinstance(kwargs, dict):
        raise Refusal(400, "hotweights guard: 'args' must be a JSON list and 'kwargs' a JSON object")
    timeout = request.get("timeout")
    capped = _cap(timeout, "the call's 'timeout'", config)
    changed = capped is not timeout or "timeout" not in request
    request["timeout"] = capped
    if method == ENGINE_OP:
        op = args[0] if args else kwargs.get("op")
        if op == RENDEZVOUS:
            raw = args[1] if len(args) > 1 else kwargs.get("args_json", "{}")
            try:
                join = json.loads(raw) if isinstance(raw, str) else None
            except (ValueError, RecursionError):
                join = None
            if not isinstance(join, dict):
                raise Refusal(400, f"hotweights guard: the arguments of {op!r} must be a JSON object")
            _check_host(join.get("host"), caller, config, op)
            if "timeout" in join:
                capped = _cap(join["timeout"], "the rendezvous' timeout", config)
                if capped is not join["timeout"]:
                    join["timeout"] = capped
                    changed = True
                    if len(args) > 1:
                        args[1] = json.dumps(join)
                    else:
                        kwargs["args_json"] = json.dumps(join)
    elif method == "reload_weights":
        _check_reload(args, kwargs)
    elif method == TRANSFER_INIT:
        info = args[0] if args else kwargs.get("init_info")
        if not isinstance(info, dict):
            raise Refusal(400, f"hotweights guard: {method}'s init_info must be a JSON object")
        changed |= _check_init_info(info, caller, config, method)
    return json.dumps(request).encode() if changed else None


def _check_reload(args: list[Any], kwargs: dict[str, Any]) -> None:
    """``reload_weights`` only of a checkpoint directory hotweights wrote in this host's shared memory (what the
    weights-path install sends), never of another path or another weights iterator."""
    import os.path

    path = kwargs.get("weights_path")
    other = set(kwargs) - {"weights_path", "is_checkpoint_format"}
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else os.environ.get("TMPDIR", "/tmp")
    real = os.path.realpath(path) if isinstance(path, str) else ""
    if (
        args
        or other
        or os.path.dirname(real) != os.path.realpath(shm)
        or not os.path.basename(real).startswith("hotweights-")
    ):
        raise Refusal(
            403,
            "hotweights guard: reload_weights runs only on a hotweights checkpoint directory in the server's shared "
            f"memory ({shm}/hotweights-*), given as weights_path",
        )


def _check_init_info(info: dict[str, Any], caller: str | None, config: GuardConfig, what: str) -> bool:
    """Check the hosts an ``init_info`` names; cap its timeout. True if it was changed."""
    for key in INIT_INFO_HOSTS:
        if info.get(key) is not None:
            _check_host(info[key], caller, config, what)
    if info.get("timeout") is None:
        return False
    capped = _cap(info["timeout"], "the rendezvous' timeout", config)
    changed = capped is not info["timeout"]
    info["timeout"] = capped
    return changed


def _check_host(host: object, caller: str | None, config: GuardConfig, what: str) -> None:
    if config.host_allowed(host, caller):
        return
    own = f"your own address as this server sees it ({caller}) or loopback" if caller else "loopback"
    raise Refusal(
        403,
        f"hotweights guard: {what} may name {own} as the host to connect to, not {host!r}. Build the "
        "transport with that address (make_transport('collective', host=...)), or start the server with "
        f"--communicator-hosts {host if isinstance(host, str) else 'ADDR'} (or {HOSTS_ENV}) to allow it",
    )


def _cap(value: object, what: str, config: GuardConfig) -> Any:
    """``value`` if at most the cap (None: the cap); else the cap. Refuses what is not a number of seconds."""
    cap = config.max_rpc_timeout
    if value is None:
        return cap
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < math.inf:
        raise Refusal(400, f"hotweights guard: {what} must be a number of seconds (0 to {cap:g}), not {value!r}")
    return value if value <= cap else cap
