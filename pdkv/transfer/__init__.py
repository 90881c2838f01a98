"""The transfer path: a request's KV from the prefill worker's blocks to the decode worker's (see README.md here)."""
