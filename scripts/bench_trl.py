"""Benchmark: `rollouts` (sync and async) against TRL's GRPOTrainer, on the same RL workload.

Issue 29: the same model, prompts, reward, batch and new tokens; each system a separate process
on the whole machine with its own defaults. Per round, in a rotating order:
  trl    TRL 1.16 GRPOTrainer in .venv-trl (scripts/trl_env.sh builds it; scripts/trl_worker.py
         runs it): one generation batch and one optimizer step per training step, beta = 0;
  sync   integration_training/train.py --mode rl with rollout.mode = "sync" (default placement:
         training.cpu_placement = "auto");
  async  the same with rollout.mode = "async".
Cases: A, the demo's tiny Llama built by the tiny-model kit (configs/demo-cpu.toml) on the
addition prompts, 16 prompts x 8 samples, 64 new tokens; B, SmolLM2-135M-Instruct
(configs/smollm2-cpu.toml, `rollouts models fetch smollm2-135m-instruct`) on the chat sums,
4 prompts x 4 samples, 48 new tokens. Both: temperature 1, GRPO with no KL term, the lr of the
case's config, the exact-match reward. The model and the prompts are built here, with the
project's venv; TRL gets their paths and the project's token ids of each prompt (it checks its
own tokenization against them).

Each system runs --warmup + --steps steps (rollouts one more: its last step also saves the
final checkpoint); the --steps timed ones give medians: seconds per step, samples/s (samples
per step / median step), generate and train seconds per step. A round's table ends with the
ratios rollouts / TRL in samples/s; with --rounds > 1 the medians over rounds follow. Targets
(issue 29): sync >= 1.2x TRL, async >= 1.5x TRL. Timings mean something only on a quiet machine.

    python scripts/bench_trl.py --case A|B [--steps 6] [--warmup 2] [--rounds 3]
                                [--trl-precision default|fp32]
                                [--systems trl,sync,async] [--model DIR] [--work DIR]
                                [--set KEY=VALUE ...]   # the rollouts runs' config
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's package, as integration_training/train.py runs it

from rollouts.config import Config, load_config  # noqa: E402
from rollouts.data.loaders import load_prompts  # noqa: E402
from rollouts.data.sft import tokenize_prompt  # noqa: E402
from rollouts.driver.setup import prepare_base_model, prepare_data  # noqa: E402
from rollouts.trainer.factories import load_tokenizer  # noqa: E402

TRL_PYTHON = ROOT / ".venv-trl" / "bin" / "python"
SYSTEMS = ("trl", "sync", "async")
TARGETS = {"sync": 1.2, "async": 1.5}  # samples/s against TRL (issue 29)
LEGEND = """samples: per step; len: mean completion tokens; step_s: median seconds per step;
samples_per_s: samples / step_s; generate_s: generating the step's batch (trl: generate, rewards
and advantages; async: overlapped with training, wait_s is what the step waited for it);
train_s: rollouts' trainer step; trl: the rest of its step (forward, backward, optimizer step);
model_generate_s: trl's model.generate alone; trained: a nonzero gradient in a timed step"""
COLUMNS = ("samples", "len", "step_s", "samples_per_s", "generate_s", "train_s", "grad_norm")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Case:
    """One workload: a config of the project and the batch shape both systems run."""

    title: str
    config: str  # relative to the repository root
    prompts_per_step: int
    samples_per_prompt: int
    max_new_tokens: int
    temperature: float = 1.0
    tiny: bool  # the model is built by the tiny-model kit (into the work directory)


CASES = {
    "A": Case(
        title="A: tiny Llama (demo), 16 prompts x 8 samples, 64 new tokens",
        config="configs/demo-cpu.toml",
        prompts_per_step=16,
        samples_per_prompt=8,
        max_new_tokens=64,
        tiny=True,
    ),
    "B": Case(
        title="B: SmolLM2-135M-Instruct, 4 prompts x 4 samples, 48 new tokens",
        config="configs/smollm2-cpu.toml",
        prompts_per_step=4,
        samples_per_prompt=4,
        max_new_tokens=48,
        tiny=False,
    ),
}


def overrides(case: Case, work: Path, model: str, rl_steps: int) -> list[str]:
    """`--set` keys of the case's config: the workload, paths in `work`, no eval or checkpoints."""
    samples = case.prompts_per_step * case.samples_per_prompt
    data = work / "data"
    keys = [
        f"rollout.batch_size={case.prompts_per_step}",
        f"rollout.n_samples_per_prompt={case.samples_per_prompt}",
        "rollout.over_sampling_factor=1.0",
        f"rollout.max_concurrency={max(samples, 64)}",
        f"engines.builtin.max_batch={max(samples, 64)}",
        f"rollout.sampling.max_new_tokens={case.max_new_tokens}",
        f"rollout.sampling.temperature={case.temperature}",
        "algorithm.advantage='grpo'",
        "algorithm.kl.coef=0.0",
        f"training.rl_steps={rl_steps}",
        "training.eval_every=0",
        "checkpoint.every=0",
        "data.eval_size=4",
        f"data.train_path='{data / 'train.jsonl'}'",
        f"data.eval_path='{data / 'eval.jsonl'}'",
    ]
    if case.tiny:
        keys.append(f"data.sft_path='{data / 'sft.jsonl'}'")
    if model:
        keys += [f"model.path='{model}'", "model.source=''", "model.tiny.enabled=false"]
    elif case.tiny:
        keys.append(f"model.path='{work / 'model'}'")
    return keys


def case_config(case: Case, work: Path, model: str, run_dir: Path, rl_steps: int) -> Config:
    """The case's config with `overrides` and the run directory."""
    keys = [*overrides(case, work, model, rl_steps), f"run.output_dir='{run_dir}'"]
    return load_config(ROOT / case.config, keys)


def prepare(case: Case, work: Path, model: str) -> tuple[Path, Path]:
    """Build the model and the data with the project's kit; write TRL's prompts file (chat
    messages, label and the project's token ids). Returns (model dir, prompts file)."""
    config = case_config(case, work, model, work / "prepare", 1)
    prepare_data(config)
    model_dir = prepare_base_model(config)
    tokenizer = load_tokenizer(model_dir)
    items = load_prompts(config.data.train_path)
    prompts = work / "trl-prompts.jsonl"
    with prompts.open("w") as f:
        for it in items:
            prompt = it.prompt if isinstance(it.prompt, str) else [dict(m) for m in it.prompt]
            ids = tokenize_prompt(tokenizer, it.prompt)
            f.write(json.dumps({"prompt": prompt, "label": it.label, "prompt_ids": ids}) + "\n")
    print(f"[bench] model {model_dir}; {len(items)} prompts in {config.data.train_path}")
    return model_dir, prompts


def run_logged(command: list[str], log: Path, env: dict[str, str] | None = None) -> None:
    """Run `command` from the repository root, its output into `log`; exit on failure."""
    with log.open("w") as out:
        done = subprocess.run(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env)
    if done.returncode != 0:
        tail = "\n".join(log.read_text().splitlines()[-30:])
        sys.exit(f"{command[1]} failed ({done.returncode}); the end of {log}:\n{tail}")


def run_rollouts(case: Case, args: argparse.Namespace, mode: str, run_dir: Path) -> list[dict]:
    """train.py --mode rl in `mode`; the timed steps' rows of its metrics.jsonl."""
    rl_steps = args.warmup + args.steps + 1  # the last step also saves the final checkpoint
    keys = [*overrides(case, args.work, args.model, rl_steps), f"run.output_dir='{run_dir}'"]
    keys += [f"rollout.mode='{mode}'", "run.overwrite=true", *args.set]
    command = [sys.executable, "integration_training/train.py", "--mode", "rl"]
    command += ["--config", case.config] + [a for k in keys for a in ("--set", k)]
    run_logged(command, run_dir.with_suffix(".log"))
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    rows = [r for r in map(json.loads, lines) if r["step"] >= 1 and "perf/step_time_s" in r]
    assert len(rows) == rl_steps, f"{len(rows)=} step rows, {rl_steps=} ({run_dir})"
    timed = rows[args.warmup : args.warmup + args.steps]
    updates = [r["train/updates"] for r in timed]
    assert all(u == 1.0 for u in updates), f"{updates=}: one optimizer step per batch expected"
    overlapped = "time/generate_overlapped_s" if mode == "async" else "time/generate_s"
    return [
        {
            "samples": r["rollout/num_samples"],
            "len": r["rollout/response_length_mean"],
            "step_s": r["perf/step_time_s"],
            "generate_s": r[overlapped],
            "wait_s": r["time/generate_s"],
            "train_s": r["time/train_s"],
            "grad_norm": r["train/grad_norm"],
            "loss": r["train/loss"],
            "reward": r["reward/mean"],
        }
        for r in timed
    ]


def run_trl(case: Case, args: argparse.Namespace, run_dir: Path) -> list[dict]:
    """scripts/trl_worker.py in .venv-trl; its timed steps."""
    run_dir.mkdir(parents=True, exist_ok=True)
    config = case_config(case, args.work, args.model, run_dir, 1)
    spec = {
        "model": str(args.model_dir),
        "prompts": str(args.prompts),
        "prompts_per_step": case.prompts_per_step,
        "samples_per_prompt": case.samples_per_prompt,
        "max_new_tokens": case.max_new_tokens,
        "temperature": case.temperature,
        "lr": config.optim.lr,
        "max_grad_norm": config.optim.max_grad_norm,
        "steps": args.warmup + args.steps,
        "seed": config.run.seed,
        "dtype": config.model.dtype if config.model.dtype != "auto" else "float32",
        "bf16": None if args.trl_precision == "default" else False,
    }
    (run_dir / "spec.json").write_text(json.dumps(spec, indent=1))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env |= {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}  # local paths only
    command = [str(TRL_PYTHON), "scripts/trl_worker.py", str(run_dir / "spec.json")]
    run_logged([*command, str(run_dir / "result.json")], run_dir.with_suffix(".log"), env)
    result = json.loads((run_dir / "result.json").read_text())
    args.trl_info = {k: result[k] for k in ("torch_threads", "versions", "dtype", "bf16_autocast")}
    return [
        {
            "samples": result["samples_per_step"],
            "len": s["completions/mean_length"],
            "step_s": s["step_s"],
            "generate_s": s["score_s"],
            "wait_s": s["score_s"],
            "model_generate_s": s["generate_s"],
            "train_s": s["step_s"] - s["score_s"],
            "grad_norm": s["grad_norm"],
            "loss": s["loss"],
            "reward": s["reward"],
        }
        for s in result["steps"][args.warmup :]
    ]


def summarise(steps: list[dict]) -> dict[str, float]:
    """Medians over the timed steps; samples/s = samples per step / median step time."""
    assert steps, "no timed step"
    out = {k: statistics.median(s[k] for s in steps) for k in steps[0]}
    out["samples_per_s"] = out["samples"] / out["step_s"]
    out["trained"] = float(any(s["grad_norm"] > 0 for s in steps))
    return out


def report(title: str, results: dict[str, dict[str, float]]) -> dict[str, float]:
    """Print a table of `results` (system -> summary) and the ratios; the ratios."""
    print(f"\n{title}\n{'':<16}" + "".join(f"{name:>12}" for name in results))
    for key in (*COLUMNS, "wait_s", "model_generate_s", "reward", "trained"):
        cells = "".join(f"{r.get(key, float('nan')):>12.3f}" for r in results.values())
        print(f"{key:<16}{cells}")
    if any(r["reward"] == 0.0 and not r["trained"] for r in results.values()):
        print("trained 0 with reward 0: every sample scored 0, so the advantages and the gradient")
        print("are 0 (an untrained model); the step's work (forward, backward, optimizer) is done")
    ratios = {}
    if "trl" in results:
        for name, target in TARGETS.items():
            if name in results:
                ratios[name] = results[name]["samples_per_s"] / results["trl"]["samples_per_s"]
                print(f"{name} / trl samples/s: {ratios[name]:.2f}x (target >= {target})")
    return ratios


def one_round(case: Case, args: argparse.Namespace, r: int) -> dict[str, dict[str, float]]:
    out = {}
    order = args.systems[r % len(args.systems) :] + args.systems[: r % len(args.systems)]
    for name in order:
        run_dir = args.work / f"round{r + 1}-{name}"
        print(f"[bench] round {r + 1}: {name}", flush=True)
        steps = (
            run_trl(case, args, run_dir)
            if name == "trl"
            else run_rollouts(case, args, name, run_dir)
        )
        out[name] = summarise(steps)
        print(f"[bench] {name}: {out[name]['step_s']:.3f} s/step", flush=True)
    return {name: out[name] for name in args.systems}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", choices=sorted(CASES), required=True)
    parser.add_argument("--steps", type=int, default=6, help="timed steps per system")
    parser.add_argument("--warmup", type=int, default=2, help="steps run before the timed ones")
    parser.add_argument("--rounds", type=int, default=1, help="repetitions, in rotating order")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help="a subset of trl,sync,async")
    parser.add_argument("--model", default="", help="an HF model directory for the case's own")
    parser.add_argument("--work", default="", help="keep runs and logs here (default: a tmp dir)")
    parser.add_argument(
        "--trl-precision",
        choices=["default", "fp32"],
        default="default",
        help="TRL at its own default (bf16 autocast on CPU) or in fp32 (bf16=False)",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a train.py --set for the rollouts runs (repeatable), e.g. weight_sync.method=...",
    )
    args = parser.parse_args()
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if not args.systems or set(args.systems) - set(SYSTEMS):
        parser.error(f"--systems {','.join(args.systems)}: a subset of {','.join(SYSTEMS)}")
    if args.steps < 1 or args.warmup < 0 or args.rounds < 1:
        parser.error("--steps >= 1, --warmup >= 0 and --rounds >= 1")
    if "trl" in args.systems:
        subprocess.run(["bash", "scripts/trl_env.sh"], cwd=ROOT, check=True)
    case = CASES[args.case]
    with tempfile.TemporaryDirectory(prefix="bench-trl-") as tmp:
        args.work = Path(args.work or tmp).resolve()
        args.work.mkdir(parents=True, exist_ok=True)
        args.model_dir, args.prompts = prepare(case, args.work, args.model)
        rounds = [one_round(case, args, r) for r in range(args.rounds)]
    print(f"\ncase {case.title}; {args.warmup} warm-up + {args.steps} timed steps a system")
    print(LEGEND)
    if "trl" in args.systems:
        print(f"TRL: {json.dumps(args.trl_info)}")
    for r, results in enumerate(rounds):
        report(f"round {r + 1}/{args.rounds} (medians over the timed steps)", results)
    if args.rounds > 1:
        medians = {
            name: {k: statistics.median(rd[name][k] for rd in rounds) for k in rounds[0][name]}
            for name in args.systems
        }
        report(f"median over {args.rounds} rounds", medians)


if __name__ == "__main__":
    main()
