"""Prefill and decode workers: an engine loop, the transfer wiring, and the OpenAI HTTP API."""
