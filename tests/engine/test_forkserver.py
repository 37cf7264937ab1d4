"""The forkserver (`rollouts/forkserver/`): a forked engine is the engine a fresh
process starts (the same tokens and logprobs, greedy and seeded; its command line, log and exit
status), it is refused where its imports would differ, and it dies with its launcher; a forked
trainer process trains as a fresh one does; a script gets its argv, sys.path, PYTHONPATH, pipes
and exit status as a fresh interpreter gives them."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from rollouts.engine.launch import (
    ENGINE_PRELOAD,
    EngineProcess,
    EngineStartError,
    engine_env,
    engine_server_sync,
    engine_spec,
    server_command,
    spawn,
    start_engine_sync,
)
from rollouts.forkserver import ENV_VAR, ForkedProcess, fork, popen, start_server
from rollouts.trainer.process import TrainerProcess
from tests.training.backend_helpers import LENGTHS, make_batch, nll_loss, tiny_config

TRAINER_PRELOAD = ("rollouts.trainer.process_child", "rollouts.trainer.factories")


@pytest.fixture(scope="module")
def forkserver() -> Iterator[tuple[subprocess.Popen, Path]]:
    """A forkserver of this module's own (the suite's may be off): its process and folder."""
    tmp = Path(tempfile.mkdtemp(prefix="rollouts-fs-test-"))
    log, preload = str(tmp / "forkserver.log"), (*ENGINE_PRELOAD, *TRAINER_PRELOAD)
    server = start_server(str(tmp / "engines.sock"), engine_env(), log, preload)
    try:
        yield server, tmp
    finally:
        server.terminate()
        server.wait(timeout=10)
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture
def forked(forkserver: tuple[subprocess.Popen, Path], monkeypatch: pytest.MonkeyPatch) -> Path:
    """Engines started in this test are asked of the module's forkserver; its folder."""
    monkeypatch.setenv(ENV_VAR, str(forkserver[1] / "engines.sock"))
    return forkserver[1]


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _generate(proc: EngineProcess, **sampling: object) -> dict:
    body = {
        "input_ids": [5, 9, 13, 2],
        "sampling_params": {"max_new_tokens": 12, **sampling},
        "return_logprob": True,
    }
    reply = httpx.post(f"{proc.url}/generate", json=body, timeout=30.0)
    reply.raise_for_status()
    meta = reply.json()["meta_info"]
    return {"ids": reply.json()["output_ids"], "logprobs": meta["output_token_logprobs"]}


def test_a_forked_engine_serves_what_a_fresh_one_serves(
    tiny_model_dir: Path, forkserver: tuple[subprocess.Popen, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    asks = [{"temperature": 0.0}, {"temperature": 1.0, "sampling_seed": 7, "top_k": 20}]
    outputs, the_spec = {}, engine_spec(tiny_model_dir, max_batch=2)
    for how in ("fresh", "forked"):
        if how == "forked":
            monkeypatch.setenv(ENV_VAR, str(forkserver[1] / "engines.sock"))
        else:
            monkeypatch.delenv(ENV_VAR, raising=False)
        proc = start_engine_sync(the_spec)
        try:
            parent = forkserver[0].pid if how == "forked" else os.getpid()
            assert isinstance(proc.process, ForkedProcess) == (how == "forked")
            assert _parent(proc.process.pid) == parent, how
            outputs[how] = [_generate(proc, **ask) for ask in asks]
            port = int(proc.url.rsplit(":", 1)[1])
            cmdline = Path(f"/proc/{proc.process.pid}/cmdline").read_bytes().rstrip(b"\0")
            assert cmdline.split(b"\0") == [a.encode() for a in server_command(the_spec, port)]
            environ = Path(f"/proc/{proc.process.pid}/environ").read_bytes().split(b"\0")
            shown = dict(item.decode().split("=", 1) for item in environ if item)
            assert shown == engine_env(), how  # what tools that read /proc see (chaos.py)
        finally:
            proc.stop()
        assert proc.process.returncode == -signal.SIGTERM, how
        assert "rollouts engine server on" in proc.log_tail(), how
        proc.discard_log()
    assert outputs["forked"] == outputs["fresh"]
    assert outputs["fresh"][0]["ids"] != outputs["fresh"][1]["ids"]  # the two asks differ


def test_a_forked_engine_reports_its_exit_and_takes_signals_by_pid(
    tiny_model_dir: Path, forked: Path
) -> None:
    with pytest.raises(EngineStartError, match=r"exited with 2 at start:\n.*--cpus '4096'"):
        start_engine_sync(engine_spec(tiny_model_dir, extra_args=["--cpus", "4096"]))
    proc = start_engine_sync(engine_spec(tiny_model_dir))
    assert isinstance(proc.process, ForkedProcess)
    os.kill(proc.process.pid, signal.SIGSTOP)  # as the hung-engine tests do
    with pytest.raises(httpx.TimeoutException):
        httpx.get(f"{proc.url}/health", timeout=1.0)
    assert proc.process.poll() is None
    os.kill(proc.process.pid, signal.SIGCONT)
    assert httpx.get(f"{proc.url}/health", timeout=10.0).status_code == 200
    proc.kill()
    assert proc.process.returncode == -signal.SIGKILL
    proc.kill()  # again: a no-op, not a signal to a reused pid
    proc.discard_log()


def test_an_environment_its_imports_would_read_differently_starts_a_fresh_process(
    tiny_model_dir: Path, forked: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    proc = spawn(engine_spec(tiny_model_dir))
    try:
        assert isinstance(proc.process, subprocess.Popen)
        assert _parent(proc.process.pid) == os.getpid()
    finally:
        proc.kill()
        proc.discard_log()
    log = (forked / "forkserver.log").read_text()
    assert "refused: the environment differs in ['OMP_NUM_THREADS'], read at import time" in log


LAUNCHER = textwrap.dedent(
    """
    import sys, time
    from rollouts.engine.launch import engine_spec, start_engine_sync
    proc = start_engine_sync(engine_spec(sys.argv[1], max_batch=2))
    print(type(proc.process).__name__, proc.process.pid, flush=True)
    time.sleep(600)
    """
)


def test_a_forked_engine_dies_with_its_launcher(tiny_model_dir: Path, forked: Path) -> None:
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, str(tiny_model_dir)], stdout=subprocess.PIPE, text=True
    )
    try:
        kind, pid = (launcher.stdout.readline() if launcher.stdout else "").split()
        assert kind == "ForkedProcess"
        assert Path(f"/proc/{pid}").exists()
    finally:
        launcher.kill()  # SIGKILL: no clean-up of its own runs
        launcher.wait(timeout=10)
    deadline = time.monotonic() + 20
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)  # killed by the forkserver, then reaped by it
    assert not Path(f"/proc/{pid}").exists()


def test_a_server_that_is_not_there_is_said_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    argv = [sys.executable, "-m", "rollouts.engine", "--model", "m"]
    missing = str(tmp_path / "no-server.sock")
    with caplog.at_level("WARNING", logger="rollouts.forkserver.client"):
        for _ in range(2):
            assert fork(argv, dict(os.environ), {0: 0, 1: 1, 2: 2}, missing) is None
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and said[0].startswith(f"forkserver {missing}: "), said
    assert said[0].endswith("processes start fresh"), said


def _one_step(model_dir: Path) -> tuple[str, float, float]:
    """A trainer process's kind and its first step's loss and gradient norm."""
    host = TrainerProcess(threads=1)
    try:
        remote = host.create(tiny_config(model_dir), total_steps=2)
        loss = remote.forward_backward(make_batch(LENGTHS), nll_loss).result()["loss"]
        norm = remote.optim_step().result()["grad_norm"]
        return type(host._process).__name__, loss, norm
    finally:
        host.close()


def test_a_forked_trainer_process_trains_as_a_fresh_one(
    tiny_model_dir: Path, forkserver: tuple[subprocess.Popen, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in engine_env().items():  # the environment the module's server has
        monkeypatch.setenv(name, value)
    monkeypatch.delenv(ENV_VAR, raising=False)
    fresh = _one_step(tiny_model_dir)
    monkeypatch.setenv(ENV_VAR, str(forkserver[1] / "engines.sock"))
    forked = _one_step(tiny_model_dir)
    assert fresh[0] == "Popen" and forked[0] == "ForkedProcess"
    assert forked[1:] == fresh[1:] and fresh[2] > 0


SCRIPT = textwrap.dedent(
    """
    import os, sys
    import helper_mod  # from the PYTHONPATH entry
    print(sys.argv, sys.path[0] == os.path.dirname(os.path.abspath(__file__)), helper_mod.X)
    print(sys.stdin.read().upper(), end="")
    print("to stderr", file=sys.stderr)
    raise SystemExit(int(sys.argv[1]))
    """
)


def test_a_forked_script_gets_what_a_fresh_interpreter_gives(
    forkserver: tuple[subprocess.Popen, Path], tmp_path: Path
) -> None:
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "helper_mod.py").write_text("X = 'helper'\n")
    (tmp_path / "script.py").write_text(SCRIPT)
    env = engine_env() | {"PYTHONPATH": str(tmp_path / "lib")}
    argv = [sys.executable, str(tmp_path / "script.py"), "3", "two words"]
    fresh = subprocess.run(argv, env=env, input="in", capture_output=True, text=True)
    stdin_r, stdin_w = os.pipe()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    os.write(stdin_w, b"in")
    os.close(stdin_w)
    path = str(forkserver[1] / "engines.sock")
    proc = fork(argv, env, {0: stdin_r, 1: out_w, 2: err_w}, path)
    for fd in (stdin_r, out_w, err_w):
        os.close(fd)
    assert isinstance(proc, ForkedProcess)
    with os.fdopen(out_r) as out, os.fdopen(err_r) as err:
        forked = (proc.wait(timeout=60), out.read(), err.read())
    assert forked == (fresh.returncode, fresh.stdout, fresh.stderr)
    assert fresh.returncode == 3 and fresh.stderr == "to stderr\n"
    assert "['" in fresh.stdout and "'3', 'two words'] True helper\nIN" in fresh.stdout


def test_a_pythonpath_entry_that_shadows_a_preloaded_module_is_refused(
    forkserver: tuple[subprocess.Popen, Path], tmp_path: Path
) -> None:
    (tmp_path / "trio.py").write_text("")
    env = engine_env() | {"PYTHONPATH": str(tmp_path)}
    argv = [sys.executable, "-c", "pass"]
    path = str(forkserver[1] / "engines.sock")
    assert fork(argv, env, {0: 0, 1: 1, 2: 2}, path) is None  # an interpreter option
    assert fork([sys.executable, str(tmp_path / "trio.py")], env, {0: 0, 1: 1, 2: 2}, path) is None
    log = (forkserver[1] / "forkserver.log").read_text()
    assert "refused: runs `-m MODULE` or a script, without interpreter options: -c" in log
    assert f"refused: PYTHONPATH entry {tmp_path} holds trio.py, imported from" in log


def test_a_temp_log_goes_with_an_engine_we_stopped_and_stays_when_it_crashed(
    tiny_model_dir: Path, forked: Path, tmp_path: Path
) -> None:
    with engine_server_sync(tiny_model_dir) as proc:
        assert Path(proc.log_path).is_file() and proc.temp_log
    assert not Path(proc.log_path).exists()  # not left in /tmp, run after run
    named = tmp_path / "engine.log"
    with engine_server_sync(tiny_model_dir, log_path=str(named)):
        pass
    assert named.is_file()  # a log the caller named stays
    crashed = spawn(engine_spec(tiny_model_dir, extra_args=["--cpus", "4096"]))
    assert crashed.process.wait(timeout=60) == 2
    crashed.discard_log()
    assert "--cpus" in Path(crashed.log_path).read_text()  # why it exited stays
    Path(crashed.log_path).unlink()


UNBUFFERED = textwrap.dedent(
    """
    import os, sys, time
    print("before the wait", os.getsid(0) == os.getpid())  # no flush: -u writes through
    print("to stderr", file=sys.stderr)
    time.sleep(60)
    """
)


@pytest.mark.parametrize("how", ["-u", "PYTHONUNBUFFERED", "buffered"])
def test_a_forked_program_runs_unbuffered_and_in_its_own_session_as_asked(
    forkserver: tuple[subprocess.Popen, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    how: str,
) -> None:
    """torchrun starts its ranks as `python -u`, tests start runs in sessions of their own
    (`popen(start_new_session=True)`, then `killpg`): each forked as a fresh one would run."""
    script = tmp_path / "unbuffered.py"
    script.write_text(UNBUFFERED)
    argv = [sys.executable, *(["-u"] if how == "-u" else []), str(script)]
    env = {k: v for k, v in engine_env().items() if k != "PYTHONUNBUFFERED"}
    env |= {"PYTHONUNBUFFERED": "1"} if how == "PYTHONUNBUFFERED" else {}
    monkeypatch.setenv(ENV_VAR, str(forkserver[1] / "engines.sock"))
    out = tmp_path / "out.log"
    with out.open("w") as log:
        proc = popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    assert isinstance(proc, ForkedProcess)
    try:
        deadline = time.monotonic() + 30
        while "to stderr" not in out.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        if how == "buffered":  # stdout on a file is block-buffered, as in a fresh interpreter
            assert out.read_text() == "to stderr\n"
        else:
            assert out.read_text() == "before the wait True\nto stderr\n"
        assert os.getsid(proc.pid) == proc.pid
        os.killpg(proc.pid, signal.SIGKILL)  # its session's group: the program itself
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        proc.kill()


RANK = textwrap.dedent(
    """
    import os, signal, sys, time
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(7))
    print(os.getpid(), os.getppid(), flush=True)
    time.sleep(60)
    """
)


@pytest.mark.parametrize(
    "ending", ["SIGTERM to the proxy", "SIGKILL to the program", "SIGKILL to the proxy"]
)
def test_a_program_behind_the_proxy_takes_its_signals_and_gives_its_exit(
    forkserver: tuple[subprocess.Popen, Path], tmp_path: Path, ending: str
) -> None:
    """How torchrun holds a forked rank (`rollouts.forkserver.proxy`): the proxy passes SIGTERM
    on and exits as the program did; a program's death by a signal is the proxy's; a SIGKILLed
    proxy takes its program with it."""
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    env = engine_env() | {ENV_VAR: str(forkserver[1] / "engines.sock")}
    argv = [sys.executable, "-u", "-m", "rollouts.forkserver.proxy", str(script)]
    proxy = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert proxy.stdout is not None
        pid, parent = map(int, proxy.stdout.readline().split())
        assert pid != proxy.pid and parent == forkserver[0].pid  # forked by the server
        if ending == "SIGTERM to the proxy":
            proxy.send_signal(signal.SIGTERM)
            assert proxy.wait(timeout=30) == 7
        elif ending == "SIGKILL to the program":
            os.kill(pid, signal.SIGKILL)
            assert proxy.wait(timeout=30) == -signal.SIGKILL
        else:
            proxy.kill()
            proxy.wait(timeout=30)
        deadline = time.monotonic() + 30
        while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not Path(f"/proc/{pid}").exists(), "the program outlived its proxy"
    finally:
        proxy.kill()
        proxy.wait()


EXITS = textwrap.dedent(
    """
    import sys
    print(sys.argv[1:], flush=True)
    print("to stderr", file=sys.stderr, flush=True)
    raise SystemExit(int(sys.argv[1]))
    """
)


def test_popen_forks_what_it_can_and_starts_the_rest_fresh(
    forkserver: tuple[subprocess.Popen, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`popen` is `subprocess.Popen` for the tests and the chaos run: forked where the server
    takes it (DEVNULL, a file, stderr into stdout), fresh for a pipe or without a server."""
    script = tmp_path / "exits.py"
    script.write_text(EXITS)
    argv = [sys.executable, str(script), "5", "w"]
    env = engine_env()
    monkeypatch.setenv(ENV_VAR, str(forkserver[1] / "engines.sock"))
    quiet = popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    assert isinstance(quiet, ForkedProcess) and quiet.wait(timeout=60) == 5
    out = tmp_path / "out.log"
    with out.open("w") as log:
        logged = popen(argv, env=env, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT)
    assert isinstance(logged, ForkedProcess) and logged.wait(timeout=60) == 5
    assert out.read_text() == "['5', 'w']\nto stderr\n"
    piped = popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    assert isinstance(piped, subprocess.Popen) and piped.communicate(timeout=60)[0]
    monkeypatch.delenv(ENV_VAR)
    fresh = popen(
        argv, env={k: v for k, v in env.items() if k != ENV_VAR}, stdout=subprocess.DEVNULL
    )
    assert isinstance(fresh, subprocess.Popen) and fresh.wait(timeout=60) == 5
