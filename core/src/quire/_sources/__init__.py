"""Read-only lazy views of checkpoints of any format: lazy values and their ops (``lazy``),
materialising them into arrays (``materialize``), the source contract (``base``) and
``quire.open`` (``opening``), quire's own and safetensors sources (``native``,
``safetensors``; which local links a source follows: ``symlinks``), model surgery
(``surgery``), partition rules (``partition``), a zarr store over a checkpoint (``zarrstore``), ``quire.diff`` (``diff``), ``quire.export`` (``export``)
and writing any source as a quire checkpoint (``convert``).

May import: ``quire._runtime``, ``quire._store``, ``quire._format``, ``quire._handlers``,
``quire._engine`` and quire's contract modules.
"""
