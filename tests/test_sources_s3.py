"""safetensors sources and export on S3 (moto's real HTTP server): byte-range reads only."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
from object_store_servers import S3_BUCKET, MotoS3
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

import quire


def _upload(moto: MotoS3, prefix: str, files: list[Path]) -> None:
    client = moto.client()
    for f in files:
        client.put_object(Bucket=S3_BUCKET, Key=f"{prefix}/{f.name}", Body=f.read_bytes())


def _get(tree: Any, dotted: str) -> Any:
    for k in dotted.split("."):
        tree = tree[k]
    return tree


def test_hf_dir_on_s3_loads_equal_to_load_file(moto: MotoS3, tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    t = {f"model.layers.{i}.w": rng.standard_normal((32, 8)).astype(np.float32) for i in range(6)}
    t["model.norm"] = rng.standard_normal(8).astype(ml_dtypes.bfloat16)
    names = sorted(t)
    files, weight_map = [], {}
    for i in range(2):
        part = {k: t[k] for k in names[i::2]}
        f = tmp_path / f"model-{i + 1:05d}-of-00002.safetensors"
        save_file(part, str(f))
        files.append(f)
        weight_map.update(dict.fromkeys(part, f.name))
    idx = tmp_path / "model.safetensors.index.json"
    idx.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    url = moto.fresh_url()
    prefix = url.split(f"{S3_BUCKET}/", 1)[1]
    _upload(moto, prefix, [*files, idx])
    ref: dict[str, np.ndarray] = {}
    for f in files:
        ref.update(load_file(str(f)))
    opts = moto.options()
    got = quire.load(url, storage_options=opts)
    for k, v in ref.items():
        np.testing.assert_array_equal(_get(got, k), v)
    # Lazy on S3 too: one tensor's rows read only those bytes.
    src = quire.open(url, **opts)
    part = src.tree["model"]["layers"]["3"]["w"][4:6].read()
    np.testing.assert_array_equal(part, t["model.layers.3.w"][4:6])
    assert src.bytes_read == 2 * 8 * 4
    # Export back to S3 as one file; safetensors reads it (downloaded) equal to the source.
    dst = f"{moto.fresh_url()}/out.safetensors"
    quire.export(src, dst, storage_options=opts)
    body = moto.client().get_object(Bucket=S3_BUCKET, Key=dst.split(f"{S3_BUCKET}/", 1)[1])
    local = tmp_path / "back.safetensors"
    local.write_bytes(body["Body"].read())
    with safe_open(str(local), framework="numpy") as h:
        for k, v in ref.items():
            np.testing.assert_array_equal(h.get_tensor(k).view(np.uint8), v.view(np.uint8))


def test_single_file_on_s3_and_quire_cp_to_s3(moto: MotoS3, tmp_path: Path) -> None:
    t = {"a.w": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.array(2, np.int64)}
    f = tmp_path / "one.safetensors"
    save_file(t, str(f), metadata={"k": "v"})
    url = moto.fresh_url()
    _upload(moto, url.split(f"{S3_BUCKET}/", 1)[1], [f])
    opts = moto.options()
    src = quire.open(f"{url}/one.safetensors", **opts)
    assert src.metadata["__metadata__"] == {"k": "v"}
    np.testing.assert_array_equal(src.tree["a"]["w"].read(), t["a.w"])
    from quire._sources.convert import convert

    dst = moto.fresh_url()
    nbytes, checked = convert(src, dst, dst_options=opts)
    assert nbytes == 56 and checked == 4  # two chunks and two zarr.json, verified
    np.testing.assert_array_equal(quire.load(dst, storage_options=opts)["a"]["w"], t["a.w"])
