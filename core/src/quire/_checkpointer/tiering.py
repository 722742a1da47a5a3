"""How a Checkpointer's saves, save decisions and reads are arranged over its tiers.

:class:`Tiers` is what the Checkpointer asks; :func:`arrange` picks, for the Checkpointer's
root and ``local=`` argument, its root alone (:class:`_PersistentOnly`) or a local tier over
it (``quire._checkpointer.tiers._Tier``), and gives it the Checkpointer's save decision.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from quire._checkpointer.deciding import SaveDecider
from quire._checkpointer.tiers import PERSISTENT, LocalTier, _Tier

if TYPE_CHECKING:
    from quire._checkpointer.save_policies import SavePolicy
    from quire._checkpointer.steproot import StepRoot

log = logging.getLogger("quire")


def arrange(
    root: StepRoot,
    save_policy: SavePolicy | None,
    local: LocalTier | None,
    gc_grace_period: float | None,
) -> Tiers:
    """The Tiers of a Checkpointer whose own root is ``root`` (see ``quire.Checkpointer``)."""
    decider = SaveDecider(save_policy, root.latest(), without_policy=True, follow_primary=True)
    if local is None:
        return _PersistentOnly(root, decider)
    return _Tier(local, root, decider, gc_grace_period)


class Tiers(Protocol):
    """What a Checkpointer's saves, save decisions and reads go through: its root alone
    (:class:`_PersistentOnly`) or a local tier over it (:class:`_Tier`).  It owns the
    Checkpointer's :class:`SaveDecider` (attached at construction, detached by
    :meth:`close`)."""

    def save(
        self,
        step: int,
        units: Mapping[str, Any],
        metrics: Mapping[str, Any] | None,
        metadata: Mapping[str, Any] | None,
        force: bool,
        single: bool,
    ) -> bool:
        """Save ``step`` if a policy says so (or ``force``); return whether it saves."""
        ...

    def should_save(self, step: int) -> bool: ...
    def policies(self) -> tuple[SavePolicy | None, ...]:
        """The save policies: the Checkpointer's, then the local tier's if any."""
        ...

    def steps(self) -> list[int]: ...
    def latest(self) -> int | None: ...
    def tiers_of(self, step: int) -> tuple[str, ...]: ...
    def load(self, step: int | None, fn: Callable[[str], Any]) -> Any: ...
    def reload(self) -> None: ...
    def wait(self) -> None: ...
    def close(self) -> None: ...


class _PersistentOnly:
    """A Checkpointer without a local tier: its root and its save decision."""

    def __init__(self, root: StepRoot, decider: SaveDecider) -> None:
        self.root, self.decider = root, decider
        decider.attach()

    def save(
        self,
        step: int,
        units: Mapping[str, Any],
        metrics: Mapping[str, Any] | None,
        metadata: Mapping[str, Any] | None,
        force: bool,
        single: bool,
    ) -> bool:
        if not force and not self.should_save(step):
            log.debug(
                "%s: not saving step %d (save policy, or not after the last save)",
                self.root.root,
                step,
            )
            return False
        self.root.save(step, units, metrics, metadata, overwrite=force, single=single)
        self.decider.saved(step)
        return True

    def should_save(self, step: int) -> bool:
        return self.decider.due(step, self.root.floor())

    def policies(self) -> tuple[SavePolicy | None, ...]:
        return (self.decider.policy,)

    def steps(self) -> list[int]:
        return self.root.steps()

    def latest(self) -> int | None:
        self.root.raise_errors()
        return self.root.latest()

    def tiers_of(self, step: int) -> tuple[str, ...]:
        return (PERSISTENT,) if step in self.root.steps() else ()

    def load(self, step: int | None, fn: Callable[[str], Any]) -> Any:
        return self.root.load(step, fn)

    def reload(self) -> None:
        self.root.wait()
        self.root.reload()

    def wait(self) -> None:
        self.root.wait()

    def close(self) -> None:
        self.decider.detach()
