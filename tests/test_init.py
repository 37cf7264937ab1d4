"""`rollouts init DIR`: a packaged recipe and its data written next to the user, ready for the
command it prints; the recipes are the checkout's configs and travel inside the wheel."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from rollouts.cli import SUBCOMMANDS, main
from rollouts.config import load_config
from rollouts.recipes import recipe_names, recipe_text
from rollouts.recipes.cli import plan_init

ROOT = Path(__file__).resolve().parents[1]


def _init(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    code = main(["init", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_init_writes_the_demo_config_and_its_data(tmp_path: Path, capsys) -> None:
    out_dir = tmp_path / "demo"
    code, out, err = _init(capsys, str(out_dir))
    assert code == 0, err
    written = out_dir / "demo-cpu.toml"
    assert written.read_text() == (ROOT / "configs" / "demo-cpu.toml").read_text()
    config = load_config(written)
    for path in (config.data.sft_path, config.data.train_path, config.data.eval_path):
        assert not Path(path).is_absolute(), path  # relative: resolved in DIR, where train runs
        assert (out_dir / path).stat().st_size > 0, path
    assert config.data.prepare  # train runs the hook again: it keeps the files init wrote
    next_line = out.strip().splitlines()[-1].strip()
    assert next_line == f"cd {out_dir} && rollouts train --mode sft+rl --config demo-cpu.toml"


def test_init_in_the_current_directory_prints_no_cd(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    code, out, err = _init(capsys, ".", "--recipe", "demo-tools-cpu")
    assert code == 0, err
    assert out.strip().splitlines()[-1].strip() == (
        "rollouts train --mode sft+rl --config demo-tools-cpu.toml"
    )
    assert load_config("demo-tools-cpu.toml").data.prepare
    assert Path(load_config("demo-tools-cpu.toml").data.train_path).is_file()


def test_init_refuses_to_overwrite_without_force(tmp_path: Path, capsys) -> None:
    assert _init(capsys, str(tmp_path))[0] == 0
    config = tmp_path / "demo-cpu.toml"
    config.write_text("# mine\n")
    code, _, err = _init(capsys, str(tmp_path))
    assert code == 2
    assert f"error: {config} exists: pass --force" in err
    assert config.read_text() == "# mine\n"  # untouched
    data = tmp_path / load_config(ROOT / "configs" / "demo-cpu.toml").data.eval_path
    data.write_text("")
    code, _, err = _init(capsys, str(tmp_path), "--force")
    assert code == 0, err
    assert config.read_text() == recipe_text("demo-cpu")
    assert data.stat().st_size > 0  # --force writes the data anew too


def test_init_keeps_data_another_recipe_wrote(tmp_path: Path, capsys) -> None:
    """demo-ppo-cpu reads demo-cpu's data: a second recipe in the same DIR keeps it."""
    assert _init(capsys, str(tmp_path))[0] == 0
    code, out, err = _init(capsys, str(tmp_path), "--recipe", "demo-ppo-cpu")
    assert code == 0, err
    assert "[init] kept " in out
    assert (tmp_path / "demo-ppo-cpu.toml").is_file()


def test_a_bad_recipe_name_lists_the_known_ones(tmp_path: Path, capsys) -> None:
    code, _, err = _init(capsys, str(tmp_path / "x"), "--recipe", "demo-gpu")
    assert code == 2
    assert "no recipe named 'demo-gpu'; the recipes are: " in err
    assert "demo-cpu" in err
    assert not (tmp_path / "x").exists()  # nothing written
    with pytest.raises(SystemExit):
        main(["init", "--help"])
    help_text = capsys.readouterr().out
    assert all(name in help_text for name in recipe_names())


@pytest.mark.parametrize("name", recipe_names())
def test_each_recipe_is_a_checkout_config_and_writes_its_data(name: str, tmp_path: Path) -> None:
    """One text: configs/NAME.toml is a link to the packaged recipe; its header gives the
    command `rollouts init` prints."""
    shipped = ROOT / "configs" / f"{name}.toml"
    assert shipped.is_symlink(), f"{shipped} should link to rollouts/recipes/{name}.toml"
    assert shipped.resolve() == (ROOT / "rollouts" / "recipes" / f"{name}.toml").resolve()
    plan = plan_init(name, tmp_path)
    assert f"rollouts train --mode {plan.mode} --config {name}.toml" in recipe_text(name)
    main(["init", str(tmp_path), "--recipe", name])
    assert all(p.is_file() for p in plan.data_files), plan.data_files


def test_the_wheel_holds_the_recipes(tmp_path: Path) -> None:
    """Built from a copy of the tree, without build isolation (no network; a few seconds)."""
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(ROOT / "pyproject.toml", src)
    shutil.copy(ROOT / "README.md", src)
    ignore = shutil.ignore_patterns("__pycache__")
    shutil.copytree(ROOT / "rollouts", src / "rollouts", ignore=ignore)
    cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
    done = subprocess.run([*cmd, "-w", str(tmp_path / "whl"), str(src)], capture_output=True)
    assert done.returncode == 0, done.stderr.decode()
    (wheel,) = (tmp_path / "whl").glob("rollouts-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for name in recipe_names():
        assert f"rollouts/recipes/{name}.toml" in names
    assert "rollouts/recipes/cli.py" in names


@pytest.mark.parametrize("command", sorted(SUBCOMMANDS))
def test_each_command_prints_its_help(command: str, capsys) -> None:
    """`rollouts serve --help` raised argparse's "incomplete format" on a help text's "%"."""
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    assert f"usage: rollouts {command}" in capsys.readouterr().out
