"""Soak: many requests through the router while faults are injected; nothing may hang or leak.

Starts real processes exactly as a user does (``pdkv launch``): one prefill
worker, two decode workers and the router, on a tiny random model over the tcp
channel with short leases and timeouts and a shared secret (so every control
and data connection authenticates, restarts included). The second decode
worker's channel sits behind a ``CorruptingProxy``: it advertises the proxy's
port (``advertise_port``), so the prefill worker's chunks reach it through the
proxy, which forwards every byte unchanged until told to flip one. It first
computes every prompt's fault-free answer (greedy, ``ignore_eos``, fixed
``max_tokens``) on a decode worker alone, then sends ``--requests`` requests
through the router from a small thread pool while a fault thread:

* corrupts a chunk in flight: the proxy flips one byte in the payload of the
  next DATA frame to the second decode worker, which must fail the chunk's
  checksum (``checksum_failures`` on its /metrics goes up) and compute the
  prompt itself (``pdkv_fallbacks_total`` goes up); the block's requests from
  the fault's trigger on wait until the proxy is armed, so one of them carries
  that frame (``traffic.TrafficGate``);
* SIGKILLs a decode worker, restarts it and registers the new one through the
  router's admin API (``DELETE``/``POST /pdkv/workers``);
* stalls the prefill worker (SIGSTOP, then SIGCONT a couple of seconds later);
* and some clients drop their connection mid-stream.

Every request ends as one of: ``recovered`` (output identical to the
fault-free run), ``failed_cleanly`` (an HTTP error or an error event),
``dropped`` (the client hung up on purpose), ``mismatched`` (a 200 with other
tokens: must be 0) or ``hung`` (no answer within its timeout: must be 0).
Afterwards every live worker's reservations, reserved blocks, in-flight bytes
and open transfers, read from ``/metrics``, must return to zero (``leaked``).
The report counts faults by kind, and for corrupted chunks how many the decode
worker detected and recomputed: a corrupted chunk that was not detected is an
error, as is a fault that could not be injected.

A decode worker that recomputes a prompt answers with the same tokens, so
output equality cannot tell a transfer from a silent recompute. The soak
therefore samples every decode worker's counters while it runs and reports
where the prompts' KV came from: tokens transferred, tokens recomputed, and
each fallback (by reason) sorted into "after a fault" (it happened while a
fault was in effect: from its injection to ``SETTLE_S`` after it ended) or
"without a fault", which must be none. A request may fail cleanly only while a
fault is in effect, and at most ``concurrency`` per decode kill or prefill
stall (the requests in flight then).

    python benchmarks/soak.py --requests 200 --json

Exits non-zero when anything hung, leaked or mismatched.

Two hosts (``hosts=2``, ``--hosts 2``): the router and the prefill worker on
one network namespace, two decode workers on another, joined by a veth
shaped to 10 Gbit, a shared Redis tier on the hub (``hosts``); tcp or nixl.
Faults come in two lanes that overlap: the link's (``linkfaults``: the veth
down for 1-10 s, its rate cut to 10 Mbit in place, the routes between the
hosts removed) and the processes' (decode worker 1 SIGKILLed and restarted
on the same address, which the router must notice by itself; the prefill
worker stalled). After each fault the router must have every decode worker
up again within ``linkfaults.UP_WAIT_S``, and the report says how often it
marked one down. Requests back off ``report.RETRY_S`` after a failure, as a
client would, and may fail only while a fault is in effect. On both
scenarios ``procstats`` reads every long-lived process's fds, threads and
RSS from ``/proc`` after the first block of requests (the warm-up) and after
the run: no more fds or threads, RSS within 10%. ``plot`` draws the run over
time with the faults marked (``--plot``).

The scenario is in these modules: ``cluster`` (the processes and their
configs), ``proxy`` (the corrupting proxy), ``traffic`` (prompts and one
request's outcome), ``faults`` (what is injected), ``monitor`` (where the KV
came from, what leaked), ``report`` (the counts and what fails a run) and
``run`` (all of it together); for two hosts also ``hosts``, ``linkfaults``,
and for both ``procstats`` and ``plot``. ``tests/test_soak.py`` runs a short soak and
``benchmarks/soak.py`` is the command for a long one.
"""
