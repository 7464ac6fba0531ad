"""scripts/gpu_check.sh and scripts/gpu_prepare.sh, checked here because a lent GPU's
minutes are few: every strata command the check runs parses, every test path exists, and
the prepared parts fit the calls that carry them."""
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from strata.cli.parser import build_parser

ROOT = Path(__file__).resolve().parents[1]
CHECK = (ROOT / "scripts" / "gpu_check.sh").read_text()
PREPARE = ROOT / "scripts" / "gpu_prepare.sh"
SMOL_BYTES = 98362432  # SmolLM2-135M-Instruct.Q4_1.gguf, as gpu_check.sh checks the joined parts
MIB64 = 64 * 2**20


def _check_commands() -> list[list[str]]:
    """Each `python3 -m strata ...` of gpu_check.sh, with its shell variables filled in."""
    formats = re.search(r"^FORMATS=(\S+)$", CHECK, re.M).group(1)
    text = CHECK.replace("\\\n", " ")
    commands = []
    for line in text.splitlines():
        if line.lstrip().startswith("#"):
            continue
        for m in re.finditer(r"python3 -m strata (.*?)(?=\s2>|\s\||$)", line):
            cmd = m.group(1).replace('"$FORMATS"', formats).replace("$THREADS", "16")
            for model in (["smollm2", "flash-tiny"] if "$m" in cmd else [None]):
                commands.append(shlex.split(cmd.replace("$m", model) if model else cmd))
    return commands


def test_every_strata_command_of_the_check_parses():
    commands = _check_commands()
    assert len(commands) >= 12 and {c[0] for c in commands} >= {"bench", "generate", "synth"}
    parser = build_parser()
    for cmd in commands:
        try:
            parser.parse_args(cmd)
        except SystemExit as e:  # argparse's error went to stderr; name the command here
            pytest.fail(f"gpu_check.sh: `strata {' '.join(cmd)}` does not parse (exit {e.code})")


def test_the_check_names_tests_and_steps_that_exist():
    for path in re.findall(r"\btests/[\w/]+(?:\.py)?", CHECK):
        assert (ROOT / path).exists(), f"gpu_check.sh names {path}, which is not in the tree"
    steps = set(re.findall(r"^s(\d+)\(\)", CHECK, re.M))
    default = re.search(r"STEPS=\$\{STEPS:-([\d,]+)\}", CHECK).group(1).split(",")
    planned = re.findall(r"STEPS=([\d,]+) scripts/gpu_check.sh", PREPARE.read_text())
    assert len(planned) == 2
    for step in default + [s for plan in planned for s in plan.split(",")]:
        assert step in steps, f"step {step} has no function s{step} in gpu_check.sh"


def test_prepare_splits_smollm2_into_two_calls_that_fit(tmp_path):
    # a fake pip writes the wheels (their real sizes, about), a fake cache holds the GGUF
    fake_pip = tmp_path / "pip"
    fake_pip.write_text('#!/bin/bash\nwhile [[ $# -gt 0 ]]; do [[ $1 == -d ]] && d=$2; shift; done\n'
                        'head -c 13336114 /dev/zero > "$d/transformers-5.23.0-py3-none-any.whl"\n'
                        'head -c 1085221 /dev/zero > "$d/fla_core-0.6.0-py3-none-any.whl"\n'
                        'head -c 118475 /dev/zero > "$d/gguf-0.19.0-py3-none-any.whl"\n')
    fake_pip.chmod(0o755)
    cache = tmp_path / "cache"
    (cache / "models").mkdir(parents=True)
    smol = cache / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    data = os.urandom(SMOL_BYTES)
    smol.write_bytes(data)
    dest = tmp_path / "dest"
    # the script's python3 must import strata: this interpreter's, first on PATH
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    env = dict(os.environ, PIP=str(fake_pip), DEST=str(dest), STRATA_CACHE=str(cache), PATH=path)
    r = subprocess.run(["bash", str(PREPARE)], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    part1, part2 = (dest / ".gpu" / "smollm2.part1").read_bytes(), (dest / ".gpu" / "smollm2.part2").read_bytes()
    assert part1 + part2 == data
    wheels = sum(p.stat().st_size for p in (dest / ".whl").glob("*.whl"))
    sizes = [float(s) for s in re.findall(r"\(([\d.]+) MiB\)", r.stdout)]
    assert len(sizes) == 2 and max(sizes) * 2**20 <= MIB64 - 2**20, r.stdout  # each call, tree included
    assert len(part2) + wheels < MIB64 and len(part1) < MIB64
