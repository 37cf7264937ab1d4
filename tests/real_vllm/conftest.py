"""Real vLLM servers (vLLM's own CPU build) on 127.0.0.1, started together once per test run.

`scripts/test_vllm.sh` builds the vLLM environment and sets ROLLOUTS_VLLM_PYTHON; without it these
tests are skipped (the plain suite, `scripts/test.sh`, has no vLLM). Four servers: "tiny" and
"tiny2" (the demo's model shape: head_dim 32, untied; the pool of two), "tied" (the same shape with
a tied LM head) and "smollm2" (the packaged SmolLM2-135M-Instruct, tied; with LoRA on:
`--enable-lora`, adapters loaded at run time, as the LoRA runs need it; the hermes tool parser and
the packaged template that shows SmolLM2 the tools, for the OpenAI agent example). `-O0` skips
vLLM's compile: start-up is then Python imports and a warm-up (tens of seconds each); "tiny2" runs
at vLLM's default level (compiled, as users run it), where seeded requests crashed the CPU engine
with chunked prefill on.

A run starts only the servers its tests use: the tests on "smollm2" are marked `smollm2`, every
other one uses the three tiny servers. `scripts/test_vllm.sh` runs the two sets as two pytest
processes side by side (most of the job's time is SmolLM2's, on one server).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from rollouts.envs.tool_format import packaged_template
from rollouts.models.tiny import TinyModelSpec, make_tiny_model
from rollouts.wire.ports import free_port

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


class VLLMServer:
    """One `scripts/serve_vllm.sh` process group and where it answers."""

    def __init__(
        self,
        name: str,
        model: Path,
        core: int,
        log_dir: Path,
        args: tuple[str, ...] = ("-O0",),
        env: dict[str, str] | None = None,
    ) -> None:
        assert (model / "config.json").is_file(), f"{model}: not an HF model directory"
        self.name, self.model = name, model
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log_dir / f"vllm-{name}.log"
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
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(
                ["bash", str(ROOT / "scripts/serve_vllm.sh"), str(model), str(self.port), *args],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )

    def wait_ready(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"vLLM {self.name} exited {self.proc.returncode}:\n{self.tail()}"
                )
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
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


@pytest.fixture(scope="session")
def vllm_python() -> str:
    python = os.environ.get("ROLLOUTS_VLLM_PYTHON", "")
    if not python or not Path(python).is_file():
        pytest.skip("real vLLM: run scripts/test_vllm.sh (it builds .venv-vllm)")
    return python


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("vllm-models")
    tiny = make_tiny_model(root / "tiny", TinyModelSpec(**DEMO_SHAPE, max_position_embeddings=2048))
    tied = make_tiny_model(
        root / "tied",
        TinyModelSpec(**DEMO_SHAPE, max_position_embeddings=2048, tie_embeddings=True),
    )
    return {"tiny": tiny, "tiny2": tiny, "tied": tied, "smollm2": smollm2_dir}


# name -> (the core its worker is bound to, vLLM arguments, environment); in starting order
SERVERS: dict[str, tuple[int, tuple[str, ...], dict[str, str] | None]] = {
    "tiny": (0, ("-O0",), None),
    "tiny2": (1, (), None),
    "tied": (0, ("-O0",), None),
    "smollm2": (1, ("-O0", *LORA_ARGS, *TOOL_ARGS), LORA_ENV),
}
TINY_SERVERS = ("tiny", "tiny2", "tied")


class Servers(dict[str, VLLMServer]):
    """The servers this run started, by name."""

    def __missing__(self, name: str) -> VLLMServer:
        raise KeyError(
            f"vLLM server {name!r} was not started in this run: a test on 'smollm2' is marked "
            "@pytest.mark.smollm2 (tests/real_vllm/conftest.py starts the servers the run's "
            "tests use), any other test uses the tiny servers"
        )


def servers_used(items: list[pytest.Item]) -> list[str]:
    """The servers the collected tests use: "smollm2" for the marked ones, the tiny three for
    the rest (in SERVERS' order)."""
    marked = {
        it.get_closest_marker("smollm2") is not None for it in items if "vllm" in it.fixturenames
    }
    names = (*(TINY_SERVERS if False in marked else ()), *(("smollm2",) if True in marked else ()))
    return [name for name in SERVERS if name in names]


@pytest.fixture(scope="session")
def vllm(
    request: pytest.FixtureRequest,
    vllm_python: str,
    model_dirs: dict[str, Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Servers]:
    """The servers the run's tests use, started in parallel (workers bound to cores 0 and 1)."""
    logs = tmp_path_factory.mktemp("vllm-logs")
    started = time.monotonic()
    servers = Servers()
    try:
        for name in servers_used(request.session.items):
            core, args, env = SERVERS[name]
            servers[name] = VLLMServer(name, model_dirs[name], core, logs, args, env)
        for server in servers.values():
            server.wait_ready(started + START_TIMEOUT_S)
        took = time.monotonic() - started
        print(f"\n[vllm] {', '.join(servers)} ready in {took:.0f}s", flush=True)
        yield servers
    finally:
        for server in servers.values():
            server.stop()
