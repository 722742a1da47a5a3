"""Streamed multipart uploads: one S3 object assembled from concurrent writes at offsets.

quire's format-v2 pack writer reserves each chunk's offset in a pack and writes the
chunk there (``Backend.stream_writer``).  Here the bytes are copied into part buffers of
``multipart_chunksize``; a part is uploaded (``UploadPart``, retried like every request)
as soon as every byte of it has arrived, at most ``MAX_INFLIGHT`` at a time and within the
backend's upload budget (a write waits for an upload when more are pending), and ``close``
uploads the last, shorter part and completes the upload.  Host memory: the parts being
filled plus the parts in flight (at most ``MAX_INFLIGHT``, and the upload budget).

The multipart upload is created when the first part is full, not when the object is
opened: an object that never fills a part (the last, small pack of a save) is one
``PutObject`` at ``close``, one request instead of three.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from quire.backends import Buffer, PartBuffers

MAX_INFLIGHT = 16


class MultipartStream:
    def __init__(self, backend: Any, key: str, part_size: int) -> None:
        self.b = backend
        self.key = key
        self.upload_id: str | None = None
        self._creating: asyncio.Future[str] | None = None
        self.part_size = part_size
        self.parts = PartBuffers(part_size)
        self.etags: dict[int, str] = {}
        self.tasks: set[asyncio.Task[None]] = set()
        self.error: BaseException | None = None

    async def write(self, data: Sequence[Buffer], offset: int) -> None:
        if self.error is not None:
            raise self.error
        ready = self.parts.add(data, offset)
        for i in ready:
            while len(self.tasks) >= MAX_INFLIGHT:
                await asyncio.wait(self.tasks, return_when=asyncio.FIRST_COMPLETED)
            # Parts in flight are held in the backend's upload budget, as put's are: a
            # writer waits here while the budget is spent.
            await self.b.budget.acquire(self.part_size)
            self._upload(i, self.parts.take(i), self.part_size)
        if self.error is not None:
            raise self.error

    async def _upload_id(self) -> str:
        if self._creating is None:
            self._creating = asyncio.ensure_future(
                self.b._call("CreateMultipartUpload", "create_multipart_upload", self.key)
            )
        mpu = await asyncio.shield(self._creating)
        self.upload_id = str(mpu["UploadId"])
        return self.upload_id

    def _upload(self, i: int, body: bytearray | bytes, held: int = 0) -> None:
        async def run() -> None:
            try:
                upload_id = await self._upload_id()
                r = await self.b._call(
                    "UploadPart", "upload_part", self.key,
                    UploadId=upload_id, PartNumber=i + 1, Body=body,
                )  # fmt: skip
                self.etags[i + 1] = r["ETag"]
            except BaseException as e:
                self.error = self.error or e
                raise
            finally:
                if held:
                    await self.b.budget.release(held)

        task = asyncio.ensure_future(run())
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def close(self) -> None:
        last, rest = self.parts.tail()
        if rest and self.parts.filled.get(last) != rest:
            raise ValueError(f"{self.key}: streamed object has holes")
        if self._creating is None and not self.tasks and last == 0:
            # Never filled a part: one PutObject (nothing to abort on failure).
            body = bytes(self.parts.take(0)[:rest]) if rest else b""
            await self.b._call("PutObject", "put_object", self.key, Body=body)
            return
        if rest:
            self._upload(last, self.parts.take(last)[:rest])
        await asyncio.gather(*list(self.tasks), return_exceptions=True)
        if self.error is not None or self.parts.buffers:
            await self.abort()
            raise self.error or ValueError(f"{self.key}: streamed object has holes")
        parts = [{"PartNumber": n, "ETag": t} for n, t in sorted(self.etags.items())]
        await self.b.complete_upload(self.key, self.upload_id, parts, self.parts.end)

    async def abort(self) -> None:
        for t in list(self.tasks):
            t.cancel()
        await asyncio.gather(*list(self.tasks), return_exceptions=True)
        self.parts.buffers.clear()
        if self._creating is None:
            return
        try:
            upload_id = await self._upload_id()
        except Exception:  # broad: no upload was created, so there is nothing to abort
            return
        await self.b.abort_upload(self.key, upload_id)
