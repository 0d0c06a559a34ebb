"""The coding agents' own command-line programs in non-interactive mode against `corolla api`: OpenAI's Codex
CLI (`codex exec`, the Responses API) and Anthropic's Claude Code (`claude -p`, the Messages API), from the
npm packages clients/package-lock.json pins.

clients/check.py runs it with corolla's python (the standard library is all it needs) inside a network
namespace where only loopback is up, so the programs run without reaching any other host; it passes
--url/--model of an API serving SmolLM2 with `--chat-template chatml-tools` (so that the agents' tools reach
the model) and `--default-temperature 0` (neither program sends a temperature, and greedy answers can be
checked); the key comes in COROLLA_CHECK_KEY. Each program gets a home of its own in a temporary folder.
Progress goes to stderr; the last stdout line is the JSON result: {program: {check: {"ok", "detail",
"seconds"}}}.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

BIN = Path(__file__).resolve().parent / "node_modules" / ".bin"
QUESTION = "What is the capital of France?"
# SmolLM2's own default system prompt: the agents' long ones (Codex's ~18 KB of instructions) leave a
# 135M-parameter model too little of its 8192 positions and too confused to end its answer
SMOL_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
TIMEOUT = 240.0  # seconds per program run: Codex's prompt is ~5,400 tokens, prefilled on two CPU cores


class CheckFailed(Exception):
    pass


class Agents:
    def __init__(self, url: str, model: str, key: str, home: Path):
        self.url, self.model, self.key, self.home = url, model, key, home

    def run(self, program: str, args: list[str], env: dict[str, str]) -> str:
        """The program's stdout; CheckFailed with its stderr's tail unless it exits with 0."""
        home = self.home / program
        home.mkdir(exist_ok=True)
        environment = {"PATH": os.environ["PATH"], "HOME": str(home), "COROLLA_CHECK_KEY": self.key, **env}
        try:
            done = subprocess.run(
                [str(BIN / program), *args],
                capture_output=True,
                text=True,
                env=environment,
                cwd=home,
                timeout=TIMEOUT,
                stdin=subprocess.DEVNULL,
            )
        except subprocess.TimeoutExpired:
            raise CheckFailed(f"{program} still running after {TIMEOUT:.0f}s") from None
        if done.returncode != 0:
            tail = " ".join((done.stderr + done.stdout)[-600:].split())
            raise CheckFailed(f"{program} exited with {done.returncode}: {tail}")
        return done.stdout

    # --- Codex CLI ------------------------------------------------------------------------------------------

    def codex(self) -> str:
        """`codex exec` with corolla as its model provider (the Responses API): Codex's whole default tool
        set goes with the question (its sub-agent tools as a namespace); the answer names Paris."""
        codex_home = self.home / "codex-home"
        codex_home.mkdir(exist_ok=True)
        (codex_home / "instructions.md").write_text(SMOL_SYSTEM + "\n")
        (codex_home / "config.toml").write_text(
            f'model = "{self.model}"\n'
            'model_provider = "corolla"\n'
            'web_search = "disabled"\n'  # a built-in tool corolla refuses: it has no search engine
            f'model_instructions_file = "{codex_home / "instructions.md"}"\n'
            "[model_providers.corolla]\n"
            'name = "corolla"\n'
            f'base_url = "{self.url}"\n'
            'env_key = "COROLLA_CHECK_KEY"\n'
            'wire_api = "responses"\n'
        )
        args = ["exec", "--json", "--skip-git-repo-check", "--sandbox", "read-only", QUESTION]
        events = [
            json.loads(line) for line in self.run("codex", args, {"CODEX_HOME": str(codex_home)}).splitlines()
        ]
        answers = [e["item"]["text"] for e in events if e.get("item", {}).get("type") == "agent_message"]
        usage = next((e["usage"] for e in events if e.get("type") == "turn.completed"), None)
        if not answers or "Paris" not in answers[-1] or usage is None:
            raise CheckFailed(f"no answer naming Paris in a completed turn: {events[-3:]}")
        return (
            f"{answers[-1]!r}; {usage['input_tokens']} input tokens ({usage['cached_input_tokens']} cached)"
        )

    # --- Claude Code ----------------------------------------------------------------------------------------

    def claude(self, tools: str) -> str:
        """`claude -p` against corolla (the Messages API) with `tools` (Claude Code's tool names, "" none):
        the turn completes without an error and its result names Paris."""
        env = {
            "ANTHROPIC_BASE_URL": self.url.removesuffix("/v1"),
            "ANTHROPIC_API_KEY": self.key,
            "ANTHROPIC_MODEL": self.model,
            "ANTHROPIC_DEFAULT_HAIKU_MODEL": self.model,  # its background calls (titles) too
            "CLAUDE_CONFIG_DIR": str(self.home / "claude-config"),
            "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "300",  # its default, 32,000, is more than the context
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            "DISABLE_TELEMETRY": "1",
        }
        args = ["-p", "--tools", tools, "--system-prompt", SMOL_SYSTEM, "--output-format", "json", QUESTION]
        result = json.loads(self.run("claude", args, env).strip().splitlines()[-1])
        if result.get("is_error") or "Paris" not in (result.get("result") or ""):
            raise CheckFailed(f"no answer naming Paris: {json.dumps(result)[:400]}")
        usage = result.get("usage") or {}
        tokens = usage.get("input_tokens", 0) + usage.get("cache_read_input_tokens", 0)
        return f"{result['result']!r}, stop reason {result.get('stop_reason')}; {tokens} input tokens"


def run_check(check: Callable[[], str]) -> dict:
    start = time.monotonic()
    try:
        result = {"ok": True, "detail": check()}
    except Exception as error:  # any failure is this check's result; the next check still runs
        result = {"ok": False, "detail": f"{type(error).__name__}: {error}"}
    result["seconds"] = round(time.monotonic() - start, 2)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True, help="the API's base URL, ending in /v1")
    parser.add_argument("--model", required=True, help="the served model name")
    args = parser.parse_args()
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="corolla-agents-") as home:
        agents = Agents(args.url, args.model, os.environ["COROLLA_CHECK_KEY"], Path(home))
        checks = {
            "codex-cli": {"answer": agents.codex},
            "claude-code": {
                "answer": lambda: agents.claude(""),
                "answer_with_bash_tool": lambda: agents.claude("Bash"),  # its tool's schema goes through
            },
        }
        for program, program_checks in checks.items():
            for name, check in program_checks.items():
                result = run_check(check)
                status = "ok" if result["ok"] else "FAILED"
                print(f"  {program} {name}: {status}: {result['detail']}", file=sys.stderr, flush=True)
                results.setdefault(program, {})[name] = result
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
