"""The plain-Deployment init container (``python -m peagle.deploy.fetch URI DEST``) against a real S3
server (SeaweedFS) with the OpenShift AI data-connection environment, exactly as the chart's init
container runs it (``s3:///<path>``, bucket from AWS_S3_BUCKET, endpoint from AWS_S3_ENDPOINT): a real
process, its environment the subject."""
from __future__ import annotations

import os
import subprocess
import sys

from support.deploy_run import files, make_run
from support.seaweed import BUCKET, unique


def test_init_container_command_with_a_data_connection(seaweed_server, tmp_path):
    src = make_run(tmp_path / "run")
    prefix = unique("runs")
    from peagle.storage import S3Store

    store = S3Store(BUCKET, prefix, seaweed_server.settings())
    for key, data in files(src).items():
        store.put_bytes(key, data)
    # Only the data-connection keys, as envFrom puts them into the init container.
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(AWS_ACCESS_KEY_ID=seaweed_server.env()["AWS_ACCESS_KEY_ID"],
               AWS_SECRET_ACCESS_KEY=seaweed_server.env()["AWS_SECRET_ACCESS_KEY"],
               AWS_S3_ENDPOINT=seaweed_server.endpoint, AWS_S3_BUCKET=BUCKET, AWS_DEFAULT_REGION="us-east-1")
    dest = tmp_path / "mnt" / "models"
    r = subprocess.run([sys.executable, "-m", "peagle.deploy.fetch", f"s3:///{prefix}", str(dest)],
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert files(dest) == files(src)
    assert seaweed_server.env()["AWS_SECRET_ACCESS_KEY"] not in r.stdout + r.stderr
    bad = subprocess.run([sys.executable, "-m", "peagle.deploy.fetch", f"s3:///{prefix}-missing", str(dest)],
                         env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and "fetch: error:" in bad.stderr and "empty" in bad.stderr
