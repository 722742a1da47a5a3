"""Streamed resumable uploads: one GCS object assembled from concurrent writes at offsets.

quire's format-v2 pack writer reserves each chunk's offset in a pack and writes the chunk
there (``Backend.stream_writer``).  Here the bytes are copied into buffers of
``resumable_chunksize`` (a multiple of 256 KiB).  A resumable upload takes its bytes in
order, so one sender uploads the buffers in turn, each as soon as it is full, with the
object's size unknown (``Content-Range: bytes a-b/*``); ``close`` sends the last, shorter
buffer with the size, which completes the object.  Every chunk is retried and resumed
from the offset the server confirms (``GCSBackend.resumable_send``).

A write waits while more than ``MAX_BUFFERED`` full buffers wait for the sender (it has
copied its bytes first, so the buffer the sender needs next always fills).  Host memory:
the buffers being filled, ``MAX_BUFFERED`` full ones and the one being sent.

The session is opened when the first buffer is full: an object that never fills one (the
last, small pack of a save) is one media upload at ``close``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from quire.backends import Buffer, PartBuffers

MAX_BUFFERED = 4


class ResumableStream:
    def __init__(self, backend: Any, key: str, chunk_size: int) -> None:
        self.b = backend
        self.key = key
        self.chunk = chunk_size
        self.parts = PartBuffers(chunk_size)
        self.sent = 0  # buffers the server holds
        self.session: str | None = None
        self.sender: asyncio.Task[None] | None = None
        self.progress = asyncio.Event()
        self.error: BaseException | None = None

    async def write(self, data: Sequence[Buffer], offset: int) -> None:
        if self.error is not None:
            raise self.error
        self.parts.add(data, offset)
        self._kick()
        while self.error is None and sum(map(self.parts.full, self.parts.buffers)) > MAX_BUFFERED:
            self.progress.clear()
            await self.progress.wait()
        if self.error is not None:
            raise self.error

    def _kick(self) -> None:
        if self.parts.full(self.sent) and (self.sender is None or self.sender.done()):
            self.sender = asyncio.ensure_future(self._send_ready())

    async def _send_ready(self) -> None:
        try:
            while self.parts.full(self.sent):
                if self.session is None:
                    self.session = await self.b.resumable_start(self.key, None)
                start = self.sent * self.chunk
                body = self.parts.buffers[self.sent]
                await self.b.resumable_send(
                    self.session, self.key, [memoryview(body)], start, start + self.chunk, None
                )
                self.parts.take(self.sent)
                self.sent += 1
                self.progress.set()
        except BaseException as e:
            self.error = self.error or e
            self.progress.set()
            raise

    async def close(self) -> None:
        if self.sender is not None:
            await asyncio.gather(self.sender, return_exceptions=True)
        if self.error is not None:
            await self.abort()
            raise self.error
        last, rest = self.parts.tail()
        # The sender stopped at the first buffer that is not full: that must be the last.
        if self.sent != last or not self.parts.whole():
            await self.abort()
            raise ValueError(f"{self.key}: streamed object has holes")
        tail = [memoryview(self.parts.buffers[last])[:rest]] if rest else []
        if self.session is None:  # never filled a buffer: one upload
            await self.b.put(self.key, tail)
        else:
            await self.b.resumable_send(
                self.session, self.key, tail, last * self.chunk, self.parts.end, self.parts.end
            )
        self.parts.buffers.clear()

    async def abort(self) -> None:
        if self.sender is not None and not self.sender.done():
            self.sender.cancel()
            await asyncio.gather(self.sender, return_exceptions=True)
        self.parts.buffers.clear()
        if self.session is not None:
            await self.b.resumable_cancel(self.session)
