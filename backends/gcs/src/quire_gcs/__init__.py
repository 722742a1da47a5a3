"""quire's ``gs://`` backend (registered under the ``quire.backends`` entry points)."""

from __future__ import annotations

from quire_gcs._backend import GCSBackend, GCSBucketNotFoundError, GCSError, GCSPermissionError

__all__ = ["GCSBackend", "GCSBucketNotFoundError", "GCSError", "GCSPermissionError"]
