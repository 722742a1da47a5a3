"""When a :class:`quire.Checkpointer` saves, and which steps it keeps.

Save policies answer "save at this step?"; keep policies answer "which committed steps
survive?".  Both combine with ``|``: a step is saved if *any* save policy says so, and a
step survives if *any* keep policy keeps it::

    from quire.policies import BestN, EveryNSteps, KeepEveryNSteps, LatestN, OnPreemption

    ckpt = quire.Checkpointer(
        "s3://bucket/run1",
        save_policy=EveryNSteps(1000) | OnPreemption(),
        keep=LatestN(3) | BestN(1, metric="val_loss", mode="min") | KeepEveryNSteps(10_000),
    )

Policies are pure functions of what the Checkpointer tells them (:class:`SaveContext`,
:class:`StepInfo`), so one instance may serve several Checkpointers.  Whatever the keep
policy says, the latest committed step and any step being loaded are never deleted.
"""

from __future__ import annotations

from quire._checkpointer.keep_policies import (
    AnyKeep,
    BestN,
    KeepEveryNSteps,
    KeepForSeconds,
    KeepPolicy,
    LatestN,
    StepInfo,
)
from quire._checkpointer.save_policies import (
    AnySave,
    EveryNSeconds,
    EveryNSteps,
    OnPreemption,
    SaveContext,
    SavePolicy,
    SpecificSteps,
)

__all__ = [
    "AnyKeep",
    "AnySave",
    "BestN",
    "EveryNSeconds",
    "EveryNSteps",
    "KeepEveryNSteps",
    "KeepForSeconds",
    "KeepPolicy",
    "LatestN",
    "OnPreemption",
    "SaveContext",
    "SavePolicy",
    "SpecificSteps",
    "StepInfo",
]
