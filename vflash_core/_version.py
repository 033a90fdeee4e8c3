"""The package's version (pyproject.toml states the same), apart from the package root so that a module inside can
read it without importing the root, which imports every layer."""

__version__ = "0.1.0"
