"""Headless Chromium for the tests of the API's pages: Debian's `chromium` package (`make test` installs it
when it can), allowed to talk to 127.0.0.1 only: every other host resolves to nothing and a dead local
proxy takes any other traffic."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

ARTIFACTS = Path(os.environ.get("COROLLA_TEST_ARTIFACTS", Path(__file__).parents[1] / "test-artifacts"))
LOOPBACK_ONLY = [
    "--headless",
    "--no-sandbox",  # tests run as root in CI
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-default-apps",
    "--disable-sync",
    "--metrics-recording-only",
    "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
    "--proxy-server=http://127.0.0.1:9",  # loopback bypasses proxies; anything else goes nowhere
]


def chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        pytest.fail("headless Chromium is needed: apt-get install chromium (make test does this as root)")
    return path
