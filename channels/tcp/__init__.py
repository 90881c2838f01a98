"""The tcp channel: one-sided WRITE and READ over plain sockets, bytes landing in place.

One kernel copy on each side, as between two programs using ``sendall``/``recv_into``; capabilities checked per
frame, a shared secret proven per connection, opt-in mutual TLS. The design and the frame format: channels/README.md,
"tcp".
"""

from pdkv.channels.tcp.channel import TcpChannel
from pdkv.channels.tcp.options import TcpOptions

__all__ = ["TcpChannel", "TcpOptions"]
