"""quire-orbax on object stores: Orbax checkpoints written by orbax-checkpoint, uploaded to
moto's S3 server (and fake-gcs-server), opened with ``quire.open`` and converted with
``quire cp``; JSON metadata through fsspec, arrays through tensorstore's s3 / gcs kvstores."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest
from object_store_servers import GCS_BUCKET, S3_BUCKET, S3_SECRET, FakeGcs, MotoS3

import quire
from quire._cli.main import main
from quire.errors import ObjectStorePermissionError, PluginError

ocp = pytest.importorskip("orbax.checkpoint", reason="quire-orbax's tests need orbax-checkpoint")
pytestmark = pytest.mark.filterwarnings("ignore:Sharding info not provided:UserWarning")


def _tree() -> dict[str, Any]:
    rng = np.random.default_rng(3)
    return {
        "params": {
            "kernel": jnp.asarray(rng.standard_normal((16, 8)).astype(np.float32)),
            "bias": jnp.arange(8, dtype=jnp.bfloat16),
        },
        "opt": [jnp.zeros((4,), jnp.float16), jnp.array(7, jnp.int32)],
        "host": np.linspace(0, 1, 5),
        "step": 42,
    }


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("orbax-remote")
    out = {"ocdbt": root / "ocdbt", "plain": root / "plain"}
    with ocp.StandardCheckpointer() as ck:  # OCDBT on: orbax's default
        ck.save(out["ocdbt"], _tree())
        ck.wait_until_finished()
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=False)) as ck:
        ck.save(out["plain"], _tree())
    return out


def _files(path: Path) -> list[Path]:
    return [p for p in sorted(path.rglob("*")) if p.is_file()]


def _upload_s3(moto: MotoS3, path: Path) -> str:
    url = moto.fresh_url()
    prefix = url.split(f"{S3_BUCKET}/", 1)[1]
    client = moto.client()
    for f in _files(path):
        rel = f.relative_to(path).as_posix()
        client.put_object(Bucket=S3_BUCKET, Key=f"{prefix}/{rel}", Body=f.read_bytes())
    return url


def _same(got: Any, want: Any) -> None:
    if isinstance(want, dict):
        assert sorted(got) == sorted(want)
        for k in want:
            _same(got[k], want[k])
    elif isinstance(want, list | tuple):
        assert len(got) == len(want)
        for g, w in zip(got, want):
            _same(g, w)
    elif hasattr(want, "shape"):
        w = np.asarray(want)
        g = np.asarray(got)
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_array_equal(g, w)
    else:
        assert got == want


def _read_all(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: _read_all(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_read_all(v) for v in node]
    return node.read() if isinstance(node, quire.sources.LazyArray) else node


@pytest.mark.parametrize("layout", ["ocdbt", "plain"])
def test_orbax_on_s3_opens_equal_to_orbax_restore(
    moto: MotoS3, written: dict[str, Path], layout: str
) -> None:
    url = _upload_s3(moto, written[layout])
    restore = ocp.StandardCheckpointer if layout == "ocdbt" else ocp.PyTreeCheckpointer
    want = restore().restore(written[layout])
    with quire.open(url, **moto.options()) as src:  # detected: no format= needed
        assert src.format == "orbax"
        assert src.metadata["items"][""]["use_ocdbt"] is (layout == "ocdbt")
        _same(_read_all(src.tree), want)
        # A slice reads through tensorstore's s3 kvstore too.
        np.testing.assert_array_equal(
            src.tree["params"]["kernel"][2:5, 1:3].read(),
            np.asarray(want["params"]["kernel"])[2:5, 1:3],
        )
        creds = src._store._tmp  # the profile file the key/secret went into (0600)
        assert creds is not None and os.stat(Path(creds) / "credentials").st_mode & 0o077 == 0
    assert not os.path.exists(creds)  # removed on close


def test_quire_cp_from_orbax_on_s3_to_s3(moto: MotoS3, written: dict[str, Path]) -> None:
    url = _upload_s3(moto, written["ocdbt"])
    dst = moto.fresh_url()
    opts = json.dumps(moto.options())
    assert main(["cp", url, dst, "--storage-options", opts, "-q"]) == 0
    got = quire.load(dst, storage_options=moto.options())
    _same(got, ocp.StandardCheckpointer().restore(written["ocdbt"]))
    assert quire.metadata(dst, storage_options=moto.options()).custom["source_format"] == "orbax"


def test_errors_name_the_url_and_never_the_secret(moto: MotoS3, written: dict[str, Path]) -> None:
    url = _upload_s3(moto, written["plain"])
    prefix = url.split(f"{S3_BUCKET}/", 1)[1]
    moto.client().delete_object(Bucket=S3_BUCKET, Key=f"{prefix}/params.kernel/0.0")
    with (
        quire.open(url, **moto.options()) as src,
        pytest.raises(quire.CorruptCheckpointError, match="params/kernel") as info,
    ):
        src.tree["params"]["kernel"].read()
    assert url in str(info.value) and S3_SECRET not in str(info.value)
    # Without credentials moto answers 403: an access error naming the URL, not "corrupt".
    with pytest.raises(ObjectStorePermissionError, match=url):
        quire.open(url, format="orbax", endpoint_url=moto.endpoint, anon=True)
    missing = f"{moto.fresh_url()}/nothing"
    with pytest.raises(quire.CheckpointNotFoundError, match=missing):
        quire.open(missing, format="orbax", **moto.options())


def test_orbax_on_gcs_emulator(
    gcs: FakeGcs, written: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    import gcsfs

    url = f"gs://{GCS_BUCKET}/orbax-{os.getpid()}"
    fs = gcsfs.GCSFileSystem(**gcs.options())
    for f in _files(written["ocdbt"]):
        fs.pipe_file(f"{url}/{f.relative_to(written['ocdbt']).as_posix()}", f.read_bytes())
    # tensorstore's gcs driver takes its endpoint from the environment only.
    monkeypatch.delenv("TENSORSTORE_GCS_HTTP_URL", raising=False)
    with pytest.raises(PluginError, match="TENSORSTORE_GCS_HTTP_URL"):
        quire.open(url, format="orbax", **gcs.options())
    monkeypatch.setenv("TENSORSTORE_GCS_HTTP_URL", gcs.endpoint)
    monkeypatch.setenv("GOOGLE_AUTH_TOKEN_FOR_TESTING", "emulator")
    with quire.open(url, **gcs.options()) as src:
        assert src.format == "orbax"
        _same(_read_all(src.tree), ocp.StandardCheckpointer().restore(written["ocdbt"]))
