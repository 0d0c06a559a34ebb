"""corolla's version: what servers announce and `corolla --version` prints."""

__version__ = "0.1.0"
