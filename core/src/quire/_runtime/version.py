"""The version of the quire distribution (``quire.__version__``), kept apart from the package
face so that the modules writing it into records need not import the package."""

__version__ = "0.1.0"
