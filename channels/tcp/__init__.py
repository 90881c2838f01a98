"""The tcp channel: one-sided WRITE and READ over plain sockets, bytes landing in place.

Many clusters have no RDMA, and the general stacks lose much of what plain TCP
can do to intermediate buffers and per-message overhead. This channel keeps
the raw-socket cost model: a frame is a fixed 40-byte header followed by its
payload; the sender hands header and payload views to one ``sendmsg`` (no
join, no copy) and the receiver ``recv_into``s the payload straight into the
registered region. One kernel copy on each side, as between two programs
using ``sendall``/``recv_into``.

The package: ``wire`` (the frame format and its checks), ``conn`` (one
connection, either side's), ``options``, ``link`` and ``initiator`` (the side
that calls write/read), ``target`` (the side bytes land in) and ``channel``
(``TcpChannel``, the ``Channel`` contract tying the two sides together).

The initiator (the side calling write/read) opens a *link* of ``streams`` connections to each peer, all with one random
session id so the target can group them. A transfer is cut into shares, one
per stream, each sent as one uninterrupted batch of DATA frames ending in
LAST. TCP is in order and the stream's reader lands each payload before
reading on, so once the LAST frame of every share has been read, every byte of
the transfer is in the region: only then is the notification delivered and
the transfer acknowledged. The initiator's handle is DONE on ACK, so DONE
means the bytes are in the target's memory and the source may be reused (NIXL
semantics). ACKs that pile up while more frames are already waiting go out
together in one frame when the socket runs dry, so pipelined small transfers
cost one ACK per batch, not per transfer. READ: the target answers each
READ_REQ in order on the same stream; the initiator lands the answer where it
recorded for that request (the target never picks an address), and sends
NOTIF once the whole transfer landed.

Capabilities. A region the target ``guard``s takes a frame only within what
it granted (``Grants``) to the token the initiator presented in HELLO, which
a ``KVReceiver`` learns from the sender's Hello and grants exactly the blocks
of that sender's reservations. A DATA frame outside its grants lands nothing:
the target reads its payload into a scratch buffer and answers the transfer
with NACK instead of ACK (no notification is delivered); a READ_REQ outside
them is answered with NACK instead of READ_DATA. Only that transfer fails: the
link and the peer's other transfers go on. A frame is marked landing while its
bytes go into the region, so ``revoke`` can wait it out before the blocks are
reused (the fence against late writes).

With a shared secret (``options.secret``, the worker's top-level ``secret``)
every connection proves it before the target reads a single frame of it into
a region, once per connection and never per frame: each side sends a fresh
nonce (``pdkv.auth``), the target proves the secret over both in HELLO_OK and
the initiator answers with its own proof in AUTH. The initiator checks the
target's proof first, so it never sends KV to an agent without the secret; the
target reads nothing but AUTH until the proof checks out, and only then adds
the connection to its session, so a failed one hangs up no other. A HELLO
without SECRET to a target with a secret (or the reverse), a wrong proof, any
other frame where AUTH is due, or a peer that leaves before proving it is
refused with ERROR, logged and counted (``stats()["auth_failures"]``).
Without a secret the handshake is HELLO and HELLO_OK alone, as before.

With ``tls`` options (``tls``: cert, key, CA) every connection is mutual TLS
1.3 before HELLO (``tls`` module; ``Conn.start_tls``): both sides present a
certificate the other's CA signed, and everything after, the handshake above
included, is encrypted. A peer that starts in clear is told in clear that
TLS is required; one with another CA's certificate fails the TLS handshake;
both errors name TLS and count as ``auth_failures`` on the target
(``tls_failures`` on the initiator). Without it nothing changes.
"""

from pdkv.channels.tcp.channel import TcpChannel
from pdkv.channels.tcp.options import TcpOptions

__all__ = ["TcpChannel", "TcpOptions"]
