"""Where the cloud may send a request that someone other than the operator named: the address rules.

Two callers name such places. A tenant names a webhook receiver (``cloud.gateway.webhooks``): public addresses only,
unless the operator allows private networks. A console admin names the upstream servers of a registry version's serving
spec (``shared.backend_spec.ServingSpec``): checked against the operator's ``EgressPolicy``.

Shared rules (``numeric_host_problem``): a host that is a number the resolver reads as IPv4 (``2130706433``,
``0177.0.0.1``, ``0x7f.1``, ``127.1``, ``0``) but not in dotted-decimal form is refused, since this check and the
resolver could read it apart.

``EgressPolicy`` (serving specs) refuses, whatever else is allowed:

- link-local and cloud metadata addresses (``169.254.0.0/16``, ``fe80::/10``, ``100.100.100.200``,
  ``fd00:ec2::254``) and names (``metadata.google.internal``, ``metadata``, ``instance-data``...);
- the unspecified, multicast, broadcast and reserved ranges (``0.0.0.0/8``, ``::``, ``224.0.0.0/4``,
  ``240.0.0.0/4``, ``ff00::/8``);
- the cloud's own services: the host and port of the database URL and the Redis URL, the cloud's, the console's
  and the edge agent's configured listeners, and the listening sockets of the checking process itself (on Linux),
  on any address of this host when they listen on all of them;
- loopback (``127.0.0.0/8``, ``::1``, ``localhost``), unless the operator allows it (``allow_loopback``) or lists
  it in ``allow``.

An IPv4 address written inside IPv6 (``::ffff:127.0.0.1``, NAT64 ``64:ff9b::7f00:1``) is checked as that IPv4
address. When ``allow`` lists networks or host names, an address must be in one of them (or its host name be one
of them); otherwise every other address (RFC 1918 ones included: model servers in a cluster) is allowed. A host
name is checked by resolving it: every address it resolves to must pass (``resolve``), at submission and again at
every resolution by the gateway, which connects to those very addresses (DNS rebinding reaches nothing refused).
"""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final
from urllib.parse import urlsplit

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

# WHATWG URL: a host whose last label is a number is an IPv4 address, in whatever form the resolver reads.
_NUMERIC_LABEL = re.compile(r"(?:0[xX][0-9a-fA-F]*|[0-9]+)")
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")
METADATA_NETWORKS: Final = tuple(
    ipaddress.ip_network(n)
    for n in ("169.254.0.0/16", "fe80::/10", "100.100.100.200/32", "fd00:ec2::254/128", "fd00:ec2::/120")
)
METADATA_HOSTS: Final = frozenset(
    {
        "metadata",
        "metadata.google.internal",
        "metadata.goog",
        "instance-data",
        "instance-data.ec2.internal",
        "metadata.azure.internal",
        "metadata.tencentyun.com",
    }
)
NEVER_NETWORKS: Final = tuple(
    ipaddress.ip_network(n)
    for n in ("0.0.0.0/8", "::/128", "224.0.0.0/4", "240.0.0.0/4", "ff00::/8", "255.255.255.255/32")
)
DEFAULT_PORTS: Final = {
    "http": 80,
    "https": 443,
    "postgresql": 5432,
    "postgres": 5432,
    "mysql": 3306,
    "redis": 6379,
    "rediss": 6379,
}


def is_public_address(address: str) -> bool:
    """False for loopback, private, link-local (cloud metadata), multicast and reserved addresses."""
    try:
        return ipaddress.ip_address(address).is_global
    except ValueError:
        return False


def is_private_literal(host: str) -> bool:
    """Whether ``host`` names a non-public place without resolving anything: ``localhost`` or a literal address."""
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return not ipaddress.ip_address(host).is_global
    except ValueError:
        return False


def numeric_host_problem(host: str) -> str | None:
    """Why ``host`` may not name an address: a number the resolver reads as IPv4 (``2130706433``, ``0177.0.0.1``,
    ``0``, ``0x7f.1``) but not in dotted-decimal form, which this check and the resolver could read apart."""
    if ":" in host or not _NUMERIC_LABEL.fullmatch(host.rsplit(".", 1)[-1]):
        return None  # an IPv6 literal, or a name
    try:
        ipaddress.IPv4Address(host)
        return None
    except ValueError:
        pass
    try:
        read_as = socket.inet_ntoa(socket.inet_aton(host))
    except OSError:
        return f"host {host!r} is not a valid IPv4 address"
    return f"host {host!r} is an IPv4 address ({read_as}) not written as four decimal numbers"


def _plain(address: IPAddress) -> IPAddress:
    """An IPv4 address carried in IPv6 (mapped, NAT64) as that IPv4 address."""
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return address.ipv4_mapped
        if address in _NAT64:
            return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return address


def _host_of(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    host = (parts.hostname or "").removesuffix(".").lower()
    return host, parts.port or DEFAULT_PORTS.get(parts.scheme.split("+")[0], 0)


def _addresses(host: str, port: int) -> set[IPAddress]:
    """``host``'s addresses (itself when it is one); none when it does not resolve."""
    try:
        return {ipaddress.ip_address(host)}
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, port or None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return set()
    return {_plain(ipaddress.ip_address(str(info[4][0]).partition("%")[0])) for info in infos}


def _local_addresses() -> set[IPAddress]:
    """This host's addresses as far as its own name tells (loopback ones are loopback anyway)."""
    return _addresses(socket.gethostname(), 0)


def own_listeners() -> set[tuple[IPAddress, int]]:
    """The TCP sockets this process listens on (Linux ``/proc``; none elsewhere)."""
    try:
        inodes = set()
        for fd in Path("/proc/self/fd").iterdir():
            try:
                target = fd.readlink().name
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
        found: set[tuple[IPAddress, int]] = set()
        for table, width in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 16)):
            with open(table) as f:  # noqa: PTH123 (a /proc table, read line by line)
                next(f, None)
                for line in f:
                    cols = line.split()
                    if len(cols) < 10 or cols[3] != "0A" or cols[9] not in inodes:  # 0A: LISTEN
                        continue
                    hex_address, hex_port = cols[1].split(":")
                    raw = bytes.fromhex(hex_address)
                    # /proc writes each 32-bit word in host (little-endian) order
                    ordered = b"".join(raw[i : i + 4][::-1] for i in range(0, width, 4))
                    found.add((_plain(ipaddress.ip_address(ordered)), int(hex_port, 16)))
        return found
    except (OSError, ValueError):
        return set()


@dataclass(frozen=True, slots=True)
class EgressPolicy:
    """Which upstream addresses a registry serving spec may name (the operator's choice; see the module doc).

    ``own``: ``(host, port)`` of the cloud's own services (database, Redis, listeners), refused even where
    loopback is allowed; ``allow``: networks and host names, an allow-list when not empty.
    """

    allow_loopback: bool = False
    allow: tuple[str, ...] = ()
    own: tuple[tuple[str, int], ...] = ()
    check_own_sockets: bool = True
    _allow_networks: tuple[IPNetwork, ...] = field(init=False, default=())
    _allow_hosts: frozenset[str] = field(init=False, default=frozenset())

    def __post_init__(self) -> None:
        networks, hosts = [], set()
        for item in self.allow:
            try:
                networks.append(ipaddress.ip_network(item, strict=False))
            except ValueError:
                hosts.add(item.removesuffix(".").lower())
        object.__setattr__(self, "_allow_networks", tuple(networks))
        object.__setattr__(self, "_allow_hosts", frozenset(hosts))

    @staticmethod
    def parse_allow(value: str) -> tuple[str, ...]:
        """A comma-separated allow-list (``10.0.0.0/8, 127.0.0.1/32, model-server``), checked."""
        items = tuple(i.strip() for i in value.split(",") if i.strip())
        for item in items:
            try:
                ipaddress.ip_network(item, strict=False)
            except ValueError:
                if not re.fullmatch(r"[A-Za-z0-9]([A-Za-z0-9.-]{0,252})", item) or numeric_host_problem(item):
                    raise ValueError(f"{item!r} is neither a network (CIDR) nor a host name") from None
        return items

    def _own_endpoints(self) -> set[tuple[IPAddress, int]]:
        endpoints: set[tuple[IPAddress, int]] = set()
        for host, port in self.own:
            for address in _addresses(host, port):
                endpoints.add((address, port))
        if self.check_own_sockets:
            endpoints |= own_listeners()
        return endpoints

    def _own_problem(self, address: IPAddress, port: int, own: set[tuple[IPAddress, int]]) -> str | None:
        local: set[IPAddress] | None = None
        for listen_address, listen_port in own:
            if listen_port != port:
                continue
            if listen_address == address:
                return f"{address} port {port} is one of the cloud's own services (database, Redis or listener)"
            if listen_address.is_unspecified or listen_address.is_loopback:
                if local is None:
                    local = _local_addresses()
                if address.is_loopback or address.is_unspecified or address in local:
                    return f"{address} port {port} is one of the cloud's own services (database, Redis or listener)"
        return None

    def address_problem(
        self, address: IPAddress, port: int, *, host: str = "", own: set[tuple[IPAddress, int]] | None = None
    ) -> str | None:
        """Why ``address`` (reached on ``port``, named ``host``) is refused, None when it is not."""
        address = _plain(address)
        if any(address in n for n in METADATA_NETWORKS):
            return f"{address} is a link-local or cloud metadata address"
        if any(address in n for n in NEVER_NETWORKS) or address.is_unspecified or address.is_multicast:
            return f"{address} is an unspecified, multicast or reserved address"
        problem = self._own_problem(address, port, self._own_endpoints() if own is None else own)
        if problem is not None:
            return problem
        listed = any(address in n for n in self._allow_networks) or bool(host and host in self._allow_hosts)
        if address.is_loopback and not (self.allow_loopback or listed):
            return (
                f"{address} is a loopback address (the operator allows loopback with "
                "TIERLINE_CLOUD_UPSTREAM_ALLOW_LOOPBACK=true or TIERLINE_CLOUD_UPSTREAM_ALLOW)"
            )
        if self.allow and not listed and not (address.is_loopback and self.allow_loopback):
            return f"{address} is not in the operator's allow-list (TIERLINE_CLOUD_UPSTREAM_ALLOW)"
        return None

    def host_problem(self, url: str) -> str | None:
        """What is wrong with ``url``'s host as written (no resolving): a metadata name, a number the resolver
        reads apart, a loopback name, a refused literal address; None when nothing is, yet."""
        try:
            parts = urlsplit(url)
            _ = parts.port
        except ValueError as exc:
            return f"not a valid URL ({exc})"
        host, port = _host_of(url)
        if not host:
            return "it has no host"
        if parts.username is not None or parts.password is not None:
            return "it must not carry credentials"
        if "%" in host and ":" not in host:
            return f"host {host!r} must not be percent-encoded"
        if (problem := numeric_host_problem(host)) is not None:
            return problem
        if host in METADATA_HOSTS:
            return f"{host} is a cloud metadata host"
        is_loopback_name = host == "localhost" or host.endswith(".localhost")
        if is_loopback_name and not (self.allow_loopback or host in self._allow_hosts):
            return self.address_problem(ipaddress.IPv4Address("127.0.0.1"), port, host=host)
        try:
            return self.address_problem(ipaddress.ip_address(host), port, host=host)
        except ValueError:
            return None

    def resolve(self, url: str) -> tuple[list[IPAddress], str | None]:
        """``url``'s host checked as written, then resolved (blocking) and every address checked: the addresses
        (empty when it does not resolve now) and, when any is refused, why (then no address)."""
        problem = self.host_problem(url)
        if problem is not None:
            return [], problem
        host, port = _host_of(url)
        addresses = sorted(_addresses(host, port), key=lambda a: (a.version, int(a)))
        own = self._own_endpoints()
        for address in addresses:
            problem = self.address_problem(address, port, host=host, own=own)
            if problem is not None:
                return [], problem if str(address) == host else f"{host} resolves to {address}: {problem}"
        return addresses, None


def egress_endpoints(urls: Iterable[str]) -> tuple[tuple[str, int], ...]:
    """``(host, port)`` of each URL that names one (a database or Redis URL; SQLite's names none)."""
    found = []
    for url in urls:
        try:
            host, port = _host_of(url)
        except ValueError:
            continue
        if host and port:
            found.append((host, port))
    return tuple(found)
