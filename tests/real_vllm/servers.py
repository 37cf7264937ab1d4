"""The real-vLLM job's four servers: what they serve, how they start, and how a run adopts servers
that were started earlier.

"tiny" and "tiny2" serve the demo's model shape (head_dim 32, untied; the pool of two), "tied" the
same shape with a tied LM head, "smollm2" the packaged SmolLM2-135M-Instruct (tied; with LoRA on:
`--enable-lora`, adapters loaded at run time, as the LoRA runs need it; the hermes tool parser and
the packaged template that shows SmolLM2 the tools, for the OpenAI agent example). `-O0` skips
vLLM's compile: start-up is then Python imports and a warm-up (tens of seconds each); "tiny2" runs
at vLLM's default level (compiled, as users run it), where seeded requests crashed the CPU engine
with chunked prefill on.

Starting four vLLM servers costs about 120 CPU-seconds (80 s on two cores). CI starts them early,
at the lowest priority, while the main suite still runs, so they take only the cores it leaves
idle:

    nice -n 19 python -m tests.real_vllm.servers start runs/vllm-servers

writes `runs/vllm-servers/servers.json` and returns at once; the servers keep starting in their own
sessions. `ROLLOUTS_VLLM_SERVERS=runs/vllm-servers/servers.json` then makes the tests' `vllm`
fixture adopt them: it puts them back at normal priority (they would otherwise lose every core to
the tests' own trainers), waits until they answer, and stops them at the end. Where the priority
cannot be raised again (no CAP_SYS_NICE), it stops them and starts its own, so a test never runs
against a starved server.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from rollouts.envs.tool_format import packaged_template
from rollouts.models.tiny import TinyModelSpec, make_tiny_model

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 420.0
DEMO_SHAPE = dict(hidden_size=128, num_layers=2, num_heads=4, intermediate_size=256)
# LoRA adapters loaded at run time (/v1/load_lora_adapter): the served one and the one before
LORA_ARGS = ("--enable-lora", "--max-lora-rank", "16", "--max-loras", "2")
LORA_ENV = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
# OpenAI tool calls read back from `<tool_call>{json}</tool_call>` (the gateway's format too), and
# SmolLM2's template with the tools in the system message as the agent loop writes them (its own
# template drops `tools`): vLLM builds the prompt the loop and the gateway build
TOOL_ARGS = (
    "--enable-auto-tool-choice",
    "--tool-call-parser",
    "hermes",
    "--chat-template",
    str(packaged_template("smollm2_tools")),
)
# name: (model, vLLM arguments, extra environment); workers on cores 0 and 1 alternately
SERVERS: dict[str, tuple[str, tuple[str, ...], dict[str, str]]] = {
    "tiny": ("tiny", ("-O0",), {}),
    "tiny2": ("tiny", (), {}),
    "tied": ("tied", ("-O0",), {}),
    "smollm2": ("smollm2", ("-O0", *LORA_ARGS, *TOOL_ARGS), LORA_ENV),
}


def quiet_port() -> int:
    """A free port below the kernel's ephemeral range: a server that starts slowly (at low
    priority, while the main suite runs) cannot lose its port to a test's `free_port()`, which
    takes ports from that range."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for _ in range(100):
        port = random.randrange(max(1024, low - 12000), low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port below {low} in 100 tries")


def make_model_dirs(root: Path, smollm2_dir: Path) -> dict[str, Path]:
    """The models the servers serve, by server name (the tiny ones built here, in `root`)."""
    tiny = make_tiny_model(root / "tiny", TinyModelSpec(**DEMO_SHAPE, max_position_embeddings=2048))
    tied = make_tiny_model(
        root / "tied",
        TinyModelSpec(**DEMO_SHAPE, max_position_embeddings=2048, tie_embeddings=True),
    )
    models = {"tiny": tiny, "tied": tied, "smollm2": smollm2_dir}
    return {name: models[spec[0]] for name, spec in SERVERS.items()}


class VLLMServer:
    """One `scripts/serve_vllm.sh` process group (its leader is vLLM's API server) and where it
    answers: started here, or adopted from a `servers.json` another process wrote."""

    def __init__(
        self, name: str, model: Path, port: int, log: Path, proc: subprocess.Popen | None, pid: int
    ) -> None:
        self.name, self.model, self.port, self.log = name, model, port, log
        self.url = f"http://127.0.0.1:{port}"
        self.proc, self.pid = proc, pid  # proc: None when adopted (not this process's child)

    @classmethod
    def start(
        cls,
        name: str,
        model: Path,
        core: int,
        log_dir: Path,
        args: tuple[str, ...] = ("-O0",),
        env: dict[str, str] | None = None,
    ) -> VLLMServer:
        assert (model / "config.json").is_file(), f"{model}: not an HF model directory"
        port = quiet_port()
        log = log_dir / f"vllm-{name}.log"
        env = (
            os.environ
            | {
                "VLLM_VENV": str(Path(os.environ["ROLLOUTS_VLLM_PYTHON"]).parents[1]),
                "VLLM_CPU_OMP_THREADS_BIND": str(core),
                "VLLM_CPU_KVCACHE_SPACE": "1",
                "MAX_MODEL_LEN": "2048",  # room for requests long enough to abort mid-way
            }
            | (env or {})
        )
        env.pop("OMP_NUM_THREADS", None)  # vLLM sets its own (one per bound core)
        with log.open("w") as out:
            proc = subprocess.Popen(
                ["bash", str(ROOT / "scripts/serve_vllm.sh"), str(model), str(port), *args],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        return cls(name, model, port, log, proc, proc.pid)

    @classmethod
    def adopt(cls, record: dict[str, Any]) -> VLLMServer:
        return cls(
            record["name"],
            Path(record["model"]),
            record["port"],
            Path(record["log"]),
            None,
            record["pid"],
        )

    def record(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "model": str(self.model),
            "port": self.port,
            "log": str(self.log),
            "pid": self.pid,
        }

    def exit_status(self) -> str | None:
        """None while the server's leader runs, else how it ended."""
        if self.proc is not None:
            code = self.proc.poll()
            return None if code is None else f"exited {code}"
        try:
            state = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return "is gone"
        return "exited (a zombie)" if state in ("Z", "X") else None

    def raise_priority(self) -> None:
        """Every thread of the server's process group back at nice 0 (raises PermissionError
        without CAP_SYS_NICE)."""
        os.setpriority(os.PRIO_PGRP, self.pid, 0)

    def wait_ready(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            if (status := self.exit_status()) is not None:
                raise RuntimeError(f"vLLM {self.name} {status}:\n{self.tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        raise TimeoutError(f"vLLM {self.name} not ready in {START_TIMEOUT_S}s:\n{self.tail()}")

    def tail(self, lines: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        if self.exit_status() is not None:
            return
        os.killpg(self.pid, signal.SIGTERM)
        deadline = time.monotonic() + 30
        while self.exit_status() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        if self.exit_status() is None:
            os.killpg(self.pid, signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(10)


def start_all(model_dirs: dict[str, Path], log_dir: Path) -> dict[str, VLLMServer]:
    """The four servers, started at once (each in its own session); none is waited for."""
    return {
        name: VLLMServer.start(
            name, model_dirs[name], core=i % 2, log_dir=log_dir, args=args, env=env
        )
        for i, (name, (_, args, env)) in enumerate(SERVERS.items())
    }


def adopt_all(state: Path) -> dict[str, VLLMServer]:
    records = json.loads(state.read_text())["servers"]
    assert sorted(records) == sorted(SERVERS), f"{state}: servers {sorted(records)}"
    return {name: VLLMServer.adopt(record) for name, record in records.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.real_vllm.servers")
    parser.add_argument("command", choices=["start"])
    parser.add_argument("dir", type=Path, help="where the models, logs and servers.json go")
    args = parser.parse_args(argv)
    from rollouts.models.sources import fetch_source

    out: Path = args.dir.resolve()
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("ROLLOUTS_VLLM_PYTHON", str(ROOT / ".venv-vllm/bin/python"))
    model_dirs = make_model_dirs(out / "models", fetch_source("smollm2-135m-instruct"))
    servers = start_all(model_dirs, out)
    state = out / "servers.json"
    tmp = state.with_suffix(".tmp")
    tmp.write_text(
        json.dumps(
            {
                "started": time.time(),
                "vllm_python": os.environ["ROLLOUTS_VLLM_PYTHON"],
                "servers": {name: s.record() for name, s in servers.items()},
            },
            indent=2,
        )
    )
    tmp.rename(state)
    print(f"[vllm-servers] {len(servers)} starting (nice {os.nice(0)}): {state}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
