"""A node is two processes: its HTTP front (the pid `hybridpd serve` started as) and its engine process. Whatever
happens to one, nothing is left behind and no request waits forever:
- SIGKILL of the front (the fault matrix's crash): the engine process dies with it, its side channel port is free;
- SIGKILL of the engine process: a request in flight ends with an error and the front exits 1 on its own, so that
  a supervisor restarts the whole node;
- SIGSTOP of the engine process: `/health` answers 503 once its heartbeats stop, 200 again after SIGCONT;
- SIGTERM: both exit 0, the engine process after the front's drain;
- a checkpoint the engine rejects: the CLI's error and exit 2; an HTTP port already taken: the CLI's error and
  exit 1, the engine process told to stop at once (no process left either way).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from hybridpd.presets.checkpoints import write_checkpoint
from tests.e2e.nodes import NodeProcess, process_tree, start_node

SERVE_ARGS = ["--num-blocks", "256", "--max-model-len", "512"]
WAIT_S = 30.0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_checkpoint("tiny", tmp_path_factory.mktemp("model"))


def engine_pid(node: NodeProcess) -> int:
    tree = process_tree(node.proc.pid)
    assert len(tree) == 2, f"a node is its front and one engine process: {tree}"
    return tree[1]


def gone(pid: int) -> bool:
    try:
        stat = open(f"/proc/{pid}/stat").read()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"   # exited, not yet reaped


def wait_for(predicate, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def health(node: NodeProcess) -> int:
    try:
        with urllib.request.urlopen(node.url + "/health", timeout=5) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code


def health_reason(node: NodeProcess) -> str:
    try:
        with urllib.request.urlopen(node.url + "/health", timeout=5) as resp:
            return resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.read().decode()


def thread_names(pid: int) -> set[str]:
    """The operating-system names of a process's threads (what top -H and ps -L show)."""
    return {(task / "comm").read_text().strip() for task in Path(f"/proc/{pid}/task").iterdir()}


def test_the_engine_process_dies_with_its_front(model_dir, tmp_path):
    node = start_node(model_dir, tmp_path, SERVE_ARGS)
    try:
        engine = engine_pid(node)
        assert node.post_json("/v1/completions", {"prompt": "hi", "max_tokens": 2})[0] == 200
        # an operator tells the engine process and its threads apart by name
        assert Path(f"/proc/{engine}/comm").read_text().strip() == "engine-process"
        assert {"engine-process", "engine", "engine-link", "engine-beat"} <= thread_names(engine)
        assert "engine-link" in thread_names(node.proc.pid)   # the front's end of the link
        node.proc.kill()
        node.proc.wait(timeout=WAIT_S)
        wait_for(lambda: gone(engine), "the engine process to exit after its front's SIGKILL")
        wait_for(lambda: port_free(node.kv_port), "the side channel port to be free")
    finally:
        node.kill()


def test_a_dead_engine_process_fails_requests_in_flight_and_the_front_exits_for_a_restart(model_dir, tmp_path):
    # A request long enough (thousands of decode steps) to be still running when the test kills the engine.
    node = start_node(model_dir, tmp_path, ["--num-blocks", "512", "--max-model-len", "4096"])
    try:
        engine = engine_pid(node)
        answers: list[tuple[int, dict]] = []
        long_request = threading.Thread(target=lambda: answers.append(node.post_json(
            "/v1/completions", {"prompt": "once upon a time", "max_tokens": 4000, "ignore_eos": True},
            timeout=WAIT_S * 4)))
        long_request.start()
        wait_for(lambda: sum(node.metric_values("vllm:num_requests_running").values()) == 1, "the request to run")
        os.kill(engine, signal.SIGKILL)
        long_request.join(WAIT_S * 4)
        assert not long_request.is_alive()
        status, body = answers[0]
        assert status == 500 and "engine" in body["error"]["message"], (status, body)
        assert node.proc.wait(timeout=WAIT_S) == 1, node.log_tail()     # it exits by itself: its engine had died
        assert "the engine process died" in node.log_path.read_text()
    finally:
        node.kill()


def test_a_stopped_engine_process_makes_the_node_unhealthy_until_it_runs_again(model_dir, tmp_path):
    node = start_node(model_dir, tmp_path, [*SERVE_ARGS, "--engine-heartbeat-timeout", "2"])
    try:
        engine = engine_pid(node)
        assert health(node) == 200
        os.kill(engine, signal.SIGSTOP)
        try:
            wait_for(lambda: health(node) == 503, "/health to answer 503 once the heartbeats stop")
            assert "no heartbeat" in health_reason(node)
        finally:
            os.kill(engine, signal.SIGCONT)
        wait_for(lambda: health(node) == 200, "/health to answer 200 once the engine runs again")
        assert node.post_json("/v1/completions", {"prompt": "hi", "max_tokens": 2})[0] == 200
    finally:
        node.kill()


def test_sigterm_stops_both_processes(model_dir, tmp_path):
    node = start_node(model_dir, tmp_path, SERVE_ARGS)
    try:
        engine = engine_pid(node)
        node.proc.send_signal(signal.SIGTERM)
        assert node.proc.wait(timeout=WAIT_S) == 0, node.log_tail()
        assert gone(engine)            # the front waits for its engine process before it exits
        assert "engine stopped" in node.log_path.read_text()
    finally:
        node.kill()


def engine_processes_of(front_pid: int) -> list[int]:
    """Engine processes started by the front `front_pid` (their command line names it), alive or not reaped."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                argv = open(f"/proc/{entry}/cmdline", "rb").read().split(b"\0")
            except OSError:
                continue
            if b"hybridpd.server.engine_process" in argv and argv[-2:-1] == [str(front_pid).encode()]:
                found.append(int(entry))
    return found


def serve_until_exit(model: Path, port: int, args: list[str] = SERVE_ARGS) -> tuple[int, str]:
    """`hybridpd serve` that is expected to fail: its exit code and stderr, once no engine process of it is left."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "hybridpd", "serve", str(model), "--port", str(port), "--kv-port", "0", *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert engine_processes_of(proc.pid) == []
    return proc.returncode, stderr


def test_a_checkpoint_the_engine_rejects_is_a_cli_error(model_dir, tmp_path):
    """The front only checks that the directory exists; the engine process reads the checkpoint and refuses it, and
    the front turns that into the CLI's error line and exit 2."""
    broken = tmp_path / "broken"
    shutil.copytree(model_dir, broken)
    (broken / "model.safetensors").unlink()
    code, stderr = serve_until_exit(broken, 0)
    assert code == 2, stderr[-2000:]
    assert "hybridpd serve: error:" in stderr and "neither model.safetensors" in stderr, stderr[-2000:]


def test_an_http_port_already_taken_is_a_cli_error_and_stops_the_engine_process(model_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        code, stderr = serve_until_exit(model_dir, taken.getsockname()[1])
    assert code == 1, stderr[-2000:]
    assert "hybridpd serve: error:" in stderr and "address already in use" in stderr.lower(), stderr[-2000:]


def test_a_cache_that_cannot_hold_one_max_length_request_is_a_cli_error_naming_the_flags(model_dir, tmp_path):
    """As vLLM refuses at start-up: the node never starts in a state where every long prompt would get a 400."""
    code, stderr = serve_until_exit(model_dir, 0, ["--kv-cache-memory", "1MiB", "--max-model-len", "4096"])
    assert code == 2, stderr[-2000:]
    assert "hybridpd serve: error:" in stderr and "--kv-cache-memory" in stderr and "--max-model-len" in stderr, \
        stderr[-2000:]
