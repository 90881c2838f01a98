"""How the size of each ``send`` decides a transfer's time on a TCP link (issue 46, step 2): plain sockets moving
the same bytes in sends of W bytes against one send of all of them (the baseline), the sender's CPU beside.

    python benchmarks/send_window.py --mib 2.1 --repeats 300 --windows 16 32 48 64 128 256 1024

Why: a write hashed as it is sent (``write_blocks_summed``, tcp's ``sum_window_bytes``) makes one ``sendmsg`` a
window, and on loopback 64-256 KiB sends ran at half the speed of one big send while 32-48 KiB ones beat it; the
option's default comes from here. Two processes on 127.0.0.1 (or ``--host``, an address of this machine): the
receiver ``recv_into``s 1 MiB at a time until it has the round's bytes and answers one byte; the sender times the
round. The windows take turns within each repeat, so load moves them alike. Prints one JSON object: per window
(KiB; 0 is the one send) the p50 in ms, the sender's CPU a round in ms, and the p50 against the one send's.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import time
from multiprocessing import Process

ACK = b"k"


def _receiver(host: str, port: int, nbytes: int) -> None:
    sock = socket.create_connection((host, port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    view = memoryview(bytearray(nbytes))
    while True:
        got = 0
        while got < nbytes:
            n = sock.recv_into(view[got:], min(nbytes - got, 1 << 20))
            if not n:
                return
            got += n
        sock.sendall(ACK)


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_THREAD)
    return r.ru_utime + r.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=float, default=2.1, help="bytes a round (2.1 MiB: a 40-token request's)")
    parser.add_argument("--repeats", type=int, default=300)
    parser.add_argument("--windows", type=int, nargs="+", default=[16, 32, 48, 64, 128, 256, 1024], help="KiB")
    parser.add_argument("--host", default="127.0.0.1")
    args = parser.parse_args()
    nbytes = int(args.mib * (1 << 20))
    listener = socket.create_server((args.host, 0))
    peer = Process(target=_receiver, args=(args.host, listener.getsockname()[1], nbytes), daemon=True)
    peer.start()
    sock, _ = listener.accept()
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    data = memoryview(os.urandom(nbytes))
    windows = [0, *args.windows]
    times: dict[int, list[float]] = {w: [] for w in windows}
    cpu: dict[int, float] = dict.fromkeys(windows, 0.0)

    def round_trip(w: int) -> None:
        step = w << 10 or nbytes
        for at in range(0, nbytes, step):
            sock.sendall(data[at : at + step])
        if sock.recv(1) != ACK:
            raise SystemExit("the receiver went away")

    for w in windows:  # warm each up: the buffers autotune
        for _ in range(20):
            round_trip(w)
    for _ in range(args.repeats):
        for w in windows:
            began, used = time.perf_counter(), _cpu_s()
            round_trip(w)
            times[w].append(time.perf_counter() - began)
            cpu[w] += _cpu_s() - used
    sock.close()
    peer.join(5)
    one = statistics.median(times[0])
    rows = [
        {
            "window_kib": w,
            "p50_ms": round(statistics.median(times[w]) * 1e3, 3),
            "sender_cpu_ms": round(cpu[w] / args.repeats * 1e3, 3),
            "vs_one_send": round(statistics.median(times[w]) / one, 3),
        }
        for w in windows
    ]
    print(
        json.dumps(
            {"bench": "send_window", "bytes": nbytes, "repeats": args.repeats, "load": os.getloadavg()[0], "rows": rows}
        )
    )


if __name__ == "__main__":
    main()
