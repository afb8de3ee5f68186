"""What the guard enforces (:class:`GuardConfig`), read from the server's environment, and which hosts a rendezvous
may name."""

from __future__ import annotations

import ipaddress
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

__all__ = [
    "DEFAULT_MAX_RPC_TIMEOUT",
    "HOSTS_ENV",
    "MIN_TOKEN_LENGTH",
    "NEW_TOKEN",
    "NO_TOKEN_ENV",
    "TIMEOUT_ENV",
    "TOKEN_ENV",
    "GuardConfig",
    "split_hosts",
]

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

TOKEN_ENV = "HOTWEIGHTS_TOKEN"
NO_TOKEN_ENV = "HOTWEIGHTS_NO_TOKEN"
HOSTS_ENV = "HOTWEIGHTS_COMMUNICATOR_HOSTS"
TIMEOUT_ENV = "HOTWEIGHTS_MAX_RPC_TIMEOUT"
#: Seconds a ``/collective_rpc`` call may ask the workers to take, by default.
DEFAULT_MAX_RPC_TIMEOUT = 600.0
#: Shortest token accepted.
MIN_TOKEN_LENGTH = 16
#: The command a message suggests to make a token.
NEW_TOKEN = "python -c 'import secrets; print(secrets.token_urlsafe(32))'"


@dataclass(frozen=True)
class GuardConfig:
    """What :class:`HotWeightsGuard` enforces.

    Args:
        token: the token every request must carry; None serves without one (the explicit opt-out).
        communicator_hosts: addresses, networks or host names a rendezvous may name besides the caller's own
            address and loopback.
        max_rpc_timeout: seconds a worker call (and a rendezvous) may be given at most.
    """

    token: str | None
    communicator_hosts: tuple[str, ...] = ()
    max_rpc_timeout: float = DEFAULT_MAX_RPC_TIMEOUT
    _networks: tuple[IPNetwork, ...] = field(init=False, repr=False, compare=False)
    _names: frozenset[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.token is not None and len(self.token) < MIN_TOKEN_LENGTH:
            raise ValueError(
                f"the hotweights token is {len(self.token)} characters long; use {MIN_TOKEN_LENGTH} at least, e.g. "
                f"export {TOKEN_ENV}=$({NEW_TOKEN})"
            )
        if self.token is not None and not all("!" <= c <= "~" for c in self.token):
            raise ValueError("the hotweights token must be printable ASCII without spaces (it travels in a header)")
        timeout = self.max_rpc_timeout
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not 0 < timeout < math.inf:
            raise ValueError(f"the largest RPC timeout must be a positive number of seconds, not {timeout!r}")
        networks: list[IPNetwork] = []
        names: set[str] = set()
        for entry in self.communicator_hosts:
            try:
                networks.append(_mapped_network(ipaddress.ip_network(entry, strict=False)))
            except ValueError:
                if not entry or any(c.isspace() or c in "/,[]" for c in entry):
                    raise ValueError(
                        f"{entry!r} in the communicator hosts is no address, network or host name"
                    ) from None
                names.add(entry.lower())
        object.__setattr__(self, "_networks", tuple(networks))
        object.__setattr__(self, "_names", frozenset(names))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> GuardConfig:
        """Read ``HOTWEIGHTS_TOKEN``, ``HOTWEIGHTS_NO_TOKEN``, ``HOTWEIGHTS_COMMUNICATOR_HOSTS`` and
        ``HOTWEIGHTS_MAX_RPC_TIMEOUT``.

        Raises:
            ValueError: no token and no opt-out (or both), or a value that does not parse; the message says what
                to set.
        """
        env = os.environ if environ is None else environ
        token = env.get(TOKEN_ENV, "").strip() or None
        no_token = env.get(NO_TOKEN_ENV, "").strip().lower() in ("1", "true", "yes")
        if token is None and not no_token:
            raise ValueError(
                f"no hotweights token: set {TOKEN_ENV} in the server's environment (e.g. export "
                f"{TOKEN_ENV}=$({NEW_TOKEN})), or {NO_TOKEN_ENV}=1 to serve without one"
            )
        if token is not None and no_token:
            raise ValueError(f"both {TOKEN_ENV} and {NO_TOKEN_ENV}=1 are set: unset one")
        raw = env.get(TIMEOUT_ENV, "").strip()
        try:
            timeout = float(raw) if raw else DEFAULT_MAX_RPC_TIMEOUT
        except ValueError:
            raise ValueError(f"{TIMEOUT_ENV}={raw!r} is not a number of seconds") from None
        return cls(token, split_hosts(env.get(HOSTS_ENV, "")), timeout)

    def host_allowed(self, host: object, caller: str | None) -> bool:
        """True if a rendezvous may name ``host``: loopback, the caller's own address, or an allowed one."""
        if not isinstance(host, str):
            return False
        if host.lower() == "localhost":
            return True
        address = _address(host.removeprefix("[").removesuffix("]") if host.startswith("[") else host)
        if address is None:
            return host.lower() in self._names
        return (
            address.is_loopback
            or (caller is not None and address == _address(caller))
            or any(address in network for network in self._networks)
        )


def split_hosts(value: str | Iterable[str]) -> tuple[str, ...]:
    """``"a, b"`` (or an iterable of such strings) as ``("a", "b")``."""
    parts = [value] if isinstance(value, str) else list(value)
    return tuple(h.strip() for part in parts for h in part.split(",") if h.strip())


def _address(text: str) -> IPAddress | None:
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def _mapped_network(network: IPNetwork) -> IPNetwork:
    """An IPv4-mapped IPv6 network as its IPv4 network (addresses are compared in that form)."""
    mapped = network.network_address.ipv4_mapped if isinstance(network, ipaddress.IPv6Network) else None
    if mapped is None or network.prefixlen < 96:
        return network
    return ipaddress.IPv4Network((mapped, network.prefixlen - 96))
