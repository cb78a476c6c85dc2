"""The README's main command works from a clean clone (CI itself runs the test command).

The command is read from the README, so the test and the documentation cannot drift.
Only the training length is shortened (``--epochs 200`` -> ``--epochs 4``).
"""

import re
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Two commands", 1)[1].split("\n## ", 1)[0]
    return [c.strip() for c in re.findall(r"```\n(.*?)\n```", section, re.S)]


def test_readme_names_exactly_two_commands_and_ci_runs_the_second():
    commands = readme_commands()
    assert len(commands) == 2
    assert commands[1] in (ROOT / ".ci" / "run").read_text()
    assert ".venv" in commands[0] and "pollux-run" in commands[0]


def test_main_command_from_a_clean_clone(tmp_path):
    main = readme_commands()[0]
    assert "--epochs 200" in main
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
    # the clone holds what is committed; the command must not need anything else
    assert not (clone / ".venv").exists()
    out = subprocess.run(main.replace("--epochs 200", "--epochs 4"), shell=True, cwd=clone,
                         capture_output=True, text=True, timeout=1200)
    assert out.returncode == 0, (out.stdout[-3000:], out.stderr[-3000:])
    assert "final val_acc" in out.stdout and "succeeded, exit code 0" in out.stdout
    assert re.search(r"replicas \d+ on \d+ node\(s\) \| batch \d+", out.stdout)
    shutil.rmtree(clone, ignore_errors=True)
