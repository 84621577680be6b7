"""splash's version: a leaf, so the server can report it without importing the package facade."""

__version__ = "0.1.0"
