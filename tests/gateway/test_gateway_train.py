"""train.py --mode rl through the gateway: examples/openai_agent.py's episodes are trained."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from rollouts.types import Status
from tests import programs

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ROOT / "integration_training" / "train.py"


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
max_position_embeddings = 1024
[data]
prepare = "examples.openai_agent_data.prepare"
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
max_total_tokens = 900
reward_fn = "rollouts.rewards.verifiers.exact_match_reward"
generate_fn = "rollouts.gateway.agent_generate"
[rollout.gateway]
agent = "examples.openai_agent.solve"
[rollout.sampling]
max_new_tokens = 8
[engines.builtin]
max_batch = 16
[logging]
rollouts_per_step = 100
"""
    path = tmp / "config.toml"
    path.write_text(text)
    return path


def test_rl_through_the_gateway_trains_two_steps(tmp_path: Path) -> None:
    argv = [sys.executable, TRAIN, "--mode", "rl", "--config", _config(tmp_path)]
    done = programs.run(argv, timeout=300, cwd=ROOT)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    run = tmp_path / "run"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert rows[-1]["rollout/failed_samples"] == 0.0, rows[-1]
    # agent/* figures of the gateway's episodes, as of the agent loop's
    for row in rows[1:]:
        assert row["agent/episodes"] >= 4, row
        assert row["agent/turns_mean"] >= 1.0, row
        assert "agent/tool_calls_mean" in row and "agent/end/answer" in row, row
    samples = [json.loads(line) for line in (run / "rollouts.jsonl").read_text().splitlines()]
    assert len(samples) == 2 * 2 * 2
    assert {s["status"] for s in samples} <= {Status.COMPLETED.value, Status.TRUNCATED.value}
    for s in samples:  # the agent's conversation, and the tools in the trained prompt
        assert s["messages"][0] == {"role": "user", "content": s["prompt"][0]["content"]}
        assert s["messages"][1]["role"] == "assistant", s["messages"]
        assert s["calls"] >= 1
