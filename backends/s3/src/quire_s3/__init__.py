"""quire's ``s3://`` backend (registered under the ``quire.backends`` entry points)."""

from __future__ import annotations

from quire_s3._backend import S3Backend, S3BucketNotFoundError, S3Error, S3PermissionError

__all__ = ["S3Backend", "S3BucketNotFoundError", "S3Error", "S3PermissionError"]
