"""pdkv inside other engines: each subpackage adapts one engine's KV interface to pdkv's data path."""
