"""Start local S3 (moto) and GCS (fake-gcs-server) servers for trying quire by hand.

    .venv/bin/python ci/object_store_servers.py            # random ports, prints the setup
    .venv/bin/python ci/object_store_servers.py --s3-port 9000 --gcs-port 9023

Both listen on 127.0.0.1 only, keep everything in memory and stop on Ctrl-C.  Paste the
printed ``export`` lines into a shell, then e.g.::

    quire cp /tmp/ckpt s3://quire/ckpt && quire cp s3://quire/ckpt gs://quire/ckpt
    quire info gs://quire/ckpt

The test suite does not use this script: its fixtures start their own servers, the GCS one
with the same helper (``tests/object_store_servers.py``, :class:`FakeGcs`).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else "")
    ap.add_argument("--s3-port", type=int, default=0)
    ap.add_argument("--gcs-port", type=int, default=0)
    ap.add_argument("--bucket", default="quire", help="bucket created on both servers")
    args = ap.parse_args(argv)

    import boto3
    from moto.server import ThreadedMotoServer
    from object_store_servers import FakeGcs

    s3 = ThreadedMotoServer(ip_address="127.0.0.1", port=args.s3_port, verbose=False)
    s3.start()
    host, port = s3.get_host_and_port()
    s3_endpoint = f"http://{host}:{port}"
    boto3.client(
        "s3", endpoint_url=s3_endpoint, aws_access_key_id="local",
        aws_secret_access_key="local", region_name="us-east-1",
    ).create_bucket(Bucket=args.bucket)  # fmt: skip
    gcs = FakeGcs(bucket=args.bucket, port=args.gcs_port)

    print("# S3 (moto) and GCS (fake-gcs-server) are up; in another shell:")
    print("export AWS_ACCESS_KEY_ID=local AWS_SECRET_ACCESS_KEY=local AWS_DEFAULT_REGION=us-east-1")
    print(f"export AWS_ENDPOINT_URL_S3={s3_endpoint}")
    print(f"export STORAGE_EMULATOR_HOST={gcs.endpoint}")
    print("export GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false")
    print(f"# buckets: s3://{args.bucket}, gs://{args.bucket}")
    print("# Ctrl-C stops both.", flush=True)

    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    stop.wait()
    gcs.stop()
    s3.stop()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    sys.exit(main())
