"""The receiving side of local-tier peer copies and restores (``quire._tiers.ownership``) and
the agreed restore step (``quire._tiers.restore_plan.decide``), in one process.

Hostile or damaged traffic - a name with ``..``, a name outside the owner's set, another
process's pack, a truncated or altered pack or index, a malformed header - is refused and
logged before anything is written, and nothing lands outside the tier's directory.
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from peer_helpers import run_of

import quire
from quire._store.url import open_backend
from quire._tiers import ownership as tp
from quire._tiers.restore_plan import PERSISTENT_SOURCE, decide, parse_view, sources
from quire.errors import CorruptCheckpointError, MultiProcessError

pytestmark = pytest.mark.quick  # the quick tier (CONTRIBUTING.md)


def run(coro: Any) -> Any:
    return asyncio.run(coro)


@pytest.fixture
def step(tmp_path: Path) -> tuple[str, dict[str, Any], dict[str, bytes]]:
    """A saved step, its record, and its (one) owner's objects."""
    src = str(tmp_path / "src")
    rng = np.random.default_rng(0)
    quire.save(src, {"w": rng.standard_normal((64, 8)).astype(np.float32), "n": 3})
    b = open_backend(src)
    doc = json.loads(run(b.get("quire.json")))
    keys = run(tp._own_keys(b, src, doc, 0, 0))
    objects = {k: run(b.get(k)) for k in keys}
    assert any("%packs/p00000-" in k for k in objects) and len(objects) >= 2
    return src, doc, objects


def files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def test_a_checked_copy_is_written_and_held(tmp_path: Path, step: Any) -> None:
    _, doc, objects = step
    dst = str(tmp_path / "dst")
    b = open_backend(dst)
    payload = tp.encode(sorted(objects.items()))
    got = tp.decode(payload, dst, "process 3", 0)
    assert got == objects
    run(tp.receive(b, dst, doc, 0, 0, got, "process 3"))
    assert run(tp.holds(b, doc, 0))
    assert sorted(k for k, _ in run(tp.read_owned(b, doc, 0))) == sorted(objects)
    # A holder whose copy lost bytes since no longer counts as one.
    pack = next(k for k in objects if "%packs/p00000-" in k)
    p = tmp_path / "dst" / pack
    p.write_bytes(p.read_bytes()[:-1])
    assert not run(tp.holds(b, doc, 0))


def _refused(
    tmp_path: Path, doc: dict[str, Any], objects: dict[str, bytes], match: str, caplog: Any
) -> None:
    dst = tmp_path / "dst"
    b = open_backend(str(dst))
    before = files(tmp_path)
    with (
        caplog.at_level(logging.WARNING, logger="quire"),
        pytest.raises(CorruptCheckpointError, match=match),
    ):
        payload = tp.encode(sorted(objects.items()))
        got = tp.decode(payload, str(dst), "process 3", 0)
        run(tp.receive(b, str(dst), doc, 0, 0, got, "process 3"))
    assert files(tmp_path) == before  # nothing written, here or anywhere else
    assert any("refused the copy of process 0's objects from process 3" in r.message
               for r in caplog.records)  # fmt: skip


def test_names_outside_the_set_are_refused(tmp_path: Path, step: Any, caplog: Any) -> None:
    _, doc, objects = step
    txid = doc["txids"][0]
    for evil in ("../../outside", f"d/{txid}/../../../outside", "/etc/passwd"):
        _refused(tmp_path, doc, {**objects, evil: b"x"}, "unsafe object name", caplog)
    _refused(tmp_path, doc, {**objects, f"d/{txid}/extra": b"x"}, "is not an object", caplog)
    other = f"d/{txid}/%packs/p00001-00000"  # another process's pack, in owner 0's copy
    _refused(tmp_path, doc, {**objects, other: b"x"}, "is not an object", caplog)
    assert not (tmp_path / "outside").exists()


def test_damaged_objects_are_refused(tmp_path: Path, step: Any, caplog: Any) -> None:
    _, doc, objects = step
    pack = next(k for k in objects if "%packs/p00000-" in k)
    index = next(k for k in objects if k.endswith(".index.json"))
    cut = dict(objects)
    cut[pack] = objects[pack][:-5]
    _refused(tmp_path, doc, cut, "fails its check", caplog)
    flipped = bytearray(objects[pack])
    flipped[len(flipped) // 2] ^= 0xFF
    _refused(tmp_path, doc, {**objects, pack: bytes(flipped)}, "fails its check", caplog)
    _refused(tmp_path, doc, {**objects, index: objects[index] + b" "}, "chunk index", caplog)
    missing = {k: v for k, v in objects.items() if k != pack}
    _refused(tmp_path, doc, missing, "is missing", caplog)


def test_malformed_payloads_are_refused(tmp_path: Path, step: Any) -> None:
    _, _, objects = step
    good = tp.encode(sorted(objects.items()))
    deep = b"[" * 100_000
    nested = len(deep).to_bytes(8, "little") + deep
    for bad in (good[:-1], good + b"x", b"\xff" * 8 + good[8:], good[:4], b"", nested):
        with pytest.raises(CorruptCheckpointError, match="malformed payload"):
            tp.decode(bad, "x", "process 1", 0)


def view(steps: dict[int, tuple[str, list[int], list[int]]], persistent: list[int]) -> Any:
    return {
        "steps": {str(s): {"d": d, "need": n, "held": h} for s, (d, n, h) in steps.items()},
        "persistent": persistent,
    }


def test_decide_the_newest_step_every_owner_has_a_holder_for() -> None:
    need = [0, 1, 2, 3]
    # step 5: process 2 died mid-save (no record there, no holder of its objects);
    # step 4: process 2's directory is gone, but process 3 holds a copy of its objects.
    views = [
        view({4: ("a", need, [0, 3]), 5: ("b", need, [0, 3])}, [3]),
        view({4: ("a", need, [1, 0]), 5: ("b", need, [1, 0])}, [3]),
        view({}, [3]),
        view({4: ("a", need, [3, 2]), 5: ("b", need, [3])}, [3]),
    ]
    plan = decide(views, None, 0)
    assert plan is not None and (plan.step, plan.digest) == (4, "a")
    assert sources(views, 4, "a") == {0: 0, 1: 1, 2: 3, 3: 3}
    # asked for step 5 explicitly: nothing restorable
    assert decide(views, 5, 0) is None
    # both holders of process 1's objects lost: the persistent tier's step 3 instead
    views[1] = view({}, [3])
    views[0]["steps"]["4"]["held"] = [0, 3]
    plan = decide(views, None, 0)
    assert plan is not None and (plan.step, plan.digest) == (3, None)
    # ... unless the persistent tier holds step 4 itself: its missing part is read there
    for v in views:
        v["persistent"] = [3, 4]
    plan = decide(views, None, 0)
    assert plan is not None and (plan.step, plan.digest) == (4, None)
    assert sources(views, 4, "a")[1] == PERSISTENT_SOURCE


def test_decide_never_mixes_records() -> None:
    need = [0, 1]
    # the same step number with two different records (an overwrite that did not land
    # everywhere): neither is whole on its own
    views = [view({7: ("a", need, [0])}, []), view({7: ("b", need, [1])}, [])]
    assert decide(views, None, 0) is None


def test_a_malformed_marker_is_none_however_it_is_malformed(step: Any) -> None:
    _, doc, objects = step
    good = json.dumps({"owner": 0, "objects": {k: len(v) for k, v in objects.items()}})
    assert tp.parse_marker(good.encode(), doc, 0) == {k: len(v) for k, v in objects.items()}
    for bad in (b"[" * 100_000, b"\xff", b"[]", b'{"owner": 0}', b'{"owner": 0, "objects": 1}'):
        assert tp.parse_marker(bad, doc, 0) is None
    # a size no object has, or that the request's u64 fields (and the sum of a pull's
    # sizes) could not carry: damaged, so the caller reads the next holder
    key = next(iter(objects))
    assert tp.parse_marker(
        b'{"owner": 0, "objects": {"%s": %d}}' % (key.encode(), 2**63 - 1), doc, 0
    )
    for size in (b"-1", b"1.5", b"true", b"Infinity", b"1e300", b"%d" % 2**63, b"%d" % 2**64):
        raw = b'{"owner": 0, "objects": {"%s": %s}}' % (key.encode(), size)
        assert tp.parse_marker(raw, doc, 0) is None, size
    # a name no stored object has (not UTF-8 text)
    lone = json.dumps({"owner": 0, "objects": {f"{key}\ud800": 1}}).encode()
    assert tp.parse_marker(lone, doc, 0) is None


def test_a_published_view_is_checked_before_anything_uses_it() -> None:
    good = view({4: ("a" * 32, [0, 1], [1]), 10: ("b", [0], [])}, [3, 4])
    assert parse_view(json.dumps(good).encode(), 1, 2) == good
    bad: list[Any] = [
        b"not json",
        b"[" * 100_000,
        b'{"steps": {}, "persistent": [], "steps": {}}',
        json.dumps(None),
        json.dumps({"steps": {}}),
        json.dumps({"steps": [], "persistent": []}),
        json.dumps({"steps": {}, "persistent": [1, "2"]}),
        json.dumps({"steps": {}, "persistent": [-1]}),
        json.dumps({"steps": {}, "persistent": [True]}),
        json.dumps(view({4: ("a", [0, 2], [0])}, [])),  # process 2 of 2
        json.dumps(view({4: ("a", [0], [-1])}, [])),
        json.dumps(view({4: (7, [0], [0])}, [])),  # type: ignore[dict-item]
        json.dumps(view({4: ("a" * 200, [0], [0])}, [])),
        json.dumps({"steps": {"04": {"d": "a", "need": [], "held": []}}, "persistent": []}),
        json.dumps({"steps": {"x": {"d": "a", "need": [], "held": []}}, "persistent": []}),
        json.dumps({"steps": {"4": {"d": "a", "need": []}}, "persistent": []}),
        json.dumps({"steps": {"4": []}, "persistent": []}),
    ]
    for raw in bad:
        with pytest.raises(MultiProcessError, match="process 1 published a malformed view"):
            parse_view(raw if isinstance(raw, bytes) else raw.encode(), 1, 2)


# ----------------------------------------------------------------------------- over TCP
class _Unit:
    """A checkpointable unit with an object of its own (the primary's part)."""

    def quire_save(self, io: Any) -> Any:
        io.write("blob", b"unit bytes" * 100)
        return {"n": 1}

    def quire_restore(self, io: Any, record: Any) -> Any:
        return io.read("blob")


def _holder(tmp_path: Path) -> tuple[Path, str, dict[str, Any]]:
    """A holder's local root with one marked step ``step_1`` (a pytree and a unit)."""
    root = tmp_path / "holder"
    url = str(root / "step_1")
    rng = np.random.default_rng(1)
    quire.save_checkpointables(
        url, {"pytree": {"w": rng.standard_normal((64, 8)).astype(np.float32)}, "u": _Unit()}
    )
    b = open_backend(url)
    doc = json.loads(run(b.get("quire.json")))
    run(tp.mark_own(b, url, doc, 0, 0))
    return root, url, doc


def _pull(tmp_path: Path, root: Path, doc: dict[str, Any], mine: Any, theirs: Any) -> Any:
    """Pull process 0's objects from a server of ``theirs`` credentials, as ``mine``."""
    from quire._peers import link
    from quire._tiers.peer_copies import PeerCopies

    dst = tmp_path / "mine" / "step_1"
    with link.PeerServer(root, theirs) as server:
        pc = object.__new__(PeerCopies)  # the client half only: no key-value store here
        pc.credentials, pc.timeout, pc._addresses = mine, 5.0, {0: server.address}
        return run(pc.pull(open_backend(str(dst)), str(dst), "step_1", doc, 0, 0, 0))


def test_pull_over_tls_copies_the_owner_set(tmp_path: Path) -> None:
    root, _, doc = _holder(tmp_path)
    (p0, p1), _ = run_of(2)
    _pull(tmp_path, root, doc, p1, p0)
    mine = open_backend(str(tmp_path / "mine" / "step_1"))
    assert run(tp.holds(mine, doc, 0))
    got = sorted(files(tmp_path / "mine"))
    assert any("/u/" in k for k in got) and any("%packs/p00000-" in k for k in got), got


def test_pull_refuses_hostile_or_damaged_peers(tmp_path: Path, caplog: Any) -> None:
    from quire.errors import PeerError

    root, _, doc = _holder(tmp_path)
    (p0, p1), _ = run_of(2)
    (other,), _ = run_of(1)
    txid = doc["txids"][0]
    with pytest.raises(PeerError, match="not one of this run's"):  # another run's server
        _pull(tmp_path, root, doc, p1, other)
    with pytest.raises(PeerError, match="not the one process 0 published"):  # not process 0
        _pull(tmp_path, root, doc, p0, p1)
    marker = root / "step_1" / "d" / txid / "%tier" / "p00000.json"
    good_marker = marker.read_bytes()
    for evil in (f"d/{txid}/u/../../../../outside", f"d/{txid}/elsewhere", "../outside"):
        body = json.loads(good_marker)
        body["objects"][evil] = 1
        marker.write_text(json.dumps(body))
        with (
            caplog.at_level(logging.WARNING, logger="quire"),
            pytest.raises(CorruptCheckpointError, match="not an object of its part"),
        ):
            _pull(tmp_path, root, doc, p1, p0)
    marker.write_bytes(good_marker)
    pack = next((root / "step_1" / "d" / txid / "%packs").glob("p00000-*"))
    data = pack.read_bytes()
    pack.write_bytes(data[:100] + bytes([data[100] ^ 1]) + data[101:])  # altered
    with pytest.raises(CorruptCheckpointError, match="fails its check"):
        _pull(tmp_path, root, doc, p1, p0)
    pack.write_bytes(data[:-10])  # truncated: shorter than its index says
    with pytest.raises((CorruptCheckpointError, PeerError)):
        _pull(tmp_path, root, doc, p1, p0)
    assert not (tmp_path / "mine").exists() or files(tmp_path / "mine") == []
    assert not (tmp_path / "outside").exists()
    assert any("refused the copy" in r.message for r in caplog.records)


def test_pull_refuses_a_marker_with_sizes_or_names_no_object_has(
    tmp_path: Path, caplog: Any
) -> None:
    """The holder's marker is untrusted input: a size that is no whole number of bytes below
    2**63 (or sizes adding up past that), or a name that is not UTF-8 text, refuse the copy
    with the ``CorruptCheckpointError`` ``after_commit`` logs before it goes on to its next
    owner, not an OverflowError, struct.error or UnicodeEncodeError out of the save."""
    root, _, doc = _holder(tmp_path)
    (p0, p1), _ = run_of(2)
    marker = root / "step_1" / "d" / doc["txids"][0] / "%tier" / "p00000.json"
    good = json.loads(marker.read_bytes())
    unit = next(k for k in good["objects"] if "/u/" in k)
    loc = unit.rsplit("/", 1)[0]
    big = 2**63 - 1
    bodies = [
        *(json.dumps({"owner": 0, "objects": {unit: n}}) for n in (float("inf"), 2**64, 2**63)),
        *(json.dumps({"owner": 0, "objects": {unit: n}}) for n in (1e300, -1)),
        *(json.dumps({"owner": 0, "objects": {unit: n}}) for n in ("80", 80.0, True, None)),
        json.dumps({"owner": 0, "objects": {unit: big, f"{loc}/b": big, f"{loc}/c": big}}),
        json.dumps({"owner": 0, "objects": {**good["objects"], f"{loc}/\ud800": 1}}),
        json.dumps({"owner": 0, "objects": [unit]}),
    ]
    caplog.set_level(logging.WARNING, logger="quire")
    for body in bodies:
        marker.write_text(body)
        with pytest.raises(CorruptCheckpointError, match="refused the copy of process 0") as e:
            _pull(tmp_path, root, doc, p1, p0)
        assert type(e.value) is CorruptCheckpointError, (body, e.value)
    assert not (tmp_path / "mine").exists() or files(tmp_path / "mine") == []
    marker.write_text(json.dumps(good))  # and the good marker still copies
    _pull(tmp_path, root, doc, p1, p0)
    assert run(tp.holds(open_backend(str(tmp_path / "mine" / "step_1")), doc, 0))
