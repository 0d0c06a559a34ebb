"""The inference service fixture (tests/service_helpers.py) for the server's unit tests."""

from service_helpers import service  # noqa: F401
