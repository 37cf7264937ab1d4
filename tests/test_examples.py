"""The examples run: `examples/self_correct.py` as `rollout.generate_fn` through train.py."""

from __future__ import annotations

import json
import string
import sys
from pathlib import Path

from rollouts.types import Status
from tests import programs

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "integration_training" / "train.py"


# The untrained tiny model samples bytes about uniformly and rarely emits EOS: ending a turn on
# any letter or digit makes most samples reach the second turn.
STOPS = json.dumps(list(string.ascii_letters + string.digits))


def _config(tmp: Path) -> Path:
    data = tmp / "data"
    text = f"""
[run]
output_dir = "{tmp / "run"}"
[model]
path = "{tmp / "base"}"
[model.tiny]
enabled = true
hidden_size = 32
num_layers = 1
num_heads = 2
intermediate_size = 64
max_position_embeddings = 256
[data]
prepare = "rollouts.data.arithmetic.prepare_addition_data"
sft_path = "{data / "sft.jsonl"}"
train_path = "{data / "train.jsonl"}"
eval_path = "{data / "eval.jsonl"}"
eval_size = 4
[training]
rl_steps = 2
[rollout]
batch_size = 2
n_samples_per_prompt = 2
over_sampling_factor = 1.0
reward_fn = "rollouts.rewards.verifiers.exact_match_reward"
generate_fn = "examples.self_correct.self_correct"
[rollout.sampling]
max_new_tokens = 8
stop = {STOPS}
[engines.builtin]
max_batch = 16
[logging]
rollouts_per_step = 100
"""
    path = tmp / "config.toml"
    path.write_text(text)
    return path


def test_self_correct_example_trains_two_steps(tmp_path: Path) -> None:
    argv = [sys.executable, TRAIN, "--mode", "rl", "--config", _config(tmp_path)]
    done = programs.run(argv, timeout=300, cwd=ROOT)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    run = tmp_path / "run"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert rows[-1]["rollout/failed_samples"] == 0.0, rows[-1]
    samples = [json.loads(line) for line in (run / "rollouts.jsonl").read_text().splitlines()]
    assert len(samples) == 2 * 2 * 2
    assert {s["status"] for s in samples} <= {Status.COMPLETED.value, Status.TRUNCATED.value}
    assert any("user\nCheck your answer" in s["response"] for s in samples), samples[0]
