"""Where an Orbax checkpoint lives: local paths, ``s3://`` and ``gs://``.

Two views of one location:

* :class:`Store` reads orbax's small JSON files (``_CHECKPOINT_METADATA``, ``_METADATA``,
  ``_strings.json``) and lists directories through **fsspec** (``s3fs`` / ``gcsfs``), with
  the ``storage_options`` given to ``quire.open``;
* :meth:`Store.kvstore` builds the **tensorstore** kvstore spec (``file``, ``s3`` or
  ``gcs`` driver) through which the arrays are read, as orbax itself reads them.

Mapping of fsspec storage options to tensorstore's ``s3`` driver (which takes no keys in its
spec): ``endpoint_url`` (or ``client_kwargs["endpoint_url"]``, or the ``AWS_ENDPOINT_URL_S3`` /
``AWS_ENDPOINT_URL`` environment variables) becomes ``endpoint``; ``client_kwargs
["region_name"]`` (or ``AWS_REGION`` / ``AWS_DEFAULT_REGION``) ``aws_region``; ``anon=True``
anonymous credentials; ``key`` / ``secret`` / ``token`` a ``profile`` credentials file written
to a private temporary directory (mode 0600) and removed when the source is closed or the
process exits; otherwise tensorstore's default AWS chain (environment, ``~/.aws``, instance
metadata).

tensorstore's ``gcs`` driver takes no endpoint in its spec: it reads the
``TENSORSTORE_GCS_HTTP_URL`` environment variable (and, for emulators,
``GOOGLE_AUTH_TOKEN_FOR_TESTING``).  A ``gs://`` URL with an ``endpoint_url`` option is
therefore read only when ``TENSORSTORE_GCS_HTTP_URL`` names the same endpoint; otherwise
:class:`quire.errors.PluginError` says what to set.
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
import weakref
from typing import Any
from urllib.parse import unquote, urlsplit

from quire.backends import QUIRE_STORAGE_OPTIONS
from quire.errors import CorruptCheckpointError, ObjectStorePermissionError, PluginError

PROTOCOLS = ("file", "s3", "gs")


def protocol(url: str) -> str:
    """``"file"``, ``"s3"``, ``"gs"`` (``gcs://`` too), or the URL's other scheme."""
    if "://" not in url:
        return "file"
    scheme = url.split("://", 1)[0].lower()
    return {"s3a": "s3", "gcs": "gs"}.get(scheme, scheme)


def local_path(url: str) -> str | None:
    """The file-system path of a local URL, or None for any other protocol."""
    if url.startswith("file://"):
        return os.path.abspath(unquote(urlsplit(url).path))
    if "://" in url:
        return None
    return os.path.abspath(os.path.expanduser(url))


def _fsspec_options(options: dict[str, Any]) -> dict[str, Any]:
    # quire's own backend options (retries, part sizes) mean nothing to s3fs / gcsfs.
    return {k: v for k, v in options.items() if k not in QUIRE_STORAGE_OPTIONS}


def _object_store_fs(proto: str, url: str, options: dict[str, Any]) -> tuple[Any, str]:
    """The fsspec file system and path of an ``s3://`` / ``gs://`` URL.

    For ``gs://`` the class is named, as quire-gcs does: ``gcsfs.GCSFileSystem`` (what
    fsspec's registry gives) is chosen when gcsfs is first imported, by the
    ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT`` environment variable at that moment; its
    experimental subclass first probes each bucket over gRPC, which against an emulator or
    without a route to Google waits about a minute per call.  Reading Orbax's JSON files
    needs none of it, and the behaviour must not depend on which module imported gcsfs.
    """
    if proto == "gs":
        from gcsfs.core import GCSFileSystem

        return GCSFileSystem(**options), GCSFileSystem._strip_protocol(url)
    import fsspec

    fs, path = fsspec.core.url_to_fs(url, **options)
    return fs, str(path)


class Store:
    """An Orbax checkpoint's location: fsspec for the JSON files, tensorstore for arrays.

    Paths are in the file system's terms: an absolute path locally, ``bucket/prefix`` on an
    object store.
    """

    def __init__(self, url: str, storage_options: dict[str, Any]) -> None:
        self.url = url
        self.protocol = protocol(url)
        self.options = dict(storage_options or {})
        if self.protocol not in PROTOCOLS:
            raise PluginError(
                f"{url}: quire-orbax reads Orbax checkpoints on local paths, s3:// and gs://, "
                f"not {self.protocol}://; copy the checkpoint to one of those first"
            )
        self._tmp: str | None = None
        self._cleanup: Any = None
        self._credentials: dict[str, Any] | None = None
        if self.protocol == "file":
            import fsspec

            self.fs = fsspec.filesystem("file")
            self.root = str(local_path(url))
            return
        try:
            self.fs, path = _object_store_fs(self.protocol, url, _fsspec_options(self.options))
        except ImportError as e:
            pkg = "s3fs" if self.protocol == "s3" else "gcsfs"
            raise PluginError(
                f"{url}: reading Orbax checkpoints on {self.protocol}:// needs {pkg}: "
                f"pip install {pkg}"
            ) from e
        self.root = path.rstrip("/")

    # -- the JSON side (fsspec) ----------------------------------------------------------
    def join(self, *parts: str) -> str:
        return "/".join([self.root, *parts]) if parts else self.root

    def isdir(self, path: str) -> bool:
        return bool(self._call(self.fs.isdir, path))

    def isfile(self, path: str) -> bool:
        return bool(self._call(self.fs.isfile, path))

    def listdir(self, path: str) -> list[str]:
        """Names (not paths) of the entries of directory ``path``."""
        names = self._call(self.fs.ls, path, detail=False)
        return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in names)

    def size(self, path: str) -> int:
        return int(self._call(self.fs.size, path))

    def read(self, path: str) -> bytes:
        if self.protocol == "file" and os.path.exists(path):
            # A FIFO (or device) would block open(2) until a writer comes, or never end.
            mode = os.stat(path).st_mode
            if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                raise CorruptCheckpointError(
                    f"{self.url}: {path} is not a regular file (a FIFO, socket or device); "
                    "the checkpoint is damaged or forged"
                )
        return bytes(self._call(self.fs.cat_file, path))

    def _call(self, fn: Any, path: str, **kw: Any) -> Any:
        try:
            return fn(path, **kw)
        except PermissionError as e:
            raise ObjectStorePermissionError(
                f"{self.url}: access denied reading {path} ({e}); check the credentials "
                "(storage options key/secret or anon, or the environment)"
            ) from e

    # -- the array side (tensorstore) ----------------------------------------------------
    def kvstore(self, path: str) -> dict[str, Any]:
        """The tensorstore kvstore spec of directory ``path`` (ends in ``/``)."""
        if self.protocol == "file":
            return {"driver": "file", "path": path.rstrip("/") + "/"}
        bucket, _, prefix = path.partition("/")
        prefix = prefix.rstrip("/") + "/" if prefix.strip("/") else ""
        if self.protocol == "s3":
            return {"driver": "s3", "bucket": bucket, "path": prefix, **self._s3()}
        self._check_gcs_endpoint()
        return {"driver": "gcs", "bucket": bucket, "path": prefix}

    def _s3(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        # As s3fs / botocore find them: the option, then client_kwargs, then the environment.
        endpoint = self._setting("endpoint_url", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")
        if endpoint:
            out["endpoint"] = str(endpoint)
        region = self._setting("region_name", "AWS_REGION", "AWS_DEFAULT_REGION")
        if region:
            out["aws_region"] = str(region)
        elif endpoint:
            out["aws_region"] = "us-east-1"  # what S3-compatible servers expect by default
        out["aws_credentials"] = self._aws_credentials()
        return out

    def _setting(self, name: str, *env: str) -> Any:
        ck = self.options.get("client_kwargs") or {}
        found = [self.options.get(name), ck.get(name), *(os.environ.get(v) for v in env)]
        return next((v for v in found if v), None)

    def _aws_credentials(self) -> dict[str, Any]:
        if self._credentials is not None:
            return self._credentials
        o = self.options
        key = o.get("key") or o.get("aws_access_key_id")
        secret = o.get("secret") or o.get("aws_secret_access_key")
        token = o.get("token") or o.get("aws_session_token")
        if o.get("anon"):
            creds: dict[str, Any] = {"type": "anonymous"}
        elif key and secret:
            self._tmp = tempfile.mkdtemp(prefix="quire-orbax-")
            self._cleanup = weakref.finalize(self, shutil.rmtree, self._tmp, True)
            path = os.path.join(self._tmp, "credentials")
            lines = ["[quire]", f"aws_access_key_id = {key}", f"aws_secret_access_key = {secret}"]
            if token:
                lines.append(f"aws_session_token = {token}")
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write("\n".join(lines) + "\n")
            config = os.path.join(self._tmp, "config")
            with open(config, "w") as f:
                f.write("[profile quire]\n")
            creds = {
                "type": "profile",
                "profile": "quire",
                "credentials_file": path,
                "config_file": config,
            }
        else:
            creds = {"type": "default"}
        self._credentials = creds
        return creds

    def _check_gcs_endpoint(self) -> None:
        want = self.options.get("endpoint_url")
        if not want:
            return
        have = os.environ.get("TENSORSTORE_GCS_HTTP_URL")
        if (have or "").rstrip("/") != str(want).rstrip("/"):
            raise PluginError(
                f"{self.url}: tensorstore reads GCS arrays from the endpoint in the "
                f"TENSORSTORE_GCS_HTTP_URL environment variable, not from storage options; "
                f"set TENSORSTORE_GCS_HTTP_URL={want} (and, for an emulator, "
                "GOOGLE_AUTH_TOKEN_FOR_TESTING=x) before opening it"
            )

    def close(self) -> None:
        """Remove the temporary credentials file, if one was written."""
        if self._cleanup is not None:
            self._cleanup()
            self._cleanup = None
