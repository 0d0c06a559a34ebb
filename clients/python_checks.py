"""The Python clients (openai, its Responses calls, the OpenAI Agents SDK, litellm, LangChain with its
OpenAI, Anthropic and Ollama integrations, ollama, anthropic) against two `corolla api` servers,
as users call them.

Runs inside the clients' own venv (clients/check.py makes it and passes the URLs; the key comes in
COROLLA_CHECK_KEY) and imports nothing of corolla; the checks are in pychecks/, one module per client.
Each check runs on its own: a failure is recorded with its reason and the next check runs. Progress goes
to stderr; the last stdout line is the JSON result: {client: {check: {"ok", "detail", "seconds"}}}.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # else litellm fetches its price list
sys.path.insert(0, str(Path(__file__).resolve().parent))

from pychecks.common import CheckFailed, Setup

SUITES = {"openai": "pychecks.openai_client", "litellm": "pychecks.litellm_client"}
SUITES["langchain"] = "pychecks.langchain_client"
SUITES["ollama"] = "pychecks.ollama_client"
SUITES["anthropic"] = "pychecks.anthropic_client"
SUITES["openai-responses"] = "pychecks.responses_client"
SUITES["openai-agents"] = "pychecks.agents_client"
SUITES["langchain-dialects"] = "pychecks.langchain_dialects_client"
MAX_DETAIL = 600  # characters of an error in the summary


def describe(error: BaseException) -> str:
    """One line: the shape that was wrong, or the client's exception and the line of the check it hit."""
    if isinstance(error, CheckFailed):
        return str(error)
    frames = [f for f in traceback.extract_tb(error.__traceback__) if "pychecks" in f.filename]
    where = f" (at {Path(frames[-1].filename).name}:{frames[-1].lineno})" if frames else ""
    text = " ".join(str(error).split())  # servers' messages can span lines (a grammar, a parser's state)
    if len(text) > MAX_DETAIL:
        text = text[:MAX_DETAIL] + " [...]"
    return f"{type(error).__module__}.{type(error).__name__}: {text}{where}"


def run_checks(client: str, checks: dict[str, Callable[[Setup], str]], setup: Setup) -> dict[str, dict]:
    results = {}
    for name, check in checks.items():
        start = time.monotonic()
        try:
            result = {"ok": True, "detail": check(setup)}
        except Exception as error:  # any failure is this check's result; the next check still runs
            result = {"ok": False, "detail": describe(error)}
        result["seconds"] = round(time.monotonic() - start, 2)
        print(f"  {client} {name}: {'ok' if result['ok'] else 'FAILED'}: {result['detail']}", file=sys.stderr)
        results[name] = result
    return results


def parse_args() -> tuple[Setup, list[str], list[str] | None]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for option in ("--tool-url", "--tool-model", "--smol-url", "--smol-model"):
        parser.add_argument(option, required=True)
    parser.add_argument("--clients", default=",".join(SUITES), help="which clients (default: all)")
    parser.add_argument("--only", help="run only these checks (comma-separated names)")
    args = parser.parse_args()
    setup = Setup(
        os.environ["COROLLA_CHECK_KEY"], args.tool_url, args.tool_model, args.smol_url, args.smol_model
    )
    return setup, args.clients.split(","), (args.only.split(",") if args.only else None)


def main() -> None:
    setup, clients, only = parse_args()
    results: dict[str, dict] = {}
    for client in clients:
        name = f"python-{client}"
        try:
            suite = importlib.import_module(SUITES[client])
        except Exception as error:  # a client that does not import is that client's one failed check
            results[name] = {"import": {"ok": False, "detail": describe(error)}}
            continue
        print(f"  {name} {suite.version()}", file=sys.stderr)
        checks = {k: v for k, v in suite.CHECKS.items() if only is None or k in only}
        results[name] = run_checks(name, checks, setup)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
