"""What the local tier asks of the Checkpointer's parts it is handed: contracts only.

The tier (``two_tiers.TwoTiers``, ``spread.Spread``) works on roots of numbered steps and save
decisions that the Checkpointer makes (``quire._checkpointer.steproot.StepRoot``,
``quire._checkpointer.deciding.SaveDecider``) and reads its configuration
(``quire.LocalTier``); it knows them only through these protocols, so that it needs none of
the modules that define them.  Each protocol holds what its user calls, no more:

* :class:`Listed`: a root's steps as this process lists them (every root the tier reads);
* :class:`PersistentRoot`: the Checkpointer's own root, which ``TwoTiers`` promotes into and
  restores from;
* :class:`RestoringRoot`: this process's local root as ``Spread`` reads a multi-process
  restore from it (pins, relisting, its event loop);
* :class:`LocalRoot`: this process's local root as ``TwoTiers`` saves into it (and hands it
  to ``Spread``);
* :class:`OpenRoot`, :class:`Decider`, :class:`TierSpec`: how the tier gets its local root,
  the save decisions, its configuration.

Flags across this seam are keyword-only.
"""

from __future__ import annotations

import concurrent.futures
import os
from collections.abc import Callable, Coroutine, Mapping
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from quire._engine.incremental import Incremental
    from quire._engine.save import SaveScope
    from quire._peers.tls import PeerTLS

__all__ = [
    "Decider",
    "Info",
    "Listed",
    "LocalRoot",
    "OpenRoot",
    "Paths",
    "PersistentRoot",
    "RestoringRoot",
    "TierSpec",
]


class Paths(Protocol):
    """Where the steps of a root are (``StepPaths``)."""

    @property
    def root(self) -> str: ...
    @property
    def options(self) -> dict[str, Any] | None: ...
    def name(self, step: int) -> str: ...
    def url(self, step: int) -> str: ...


class Info(Protocol):
    """A committed step as a root counts it (``quire.policies.StepInfo``)."""

    @property
    def metrics(self) -> Mapping[str, Any]: ...


class Listed(Protocol):
    """A root's committed steps as this process lists them (``StepRoot``)."""

    @property
    def paths(self) -> Paths: ...
    def url(self, step: int) -> str: ...
    def steps(self) -> list[int]: ...
    def wait(self) -> None:
        """Wait for every background task (the listing settles); raise the kept errors."""
        ...

    def reload(self) -> None: ...
    def load(self, step: int | None, fn: Callable[[str], Any]) -> Any:
        """``fn(url of step)``, the step pinned; the processes agreed on it before."""
        ...


class PersistentRoot(Listed, Protocol):
    """The Checkpointer's own root, as the local tier promotes into it: it is told when a
    promotion begins (and runs it as its save), and counts the step once it commits."""

    @property
    def root(self) -> str: ...
    def floor(self) -> int | None: ...
    def wait_save(self) -> None: ...
    async def prepare(self) -> Incremental | None: ...
    def begin(
        self, step: int, commit: Coroutine[Any, Any, dict[str, Any] | None]
    ) -> concurrent.futures.Future[Any]: ...


class RestoringRoot(Listed, Protocol):
    """This process's local root, as a multi-process restore reads from it (``Spread``)."""

    def run(self, coro: Coroutine[Any, Any, Any]) -> Any: ...
    def relist(self) -> None: ...
    def pin(self, step: int) -> None: ...
    def unpin(self, step: int) -> None: ...


class LocalRoot(RestoringRoot, Protocol):
    """This process's local root, as the local tier saves into it (``TwoTiers``)."""

    def latest(self) -> int | None: ...
    def floor(self) -> int | None: ...
    def info(self, step: int) -> Info | None: ...
    def wait_save(self) -> None: ...
    def follow_save(self, coro: Coroutine[Any, Any, Any]) -> None: ...
    def save(
        self,
        step: int,
        units: Mapping[str, Any],
        metrics: Mapping[str, Any] | None,
        metadata: Mapping[str, Any] | None,
        *,
        overwrite: bool,
        scope: Callable[[], SaveScope] | None = None,
    ) -> concurrent.futures.Future[Any]: ...


class OpenRoot(Protocol):
    """Opens the local root at ``url`` (``maintainer``: whether this process keeps its
    retention, garbage and root record)."""

    def __call__(self, url: str, *, maintainer: bool) -> LocalRoot: ...


class Decider(Protocol):
    """A tier's save decision (``SaveDecider``)."""

    #: The tier's save policy (a ``quire.policies.SavePolicy``, or None), handed back only.
    policy: Any
    last_step: int | None

    def due(self, step: int, *floors: int | None) -> bool: ...
    def saved(self, step: int, outcome: concurrent.futures.Future[Any] | None = None) -> None: ...
    def attach(self) -> None: ...
    def detach(self) -> None: ...


class TierSpec(Protocol):
    """What the tier reads of its configuration (``quire.LocalTier``): where it lives and
    how it reaches its peers; the policies are the Checkpointer's to apply."""

    @property
    def url(self) -> str | os.PathLike[str]: ...
    @property
    def peers(self) -> int: ...
    @property
    def peer_host(self) -> str: ...
    @property
    def failure_domain(self) -> str | None: ...
    @property
    def peer_tls(self) -> PeerTLS | None: ...
    def process_url(self, index: int) -> str: ...
