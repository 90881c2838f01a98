"""The router: an OpenAI-compatible proxy that pairs prefill and decode workers.

``pdkv launch --role router --prefill URL ... --decode URL ...`` serves
``/v1/completions`` and ``/v1/chat/completions`` (streamed or not) by
prefilling on one worker with ``max_tokens=1`` and decoding on another
with the KV moved between them, and hands the client the decode worker's
answer as it comes.

* ``app``: the HTTP surface, admin endpoints, startup and shutdown;
* ``proxy``: one request's flow, retries and failure handling, through rooms of one
  job each: ``failover`` (which worker a hop tries next; what a failed try leaves),
  ``prefill_hop`` and ``decode_hop`` (the two hops; the decode hop relays the answer),
  ``upstream`` (every step awaited on a worker, and the checks of its answer),
  ``answers`` (the router's own error answers), ``abandoning`` (cancelling a transfer
  whose decode hop never ran) and ``call`` (the request they pass along);
* ``pool``: registered workers, health checks, the router's load on each;
* ``policy``: which worker (round-robin, least-loaded, prefix-aware);
* ``modes``: the ``kv_transfer_params`` of each hop, for pdkv's own workers and
  for vLLM pairs running vLLM's NixlConnector;
* ``metrics``: Prometheus.

* ``kv_aware``: the workers' KV event streams and the prefix index the
  prefix policy reads.

Nothing here imports torch or an engine: the router needs neither, except
the model's tokenizer when ``router.tokenizer`` is set (its module lives
with the engine, which imports torch).
"""
