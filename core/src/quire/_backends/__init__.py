"""First-party backends (registered through the ``quire.backends`` entry points)."""
