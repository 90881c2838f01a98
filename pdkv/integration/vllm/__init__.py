"""pdkv as a vLLM KV connector (``KVConnectorBase_V1``).

Load it with ``--kv-transfer-config '{"kv_connector": "PdkvConnector",
"kv_connector_module_path": "pdkv.integration.vllm.connector", ...}'`` or let
``pdkv launch --role prefill|decode --engine vllm`` write that for you.

Only ``connector`` imports vLLM; the rest (the scheduler-side bookkeeping,
the worker-side sender/receiver, the layout mapping, the transfer params, which
counters become which ``pdkv_*`` series) is plain pdkv, so it is tested on any
machine, with or without vLLM.
"""
