"""The UCX channel: UCX through ucxx (the ``ucx`` extra, ``ucxx-cu12``), host memory.

ucxx has no RMA, so one-sided WRITE and READ are tag messages that land directly in the registered regions; how,
and how progress is made: channels/README.md, "ucx".

Its rooms: ``lib`` the library, imported once UCX's environment is set; ``wire`` the messages and their tags;
``initiator`` the transfers this side starts; ``target`` the side that serves those peers start; ``channel`` the
facade, ``UcxChannel``, with the worker, the peers and the service thread.
"""

from __future__ import annotations

from pdkv.channels.ucx.channel import UcxChannel, UcxOptions
from pdkv.channels.ucx.lib import UCX_CHANNEL_ENV_DEFAULTS, UCX_ERRORS, Array, ucx_api
from pdkv.channels.ucx.wire import ACK, ACK_BYTES, ACK_ERROR_CHARS, DATA, HEADER, KIND_MASK, METADATA_VERSION, tag

__all__ = [
    "ACK",
    "ACK_BYTES",
    "ACK_ERROR_CHARS",
    "DATA",
    "HEADER",
    "KIND_MASK",
    "METADATA_VERSION",
    "UCX_CHANNEL_ENV_DEFAULTS",
    "UCX_ERRORS",
    "Array",
    "UcxChannel",
    "UcxOptions",
    "ucx_api",
    "tag",
]
