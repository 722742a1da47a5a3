"""How a Checkpointer's saves, save decisions and reads are arranged over its tiers.

:class:`Tiers` is what the Checkpointer asks; :func:`check_arguments` refuses its
``save_policy`` and ``local`` arguments of the wrong type (before the root is opened), and
:func:`arrange` picks, for the Checkpointer's root and ``local=`` argument, its root alone (:class:`_PersistentOnly`) or a local tier over
it (``quire._tiers.two_tiers.TwoTiers``), and gives it the Checkpointer's save decision.  It
is where the parts are made: the save decisions and, for the local tier, its root (a
:class:`StepRoot` like the Checkpointer's own), handed to the tier as it asks for them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from quire._checkpointer.deciding import SaveDecider
from quire._checkpointer.localtier import LocalTier
from quire._checkpointer.save_policies import SavePolicy
from quire._checkpointer.steproot import StepRoot
from quire._engine.incremental import COMPACT_BELOW
from quire._runtime.config import current
from quire._tiers.restore_plan import Agreement, view
from quire._tiers.two_tiers import PERSISTENT, TwoTiers

log = logging.getLogger("quire")


def check_arguments(save_policy: object, local: object) -> None:
    """Raise ``TypeError`` unless ``save_policy`` is a save policy and ``local`` a
    ``quire.LocalTier`` (or None)."""
    if local is not None and not isinstance(local, LocalTier):
        raise TypeError(f"local must be a quire.LocalTier, got {local!r}")
    if save_policy is not None and not isinstance(save_policy, SavePolicy):
        raise TypeError(f"save_policy must be a quire.policies.SavePolicy, got {save_policy!r}")


def arrange(
    root: StepRoot,
    save_policy: SavePolicy | None,
    local: LocalTier | None,
    gc_grace_period: float | None,
) -> Tiers:
    """The Tiers of a Checkpointer whose own root is ``root`` (see ``quire.Checkpointer``)."""
    decider = SaveDecider(
        save_policy, root.latest(), without_policy=True, follow_primary=True, name=root.root
    )
    if local is None:
        return _PersistentOnly(root, decider)
    spec = local

    def open_root(url: str, *, maintainer: bool) -> StepRoot:
        return StepRoot(
            url,
            spec.storage_options,
            step_format=None,
            metadata=None,
            keep=spec.keep,
            gc_grace_period=gc_grace_period,
            incremental=False,
            compact_below=COMPACT_BELOW,
            maintainer=maintainer,
        )

    def new_decider(last_step: int | None) -> SaveDecider:
        # Without a policy of its own, the local tier saves only what the persistent one does.
        # With several processes its save is collective: every process follows process 0.
        return SaveDecider(
            spec.save_policy,
            last_step,
            without_policy=False,
            follow_primary=True,
            name=f"{root.root}/local",
        )

    return TwoTiers(local, root, decider, open_root, new_decider)


class Tiers(Protocol):
    """What a Checkpointer's saves, save decisions and reads go through: its root alone
    (:class:`_PersistentOnly`) or a local tier over it (:class:`TwoTiers`).  It owns the
    Checkpointer's :class:`SaveDecider` (attached at construction, detached by
    :meth:`close`)."""

    def save(
        self,
        step: int,
        units: Mapping[str, Any],
        metrics: Mapping[str, Any] | None,
        metadata: Mapping[str, Any] | None,
        *,
        force: bool,
    ) -> bool:
        """Save ``step`` if a policy says so (or ``force``: then replacing a step there);
        return whether it saves."""
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
    """A Checkpointer without a local tier: its root, its save decision and the agreement
    of its processes on the step to restore."""

    def __init__(self, root: StepRoot, decider: SaveDecider) -> None:
        self.root, self.decider = root, decider
        self.agreement = Agreement(f"{root.root}/restore", current().primary_process)
        decider.attach()

    def save(
        self,
        step: int,
        units: Mapping[str, Any],
        metrics: Mapping[str, Any] | None,
        metadata: Mapping[str, Any] | None,
        *,
        force: bool,
    ) -> bool:
        if not force and not self.should_save(step):
            log.debug(
                "%s: not saving step %d (save policy, or not after the last save)",
                self.root.root,
                step,
            )
            return False
        fut = self.root.save(step, units, metrics, metadata, overwrite=force)
        self.decider.saved(step, fut)  # a failed save does not count
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
        """Load the agreed step: ``step`` (None: the newest), the same on every process (a
        step no listing shows yet is looked for under the root all the same)."""
        root = self.root
        root.wait_save()  # a step being saved counts once committed
        plan = self.agreement.decide(
            view(step, root.steps()), root.root, root.root, "agreeing on the step to restore"
        )
        return root.load(plan.step if plan is not None else step, fn)

    def reload(self) -> None:
        self.root.wait()
        self.root.reload()

    def wait(self) -> None:
        self.root.wait()

    def close(self) -> None:
        self.decider.detach()
