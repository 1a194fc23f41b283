"""An S3-compatible object store on loopback for the tests of ``s3://`` outputs: moto's server
mode (``pip install 'moto[server]'``), a real HTTP server speaking the S3 API, started as a
subprocess on 127.0.0.1 and a free port, stopped by its PID.

Two ways to point a client at it, as users point sparkdl at MinIO, Ceph or a private endpoint:

* the environment (``AWS_ENDPOINT_URL`` and the credentials: :meth:`S3Server.environment`),
  which pyarrow's S3 and s3fs (botocore) both read; what the driver process uses;
* the URL itself (:meth:`S3Server.url_with_endpoint`: credentials as the URL's user and
  password, ``?endpoint_override=...&scheme=http&region=...``), which pyarrow's S3 reads: what
  executors started before the test (the shared session's) need, their environment being fixed.

Every request goes to 127.0.0.1: the region is given, instance metadata is disabled.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Dict, Iterator

ACCESS_KEY = "sparkdl-test-key"
SECRET_KEY = "sparkdl-test-secret"
REGION = "us-east-1"


@dataclasses.dataclass(frozen=True)
class S3Server:
    port: int

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def environment(self) -> Dict[str, str]:
        """What pyarrow's S3 and s3fs read to reach this server (and nothing else)."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_DEFAULT_REGION": REGION,
            "AWS_REGION": REGION,
            "AWS_EC2_METADATA_DISABLED": "true",
        }

    def url_with_endpoint(self, bucket: str, key: str) -> str:
        """``s3://`` URL that carries the endpoint and credentials (pyarrow's URL options)."""
        return (
            f"s3://{ACCESS_KEY}:{SECRET_KEY}@{bucket}/{key}"
            f"?endpoint_override=127.0.0.1:{self.port}&scheme=http&region={REGION}"
        )

    def client(self):
        """A boto3 S3 client of this server: the tests' independent view of what was stored."""
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
            region_name=REGION,
        )

    def keys(self, bucket: str, prefix: str = "") -> list:
        listed = self.client().list_objects_v2(Bucket=bucket, Prefix=prefix)
        return sorted(item["Key"] for item in listed.get("Contents", []))


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _wait_until_serving(process: subprocess.Popen, port: int, deadline_s: float) -> bool:
    """Polls the server's HTTP API until it answers (True) or the process exits (False)."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/moto-api/", timeout=2):
                return True
        except (urllib.error.URLError, ConnectionError, socket.timeout):
            pass
        try:
            process.wait(timeout=0.05)  # the wait between polls; returns early when the server died
            return False
        except subprocess.TimeoutExpired:
            pass
    raise TimeoutError(f"the S3 server on 127.0.0.1:{port} did not answer within {deadline_s:.0f} s")


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


@contextlib.contextmanager
def running_s3_server(log_dir: str) -> Iterator[S3Server]:
    """A moto server on 127.0.0.1 for the ``with`` block; its output goes to ``log_dir``. A port
    another process took between the probe and the bind is retried on a new one."""
    for _ in range(3):
        port = _free_port()
        log = open(os.path.join(log_dir, f"moto-{port}.log"), "wb")
        process = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            if _wait_until_serving(process, port, deadline_s=60):
                break
        except BaseException:
            _stop(process)
            log.close()
            raise
        log.close()
        _stop(process)
    else:
        raise RuntimeError(f"the S3 server did not start (see {log_dir}/moto-*.log)")
    try:
        yield S3Server(port)
    finally:
        _stop(process)
        log.close()
