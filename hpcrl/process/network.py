"""What a process needs from the node's network: a host name resolved to an address, and the interface
that routes to a peer.

Multi-node runs mostly fail at launch, and quietly: a node whose ``/etc/hosts`` maps its own name to
``127.0.1.1`` (Debian's default) advertises an address nobody else can reach; gloo and NCCL pick an
interface by the host name and end up on the loopback or a management network. The functions here make
those choices explicit, so the caller can log them and refuse a loopback address where a peer on
another node must reach it.

Linux only (``SIOCGIFADDR``); the interface is found from the kernel's own route choice (a UDP socket
``connect`` sends nothing) rather than by parsing ``ip route``.
"""
from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct

SIOCGIFADDR = 0x8915
"""ioctl: the IPv4 address of an interface."""


class NetworkError(RuntimeError):
    """A host that does not resolve, or an address no interface routes to; one line, naming both."""


def resolve(host: str) -> str:
    """The IPv4 address ``host`` resolves to here (``/etc/hosts``, DNS); NetworkError naming it if none."""
    try:
        infos = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        raise NetworkError(f"host {host!r} does not resolve to an IPv4 address on {socket.gethostname()} ({e})") from None
    return infos[0][4][0]


def is_loopback(address: str) -> bool:
    """Whether ``address`` is on 127.0.0.0/8 (reachable from this node only)."""
    return ipaddress.ip_address(address).is_loopback


def source_address(peer: str, port: int = 9) -> str:
    """The local address the kernel would send from to reach ``peer`` (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((peer, port))
        except OSError as e:
            raise NetworkError(f"no route from {socket.gethostname()} to {peer} ({e})") from None
        return s.getsockname()[0]


def interface_address(name: str) -> str | None:
    """The IPv4 address of interface ``name``; None if it has none."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def interface_to(peer: str) -> tuple[str, str]:
    """(interface name, local address) of the route to ``peer``; NetworkError if no interface holds the
    route's source address."""
    local = source_address(peer)
    for _, name in socket.if_nameindex():
        if interface_address(name) == local:
            return name, local
    raise NetworkError(f"the route to {peer} leaves from {local}, which no interface of {socket.gethostname()} holds")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (the OS's choice)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
