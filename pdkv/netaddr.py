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

from pdkv.errors import PdkvError

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


class HeldPort:
    """A free port kept bound, so that no other process gets it, until the process it was given to has bound it.

    ``free_port`` forgets its port at once: until the child it is passed to
    binds it, another process's ``bind(host, 0)`` may be handed the same one.
    vLLM binds its HTTP socket with ``SO_REUSEADDR`` long before it listens
    (its engine starts in between); a second server given the same port binds
    it too, listens first, and vLLM's listen then fails without a word: vLLM
    lives on, unreachable, and its ``/health`` is answered by the other server
    (seen in CI: a vLLM never healthy in 15 minutes). A held port is bound here
    with ``SO_REUSEADDR`` and never listened on: the kernel gives it to no
    ``bind(0)`` and no outgoing connection, while a child that binds it with
    ``SO_REUSEADDR`` (vLLM's HTTP socket, every ZeroMQ listener) still can.
    Release it once the child serves.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        """Hold a port the kernel picks, or ``port`` if no socket at all is bound to it (``OSError`` if one is)."""
        self._sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        try:
            if not port:
                self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            # A chosen port is bound exclusively first: another launcher's hold (SO_REUSEADDR, not listening) would
            # let a SO_REUSEADDR bind through. Then reuse is allowed, for the child's bind.
            self._sock.bind((host, port))
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        except OSError:
            self._sock.close()
            raise
        self.port = int(self._sock.getsockname()[1])

    @classmethod
    def run(cls, host: str, count: int, attempts: int = 50) -> list[HeldPort]:
        """``count`` consecutive ports held: where a vLLM instance's tensor-parallel ranks listen (rank ``r`` on
        the first plus ``r``, as vLLM's own side channels do). ``PdkvError`` when ``attempts`` picks found none."""
        for _ in range(attempts):
            held = [cls(host)]
            try:
                held += [cls(host, held[0].port + i) for i in range(1, count)]
                return held
            except (OSError, OverflowError):
                for hold in held:
                    hold.release()
        raise PdkvError(f"found no {count} consecutive free ports on {host} in {attempts} tries")

    def release(self) -> None:
        self._sock.close()

    def __enter__(self) -> HeldPort:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def zmq_address(host: str, port: int | str | None = None) -> str:
    """A ZeroMQ tcp endpoint; an IPv6 literal goes in brackets (``tcp://[::1]:5555``), as ZeroMQ wants it (a socket
    bound or connected to one needs ``zmq.IPV6`` set: ``zmq_ipv6``). No ``port``: the host alone, for
    ``bind_to_random_port``."""
    where = f"[{host}]" if ":" in host and not host.startswith("[") else host
    return f"tcp://{where}" if port is None else f"tcp://{where}:{port}"


def zmq_ipv6(address: str) -> bool:
    """Whether a ZeroMQ tcp endpoint names an IPv6 literal (its socket must set ``zmq.IPV6``)."""
    return address.startswith("tcp://[")


def host_key(host: str) -> str:
    """``host`` as addresses compare: an IP address in its canonical form (``::1`` for ``0:0::1``), brackets of an
    IPv6 literal dropped; a name lowercased (names are compared as written, never resolved)."""
    bare = host.strip("[]")
    try:
        return str(ipaddress.ip_address(bare))
    except ValueError:
        return bare.lower()


def receiver_entry(entry: str) -> tuple[str, int | None]:
    """An ``allowed_receivers`` entry, ``host`` or ``host:port`` (an IPv6 literal with a port in brackets,
    ``[::1]:5555``), as ``(host_key(host), port or None)``; ``ValueError`` saying what is wrong."""
    host, port = entry, None
    if entry.startswith("["):
        close = entry.find("]")
        host, rest = entry[: close + 1], entry[close + 1 :]
        if close < 0 or (rest and not rest.startswith(":")):
            raise ValueError(f"{entry!r} is not host, host:port or [IPv6]:port")
        port = rest[1:] if rest else None
    elif entry.count(":") == 1:  # more than one: a bare IPv6 literal, no port
        host, port = entry.split(":")
    if not host.strip("[]") or any(c.isspace() or c in "/@" for c in host):
        raise ValueError(f"{entry!r} names no host")
    if port is not None and not (port.isascii() and port.isdigit() and 1 <= int(port) <= 65535):
        raise ValueError(f"{entry!r}: the port must be a number from 1 to 65535")
    return host_key(host), None if port is None else int(port)
