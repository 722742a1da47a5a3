"""The limits a record is checked against, each derived from what quire's writers produce.

A record's checker (:mod:`quire._format.schema`) refuses a value beyond one of these
bounds as damage or forgery, so a bound must never be below what a writer can put there:
a checkpoint whose record its own load refuses is data lost.  Each bound below is therefore
either out of every writer's reach by construction (the reason is stated next to it, and
``docs/format.md`` "Bounds" gives them all), or the writer that could exceed it imports it
from here and refuses up front, with a typed error, before any data is written.  Both
sides read the same constant; none is copied.

Other lists and strings whose size the user chooses (dict keys, mesh axis names, txids,
handler ids, inline strings) have no bound of their own: a record is read whole
before it is checked, so a long one costs the loader nothing more than its size.
"""

from __future__ import annotations

import re

#: Nesting of the JSON tree.  ``quire._format.tree.walk`` refuses a deeper pytree
#: (``UnsupportedLeafError``) before anything is written; both sides recurse in Python.
MAX_DEPTH = 256

#: Dimensions of an array, and axes of a mesh: numpy's limit (``NPY_MAXDIMS``, 64 since
#: numpy 2).  Every array quire saves passes through numpy, and a mesh's devices are a
#: numpy array, so no writer can exceed it.
MAX_NDIM = 64

#: Devices of a mesh, and JAX processes of a save.  Writers record the mesh an array lives
#: on, at most the machine's devices: the largest JAX machines have about 10**5 devices,
#: over a hundred times fewer.  The bound keeps a forged record from claiming billions of chunks.
MAX_MESH_DEVICES = 1 << 24
MAX_PROCESSES = MAX_MESH_DEVICES

#: A replicated shard is cut into at most this many pieces per process holding a copy of
#: it (``quire._handlers.replicas``: between k and 2k pieces when an exact divisor avoids
#: padding, k = the number of holders).  Read by the writer's split and by
#: :func:`max_chunks`.
PIECES_PER_HOLDER = 2


def max_chunks(devices: int) -> int:
    """The most chunks a saved array sharded over ``devices`` devices can have.

    One chunk per distinct device shard, or, when several processes hold copies of a
    shard (replica-parallel writes), up to :data:`PIECES_PER_HOLDER` pieces per holder.
    A shard has at most as many holders as devices holding it, and the distinct shards
    times the devices holding each is the mesh's device count; so the grid has at most
    ``PIECES_PER_HOLDER * devices`` chunks.
    """
    return PIECES_PER_HOLDER * devices


#: Chunks of an array whose record names no mesh (a numpy array: one chunk; another
#: sharding type: one per device shard, or pieces of them, of at most
#: :data:`MAX_MESH_DEVICES` devices).
MAX_CHUNKS = max_chunks(MAX_MESH_DEVICES)

#: Bytes an array (and a chunk of a non-empty array) may claim: 1 PiB.  A saved array is
#: in the devices' memory when it is saved, and the whole device memory of the largest JAX
#: machines is of that order; a chunk is at most one device shard.  It keeps a forged
#: shape from reaching an allocation.  An empty array allocates nothing and has no chunk:
#: its chunk shape (the shard's, its 0s made 1s) is not bounded.
MAX_CLAIMED_BYTES = 2**50

#: One dimension of a shape: numpy's ``intp`` (an empty array may have any such dimension).
MAX_DIM = 2**63 - 1

#: Bytes of one process's chunk index object: 2 GiB.  An index holds about 200 bytes per
#: chunk (and 8 per inner chunk of a sharded array): ten million chunks of one process,
#: or at the default ``pack_bytes`` some hundreds of TiB of its data.
MAX_INDEX_BYTES = 1 << 31

#: An offset or length inside a stored object (a pack): no object is this large (S3's
#: limit is 5 TiB); a pack is at most ``pack_bytes``, or one chunk (``MAX_CLAIMED_BYTES``).
MAX_OBJECT_BYTES = 1 << 50

#: What ``quire._format.paths`` escapes a key (or a unit's name) to, at most, and an
#: escaped key path (longer ones are cut and end in a hash).
WRITTEN_COMPONENT = 120
WRITTEN_PATH = 700

#: Characters in a leaf's location.  quire writes ``d/<txid>/<unit>/<key path>``, and a
#: finalize that rewrites packs moves a leaf once more, under ``d/<new txid>/``: at most
#: :data:`WRITTEN_LOCATION` (857) characters.
TXID_LENGTH = 16  # quire._engine.save.new_txid: 8 random bytes in hex
WRITTEN_LOCATION = len("d/") + 2 * (TXID_LENGTH + 1) + (WRITTEN_COMPONENT + 1) + WRITTEN_PATH
MAX_LOCATION = 1024

#: Characters in one component of a location: an escaped key (:data:`WRITTEN_COMPONENT`)
#: plus the ``~n`` suffix that keeps siblings apart when their names differ only in case
#: (n, the sibling's rank, has far fewer than 80 digits).
MAX_COMPONENT = 200

#: Characters of a custom pytree node's type name (display only: nothing is imported from
#: it).  ``quire._format.tree.walk`` clips a longer ``module.qualname`` to this.
MAX_TYPE_NAME = 1000

#: Codecs in one leaf's chain (array-to-array, ``bytes``, bytes-to-bytes): every chunk of
#: the leaf goes through each of them, so a forged chain of millions would make every read
#: crawl.  ``quire._handlers.chain.place`` refuses a longer chain (``CodecError``) before
#: anything is written; real chains hold a handful.
MAX_CODECS = 32

#: Characters of one codec's configuration, as JSON: a codec is built from it, and some
#: codecs do work in proportion to it at every chunk (``transpose``'s order).  Real ones are
#: a few numbers and names; ``quire._handlers.chain.place`` refuses a larger one.
MAX_CODEC_CONFIG = 1 << 16

#: Characters of a codec's name in a record (registered names are short identifiers,
#: ``numcodecs.fixedscaleoffset`` is among the longest); the writer refuses a longer one.
MAX_CODEC_NAME = 200

#: Characters of the ISO-8601 timestamps quire writes (``datetime.isoformat``: 32).
MAX_TIMESTAMP = 64

#: Digits of a Python integer stored inline.  Python's JSON parser refuses longer ones
#: (``sys.int_info.default_max_str_digits``); the scalar handler refuses to save them.
MAX_INT_DIGITS = 4300


_DISTRIBUTION = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def is_distribution_name(name: object) -> bool:
    """Whether ``name`` may stand in a record's ``plugins`` as the distribution to install
    (letters, digits, ``.``, ``_``, ``-``: nothing a shell or a URL would read otherwise);
    the writer leaves out a plugin whose distribution's name is not one."""
    return type(name) is str and _DISTRIBUTION.match(name) is not None


#: The PRNG implementations a key can be loaded with (by name, as
#: ``jax.random.wrap_key_data(..., impl=name)`` resolves them) and their key shapes: JAX's
#: built-in ones (``jax.extend.random``'s ``threefry_prng_impl``, ``rbg_prng_impl``,
#: ``unsafe_rbg_prng_impl``; a test holds this table to them), written out so that reading a
#: record needs no JAX.
PRNG_IMPLS: dict[str, tuple[int, ...]] = {"threefry2x32": (2,), "rbg": (4,), "unsafe_rbg": (4,)}


def prng_impls() -> dict[str, tuple[int, ...]]:
    """:data:`PRNG_IMPLS`: the PRNG-key handler refuses to save a key of any other
    implementation, and the record check refuses a key record of any other."""
    return dict(PRNG_IMPLS)
