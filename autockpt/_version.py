"""The library's version, on the ground floor: ``autockpt.__version__`` and every plan read it
here (a module inside the package must not import the package root)."""

__version__ = "0.1.0"
