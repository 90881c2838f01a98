"""pdkv: prefill/decode disaggregated KV transfer."""

__version__ = "0.1.0"
PROTOCOL_VERSION = 2
