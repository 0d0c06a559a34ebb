"""Signals end every process a command started, in bounded time: SIGTERM to the whole process group (what
`timeout` and systemd send), SIGTERM to the command alone (`kill`), SIGHUP (a closed terminal), Ctrl-C.

Each command runs as a real `python -m corolla ...` in a session of its own; the test signals that
process group (or the command's own pid), then checks that every process it had started is gone.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import psutil
import pytest

from byte_tokenizer import byte_tokenizer
from corolla.launch.forked import fork_peer
from corolla.launch.local import LocalSwarm, answers_http, free_port
from swarm_helpers import connect, run_corolla

ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
LOOPBACK = ["--host", "127.0.0.1", "--no-nat-port-map"]


class Command:
    """`corolla ARGS` in a process group of its own, its stdout and stderr in files: forked from the process
    that has imported corolla already (launch/forked.py), as local swarms start their peers."""

    def __init__(self, args: list[str], out_path: Path):
        self.out_path, self.err_path = out_path, out_path.with_suffix(".err")
        self.popen = fork_peer(args, self.out_path, ENV, err_path=self.err_path)
        self.pid = self.popen.pid
        self.family: list[psutil.Process] = []

    def out(self) -> str:
        return self.out_path.read_text(errors="replace")

    def log(self) -> str:
        return self.out() + self.err_path.read_text(errors="replace")

    def wait_for(self, ready, timeout: float = 120) -> None:
        """Until `ready()` (or a text in the log) holds; then note every process the command started."""
        check = (lambda: ready in self.log()) if isinstance(ready, str) else ready
        deadline = time.monotonic() + timeout
        while not check():
            assert self.popen.poll() is None, f"exited early ({self.popen.returncode}):\n{self.log()[-3000:]}"
            assert time.monotonic() < deadline, f"not ready in {timeout}s:\n{self.log()[-3000:]}"
            time.sleep(0.2)
        self.family = [psutil.Process(self.pid), *psutil.Process(self.pid).children(recursive=True)]

    def signal_and_wait(self, sig: int, bound: float, group: bool = True) -> tuple[int, float]:
        """Send `sig` (to the group, or to the command alone); its exit status and how long it took."""
        started = time.monotonic()
        os.killpg(self.pid, sig) if group else os.kill(self.pid, sig)
        try:
            status = self.popen.wait(bound)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running {bound:.0f}s after signal {sig}:\n{self.log()[-3000:]}")
        return status, time.monotonic() - started

    def assert_all_gone(self, bound: float = 10) -> None:
        deadline = time.monotonic() + bound
        while left := [p for p in self.family if _alive(p)]:
            names = [f"{p.pid} {p.name()}" for p in left]
            assert time.monotonic() < deadline, f"left running {bound:.0f}s after the command: {names}"
            time.sleep(0.2)

    def kill(self) -> None:
        """SIGKILL what is left after a failed test: the group, then every process the command had started."""
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for process in self.family:
            try:
                process.kill()
            except psutil.Error:
                pass
        self.popen.wait()


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:  # it has exited already
        pass


def _alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.fixture(scope="module")
def chat_model(tiny_models, tmp_path_factory) -> Path:
    """The tiny llama with a byte-level tokenizer, so that text commands (generate, demo) can run."""
    path = tmp_path_factory.mktemp("chat") / "tiny-chat"
    shutil.copytree(tiny_models["llama"], path)
    byte_tokenizer().save(str(path / "tokenizer.json"))
    return path


@pytest.fixture(scope="module")
def slow_swarm(chat_model):
    """One server for all blocks, slow enough (0.2 s a pass) that a generation can be interrupted."""
    with LocalSwarm(str(chat_model), [(0, 6)], server_args=["--simulate-slow-ms", "200"]) as swarm:
        yield swarm


def test_dht_ends_on_sigterm_to_its_group(tmp_path):
    dht = Command(["dht", *LOOPBACK], tmp_path / "dht.log")
    try:
        dht.wait_for("--initial-peers")
        assert {"python", "p2pd"} <= {p.name() for p in dht.family[1:]}  # its DHT process and daemon
        status, took = dht.signal_and_wait(signal.SIGTERM, bound=20)
        assert status == 0, dht.log()[-3000:]
        dht.assert_all_gone()
        print(f"corolla dht: exited {took:.1f}s after SIGTERM to its group")
    finally:
        dht.kill()


def test_server_ends_on_sigterm_to_its_group(slow_swarm, chat_model, tmp_path):
    args = ["server", str(chat_model), "--blocks", "0:6", "--dht-prefix", "group-sigterm", *LOOPBACK]
    args += ["--num-threads", "1", "--announce-period", "2", "--initial-peers", slow_swarm.initial_peers[0]]
    server = Command(args, tmp_path / "server.log")
    try:
        server.wait_for("corolla server ready")
        status, took = server.signal_and_wait(signal.SIGTERM, bound=30)
        assert status == 0 and "Server stopped" in server.log(), server.log()[-3000:]
        server.assert_all_gone()
        print(f"corolla server: exited {took:.1f}s after SIGTERM to its group")
    finally:
        server.kill()


@pytest.mark.parametrize("group", [False, True], ids=["pid", "group"])
def test_api_sigterm_stops_its_dht_process(slow_swarm, chat_model, tmp_path, group):
    port = free_port()
    args = ["api", str(chat_model), "--port", str(port), "--no-nat-port-map"]
    api = Command([*args, "--initial-peers", slow_swarm.initial_peers[0]], tmp_path / "api.log")
    try:
        api.wait_for(lambda: answers_http(f"http://127.0.0.1:{port}/health"))
        assert "p2pd" in {p.name() for p in api.family}
        status, took = api.signal_and_wait(signal.SIGTERM, bound=30, group=group)
        api.assert_all_gone()
        assert status == 0, api.log()[-3000:]
        print(f"corolla api: exited {took:.1f}s after SIGTERM ({'group' if group else 'pid'})")
    finally:
        api.kill()


def test_demo_sighup_stops_its_whole_swarm(chat_model, tmp_path):
    port = free_port()
    args = ["demo", "hi", "--model", str(chat_model), "--servers", "2", "--max-new-tokens", "2"]
    demo = Command([*args, "--raw", "--api", str(port)], tmp_path / "demo.log")
    try:
        demo.wait_for("Ctrl-C stops everything", timeout=180)
        peers = [p for p in demo.family if "corolla" in " ".join(p.cmdline()) or p.name() == "p2pd"]
        assert sum(p.name() == "p2pd" for p in peers) >= 4  # the DHT peer, 2 servers, the API, the client
        status, took = demo.signal_and_wait(signal.SIGHUP, bound=60)
        demo.assert_all_gone()
        assert status == 128 + signal.SIGHUP, demo.log()[-3000:]
        print(f"corolla demo: exited {took:.1f}s after SIGHUP, {len(demo.family)} processes gone")
    finally:
        demo.kill()


@pytest.mark.parametrize("gap", [None, 0.0, 0.3], ids=["once", "twice-at-once", "twice-apart"])
def test_generate_ctrl_c_exits_quietly_with_130(slow_swarm, chat_model, tmp_path, gap):
    """Ctrl-C once, or twice: `timeout -s INT` signals the command, then its group, at once; a user presses
    Ctrl-C again while the first one is being handled."""
    args = ["generate", str(chat_model), "hello", "--raw", "--max-new-tokens", "200", "--no-nat-port-map"]
    generate = Command([*args, "--initial-peers", slow_swarm.initial_peers[0]], tmp_path / "generate.log")
    try:
        generate.wait_for(lambda: generate.out(), timeout=120)  # the first generated characters
        if gap is not None:  # a second one, to the group, after the first to the command alone
            threading.Timer(gap, _signal_group, (generate.pid, signal.SIGINT)).start()
        status, took = generate.signal_and_wait(signal.SIGINT, bound=20, group=gap is None)
        assert status == 130, generate.log()[-3000:]
        assert "Traceback" not in generate.log() and "Error" not in generate.log(), generate.log()[-3000:]
        generate.assert_all_gone()
        print(f"corolla generate: exited {took:.1f}s after Ctrl-C ({gap=})")
    finally:
        generate.kill()


def test_generate_stream_ctrl_c_raises_keyboard_interrupt(slow_swarm, chat_model, terminal_sigint):
    with connect(chat_model, slow_swarm) as model:
        stream = model.generate_stream([104, 105], max_new_tokens=200)
        next(stream)  # generation has started; the next step is in flight when the signal comes
        main = threading.main_thread().ident
        threading.Timer(0.3, signal.pthread_kill, (main, signal.SIGINT)).start()
        started = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            for _ in stream:
                pass
        assert time.monotonic() - started < 10
        assert model.generate([104, 105], max_new_tokens=1).shape == (1, 3)


def test_generate_without_initial_peers_says_so_at_once(chat_model):
    started = time.monotonic()
    (result,) = run_corolla(["generate", str(chat_model), "hi", *LOOPBACK], timeout=60)
    took = time.monotonic() - started
    assert result.returncode == 2 and "--initial-peers" in result.stderr, result.stderr[-3000:]
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert took < 20, f"took {took:.1f}s"
