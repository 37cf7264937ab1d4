"""`rollouts serve --model DIR [--host 127.0.0.1] [--port N] [--api-key K] [--max-batch N] ...`.

Runs the built-in engine server until killed. Its flags are made from the fields of
`EngineOptions` (`rollouts/config/engine_options.py`: each one's type, default, help and bounds),
and read back into one. See `rollouts.engine` for the routes and for what
`--logprobs-from raw|scaled` means (raw = log_softmax of the unmodified logits, the default;
scaled = log_softmax of the temperature-scaled logits).
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import logging
import os
import socket
import sys
import typing
from pathlib import Path
from typing import Any

from rollouts.config.auto import CPU_BF16_ENV, cpu_has_bf16
from rollouts.config.engine_options import (
    EngineOptions,
    bound_problems,
    choices_of,
    flag_name,
    flag_of,
    option_of,
)
from rollouts.heap import keep_freed_memory


class UsageError(ValueError):
    """A command line `rollouts serve` cannot start with (the message names the flag)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `rollouts serve`: one flag per field of `EngineOptions` that has one."""
    hints = typing.get_type_hints(EngineOptions)
    for field in dataclasses.fields(EngineOptions):
        if option_of(field).flag:
            parser.add_argument(flag_of(field), **_argument(field, hints[field.name]))


def _argument(field: dataclasses.Field, tp: Any) -> dict[str, Any]:
    """argparse's keywords for one field: a switch, on|off, a mode's choices, a repeated or a
    comma-separated list, or a number or text."""
    meta = option_of(field)
    # argparse formats help with %: a literal one ("3-10%") is written %%
    out: dict[str, Any] = {
        "dest": field.name,
        "help": meta.help.replace("%", "%%"),
        "default": field.default,
    }
    if meta.required:
        return out | {"required": True, "default": None}
    if meta.switch:
        return out | {"action": "store_true"}
    if tp is bool:
        return out | {"choices": ("on", "off"), "default": "on" if field.default else "off"}
    if typing.get_origin(tp) is tuple:
        return out | ({"default": ""} if meta.sep else {"action": "append", "default": []})
    if choices_of(tp):
        return out | {"choices": choices_of(tp)}
    return out | ({"type": tp} if tp in (int, float) else {})


def parse_cpus(text: str) -> set[int] | None:
    """`--cpus` "2,3" -> {2, 3}; "" -> None (not pinned); ValueError naming the flag if bad."""
    if not text.strip():
        return None
    try:
        cores = {int(part) for part in text.split(",")}
    except ValueError:
        raise ValueError(
            f"--cpus {text!r}: a comma-separated list of core numbers, e.g. 1,2"
        ) from None
    allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else cores
    if not cores <= allowed:
        raise ValueError(f"--cpus {text!r}: this process may only use cores {sorted(allowed)}")
    return cores


def _values(args: argparse.Namespace) -> dict[str, Any]:
    """The parsed flags as the fields of `EngineOptions`, the run's own ones at their defaults
    (UsageError for a bad `--cpus`)."""
    values = {
        f.name: getattr(args, f.name) if option_of(f).flag else f.default
        for f in dataclasses.fields(EngineOptions)
    }
    values["share_prefix"] = args.share_prefix == "on"
    values["weights_roots"] = tuple(str(Path(r).resolve()) for r in args.weights_roots)
    try:
        values["cpus"] = tuple(sorted(parse_cpus(args.cpus) or ()))
    except ValueError as e:
        raise UsageError(str(e)) from None
    return values


def options_from_args(args: argparse.Namespace) -> EngineOptions:
    """The parsed command line as EngineOptions; UsageError naming the flag when it is wrong."""
    if not (Path(args.model) / "config.json").is_file():
        raise UsageError(f"--model {args.model}: no config.json there (an HF model directory?)")
    values = _values(args)
    if problems := bound_problems(values, flag_name):
        raise UsageError(problems[0])
    for root in args.weights_roots:  # it may appear later (a trainer's first weight copy)
        if Path(root).exists() and not Path(root).is_dir():
            raise UsageError(f"--weights-root {root}: not a directory")
    if not args.api_key and not args.allow_unauthenticated and not is_loopback(args.host):
        raise UsageError(
            f"--host {args.host} is reachable from other machines and no --api-key is set: "
            "anyone could reload weights, pause or abort. Set --api-key KEY, or pass "
            "--allow-unauthenticated if the network is trusted"
        )
    return EngineOptions(**values)


def is_loopback(host: str) -> bool:
    """Whether `host` (an address or a name) is reachable only from this machine."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0]).is_loopback for i in infos)


def run(args: argparse.Namespace) -> int:
    """Serve until interrupted; 2 when the model directory or an option is unusable."""
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s: %(message)s")
    try:
        options = options_from_args(args)
    except UsageError as e:
        print(f"rollouts serve: {e}", file=sys.stderr)
        return 2
    if slow := emulated_bf16(options):
        logging.getLogger("rollouts.serve").warning(slow)
    if options.cpus and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, options.cpus)  # before torch starts any thread: all inherit it
    keep_freed_memory()  # a decode step's [rows, vocab] temporaries reuse the last step's pages
    import torch
    import trio

    from rollouts.engine.app import serve

    if options.torch_threads > 0:
        torch.set_num_threads(options.torch_threads)
    try:
        trio.run(serve, options)
    except KeyboardInterrupt:
        return 0
    return 0


def emulated_bf16(options: EngineOptions) -> str:
    """A warning where bf16 is asked of a CPU without bf16 matmul units ("" elsewhere)."""
    asked = [k for k in ("dtype", "autocast") if getattr(options, k) == "bfloat16"]
    if options.device != "cpu" or not asked or cpu_has_bf16():
        return ""
    return (
        f"--{asked[0]} bfloat16 on a CPU without bf16 matmul units (neither avx512_bf16 nor "
        "amx_bf16 in /proc/cpuinfo): bf16 is emulated here, several times slower than float32; "
        f"leave --{asked[0]} at auto (float32) or set {CPU_BF16_ENV}=1 where a container hides "
        "the flags"
    )
