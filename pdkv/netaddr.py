"""What a listening address means: loopback, every address, or one interface's.

A worker's ``--host`` decides where each of its planes listens and what it
tells peers to dial. Loopback only reaches this machine; a wildcard
(``0.0.0.0``, ``::``) listens everywhere but is no address a peer can dial;
any other address belongs to one network interface, which is what UCX wants
to be told (``UCX_NET_DEVICES`` takes interface names, not addresses).
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct

WILDCARDS = frozenset({"0.0.0.0", "::", ""})
_SIOCGIFADDR = 0x8915  # Linux: an interface's (primary) IPv4 address


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and every loopback address (127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def is_wildcard(host: str) -> bool:
    """True for an address that means "listen on every interface"."""
    return host in WILDCARDS


def interface_of(host: str) -> str | None:
    """The name of the network interface whose IPv4 address is ``host``, or None.

    Reads each interface's primary IPv4 address (``SIOCGIFADDR``), so a
    secondary address or an IPv6 one is not found: the caller then asks the
    user to name the interface. Linux only, like the rest of the network code.
    """
    try:
        packed = socket.inet_aton(host)
    except OSError:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            try:
                answer = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address on this interface
                continue
            if answer[20:24] == packed:
                return name
    return None


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` right now (the kernel's pick); another process may take it before the caller binds."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def zmq_address(host: str, port: int | str) -> str:
    """A ZeroMQ tcp endpoint; an IPv6 literal goes in brackets (``tcp://[::1]:5555``), as ZeroMQ wants it."""
    return f"tcp://[{host}]:{port}" if ":" in host and not host.startswith("[") else f"tcp://{host}:{port}"
