"""KV cache events in vLLM's format, both ways.

* ``wire``: vLLM's ``KVEventBatch``/``BlockStored``/``BlockRemoved``/``AllBlocksCleared``, byte for byte;
* ``publisher``: the ZMQ PUB socket with sequence numbers and the replay socket (vLLM's protocol);
* ``subscriber``: following one stream in order, healing gaps, losses and restarts;
* ``index``: what each worker (and the shared tier) holds, and a prompt's longest cached prefix on each.

A worker's tier becomes events in ``pdkv.worker.kv_events``; the router reads them in ``pdkv.router.kv_aware``.
"""
