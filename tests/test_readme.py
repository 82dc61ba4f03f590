"""Every command the README shows runs (issue 28 item 3): a README example must not break
again unseen.

The commands are read from the README itself: each line of a fenced ``bash`` block (backslash
continuations joined, ``#`` comments dropped, ``&&`` chains split) and each inline code span in
the prose that starts with one of :data:`INLINE_PROGRAMS` (headings excluded: they name a
tool). Every one must be covered in exactly one way:

* ``python -m dmuon.profile ...`` runs **as shown** (CPU, FLOP model), in a temporary directory;
  a placeholder ``MODULE:FACTORY`` from :data:`PLACEHOLDER_MODULES` is provided there;
* a command in :data:`README_COMMANDS` runs as its :class:`Run` (the same code path with
  faster arguments or a temporary output), or names the :class:`Covered` test that runs it, or
  gives the reason it is skipped (:class:`Skip`: GPU only, installs, the test suite itself);
* a ``pip install`` is skipped (CI's environment is that install).

A README command covered in none of these ways fails :func:`test_every_readme_command_is_covered`
with the exact entry to add; an entry whose command left the README fails too.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
CI_SCRIPT = REPO / ".ci" / "run"
#: The README is also the PyPI page (pyproject's ``readme``); the house's size limit (issue 33).
README_MAX_LINES = 200

#: README commands that run as shown (prefix match): fast on CPU, no files outside the cwd.
RUN_AS_SHOWN_PREFIXES = ("python -m dmuon.profile ",)
#: README commands skipped by prefix, with the reason.
SKIP_PREFIXES = {
    "pip install ": "installs a package: CI's environment is that install",
    "bash .ci/run": "the CI script: it runs the whole suite, this test included",
    "bash .ci/package_check.sh": "builds the wheel and sdist and installs torch into a fresh venv "
                                 "(minutes): tests/test_package.py runs it",
}
#: Programs whose inline code spans in the README's prose count as commands.
INLINE_PROGRAMS = ("python", "pytest", "bash", "torchrun")


@dataclasses.dataclass(frozen=True)
class Run:
    """Run ``command`` instead (``{repo}``: the repository, ``{tmp}``: a temporary directory
    that is also the working directory); ``why`` says how it is the same code path."""

    command: str
    why: str


@dataclasses.dataclass(frozen=True)
class Covered:
    """``test`` (``tests/<file>.py::<function>``) runs this command's code path; ``why`` says
    how. The test must exist."""

    test: str
    why: str


@dataclasses.dataclass(frozen=True)
class Skip:
    """Not run: ``why`` (GPU only, the test suite itself, minutes of benchmark)."""

    why: str


#: README command (as parsed: continuations joined, comments dropped, spaces collapsed, shell
#: quoting normalized by ``shlex.join``) -> how this test covers it.
README_COMMANDS: dict[str, Run | Covered | Skip] = {
    "python -m dmuon.train": Covered(
        "tests/test_train.py::test_cli_meshes_train_the_same_as_fsdp",
        "its first run is this command's defaults (4 CPU ranks, --mesh fsdp, --optimizer dmuon) "
        "for 3 steps of 1 episode"),
    "python -m pytest -q": Skip("the test suite itself: CI runs it, and this test is part of it"),
    "pytest -m gpu": Skip("the GPU tests: they need CUDA (on CPU they are skipped)"),
    "pytest -m compat": Skip("the compatibility subset: CI's Python 3.13 job runs it (.ci/compat_job.sh)"),
    "pytest -m 'compat or lerobot'": Skip("the subset CI's Python 3.12 job runs beside lerobot "
                                          "(.ci/compat_job.sh)"),
    "python -m dmuon.train --steps 3": Covered(
        "tests/test_main_job.py::test_main_job_three_steps_matches_the_gather_then_compute_reference",
        "runs this command as shown and once more with --optimizer vanilla, and compares the losses"),
    "python -m dmuon.train --nproc 4 --mesh hsdp:2x2": Covered(
        "tests/test_train.py::test_cli_meshes_train_the_same_as_fsdp",
        "runs this launch with --mesh hsdp:2x2 for 3 steps of 1 episode and compares its losses "
        "with the 1-D FSDP run's"),
    "python -m dmuon.train --preset pusht-state": Covered(
        "tests/test_train.py::test_preset_pusht_state_quick_run",
        "runs this preset on 2 ranks for 40 steps with its state data, training and closed-loop "
        "evaluation; the full run takes ~30 min"),
    "python -m dmuon.train.expert": Run(
        "python -m dmuon.train.expert --episodes 2",
        "the same command-line entry point on 2 of its 50 held-out episodes "
        "(tests/test_expert.py checks 20 episodes' success)"),
    "python bench/bench_step.py --nproc 4 --rounds 16 --block-steps 3 --batch-size 64 "
    "--no-labels": Covered(
        "tests/test_bench.py::test_bench_step_aa_control_and_per_round_ratios",
        "runs bench_step (tiny mode, gloo ranks) with its A/A control and per-round ratios; the "
        "full benchmark takes minutes"),
    "python bench/gpu_suite.py --out bench/results/gpu_h100": Skip("GPU only (CUDA and Triton)"),
    "python bench/rank_view.py --world 8 --model gpu --layers 1 --image-size 112 --batch-per-rank 1 "
    "--threads 1 --variants adamw dmuon vanilla --out FILE.json": Covered(
        "tests/test_rank_view.py::test_rank_view_plays_the_busiest_owner_with_peers_switched_off",
        "runs rank_view.run at N = 8 (the tiny policy, one round) with the ViewConfig this command "
        "line builds; the GPU-widths run takes minutes on CPU"),
}

#: Placeholder ``MODULE:FACTORY`` names the README uses -> source of a stand-in module written
#: to the working directory (a small model of the kind the example stands for).
PLACEHOLDER_MODULES = {
    "mypkg.models:build": (
        "import torch.nn as nn\n"
        "def build():\n"
        "    return nn.Sequential(nn.Embedding(1000, 64), nn.Linear(64, 256), nn.GELU(),\n"
        "                         nn.Linear(256, 64), nn.Linear(64, 1000, bias=False))\n"
    ),
}


def readme_commands(text: str) -> list[str]:
    """The commands ``text`` (a README) shows, in order, normalized (see module docstring)."""
    commands: list[str] = []
    blocks = re.findall(r"^```bash\n(.*?)^```", text, flags=re.S | re.M)
    for block in blocks:
        logical, pending = [], ""
        for line in block.splitlines():
            if line.rstrip().endswith("\\"):
                pending += line.rstrip()[:-1] + " "
                continue
            logical.append(pending + line)
            pending = ""
        if pending:
            logical.append(pending)
        for line in logical:
            tokens = shlex.split(line, comments=True)
            chain: list[str] = []
            for tok in tokens + ["&&"]:
                if tok == "&&":
                    if chain:
                        commands.append(shlex.join(chain))
                    chain = []
                else:
                    chain.append(tok)
    prose = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    prose = re.sub(r"^#.*$", "", prose, flags=re.M)  # a heading names a tool, not a command
    programs = "|".join(map(re.escape, INLINE_PROGRAMS))
    for span in re.findall(rf"`((?:{programs}) [^`]+)`", prose):
        commands.append(shlex.join(shlex.split(span)))
    return commands


def _how(command: str) -> Run | Covered | Skip | None:
    if command in README_COMMANDS:
        return README_COMMANDS[command]
    if command.startswith(RUN_AS_SHOWN_PREFIXES):
        return Run(command, "as shown")
    for prefix, why in SKIP_PREFIXES.items():
        if command.startswith(prefix):
            return Skip(why)
    return None


COMMANDS = readme_commands(README.read_text())


def test_readme_parser_on_a_known_text():
    text = ("# Tool `python -m z`\nintro `python -m a --x 1`\n```bash\n"
            "pip install b && python -m c \\\n    --y 2   # comment\npython d.py '<p q>'\n```\n```python\nimport e\n```\n")
    assert readme_commands(text) == ["pip install b", "python -m c --y 2", "python d.py '<p q>'",
                                     "python -m a --x 1"]


def test_every_readme_command_is_covered():
    assert any(c.startswith("python -m dmuon.profile ") for c in COMMANDS), COMMANDS
    missing = [c for c in COMMANDS if _how(c) is None]
    assert not missing, "\n".join(
        (f"README line {c!r} is not a command: a continuation of the line above? In bash a "
         f"'\\' continues a line only as its last character (not before spaces or a "
         f"comment): fix the README\n" if c.startswith("-") else "") +
        f"README command not covered by tests/test_readme.py: {c}\n"
        f"  add to README_COMMANDS in tests/test_readme.py one of:\n"
        f"    {c!r}: Run({c + ' <faster arguments>'!r}, \"how it is the same code path\"),\n"
        f"    {c!r}: Covered(\"tests/test_<file>.py::test_<name>\", \"how that test runs it\"),\n"
        f"    {c!r}: Skip(\"why it cannot run on CPU\"),"
        for c in missing)
    stale = sorted(set(README_COMMANDS) - set(COMMANDS))
    assert not stale, f"README_COMMANDS entries no longer in the README (remove them): {stale}"
    unused = [m for m in PLACEHOLDER_MODULES if not any(m in c for c in COMMANDS)]
    assert not unused, f"PLACEHOLDER_MODULES no longer used by the README (remove them): {unused}"


@pytest.mark.parametrize("command", [c for c in COMMANDS if isinstance(_how(c), Covered)])
def test_covered_commands_name_an_existing_test(command):
    how = _how(command)
    path, _, name = how.test.partition("::")
    module = importlib.import_module(path.removesuffix(".py").replace("/", "."))
    assert callable(getattr(module, name, None)), f"{command}: {how.test} does not exist"


@pytest.mark.parametrize("command", [c for c in COMMANDS if isinstance(_how(c), Run)])
def test_readme_command_runs(command, tmp_path):
    how = _how(command)
    for module, source in PLACEHOLDER_MODULES.items():
        if module in how.command:
            package, _, rest = module.partition(":")[0].partition(".")
            (tmp_path / package).mkdir(exist_ok=True)
            (tmp_path / package / "__init__.py").write_text("")
            (tmp_path / package / f"{rest}.py").write_text(source)
    argv = shlex.split(how.command.format(repo=REPO, tmp=tmp_path))
    if argv[0] == "python":
        argv[0] = sys.executable
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)]),
           "OMP_NUM_THREADS": "1", "MPLBACKEND": "Agg", "DMUON_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (
        f"README command {command!r} ran as {how.command!r} ({how.why}) and exited "
        f"{proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    if "dmuon.profile" in argv:  # what the README promises it writes: the plan and its chart
        out = tmp_path / (argv[argv.index("--out") + 1] if "--out" in argv else "plan.json")
        assert out.stat().st_size > 0, f"{command}: no plan at {out}"
        if "--no-plot" not in argv:
            assert out.with_suffix(".png").stat().st_size > 0, f"{command}: no chart"


def _pip_install_args(command: str) -> tuple[str, ...] | None:
    """``("torch==2.13.0",)`` for ``pip install torch==2.13.0`` or ``python -m pip install -q
    torch==2.13.0``; None for any other command."""
    argv = shlex.split(command)
    if argv[:3] == ["python", "-m", "pip"]:
        argv = argv[2:]
    if argv[:2] != ["pip", "install"]:
        return None
    return tuple(a for a in argv[2:] if a != "-q")


def test_readme_reads_right_on_pypi_and_github():
    """Issue 33: the README is the PyPI page, where relative links and images break; it shows
    ``pip install dmuon`` before the contributor commands, and it stays within its size."""
    text = README.read_text()
    lines = text.splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines (limit {README_MAX_LINES}): move details to docs/*.md "
        "and link them")
    targets = re.findall(r"\]\(([^)\s]+)", text) + re.findall(r"(?:src|href)=\"([^\"]+)\"", text)
    relative = [t for t in targets if not t.startswith(("https://", "http://"))]
    assert not relative, (
        f"README links that break on PyPI: {relative}; use https://github.com/dmuon/dmuon/blob/main/"
        "<path> for pages and https://raw.githubusercontent.com/dmuon/dmuon/main/<path> for images")
    assert COMMANDS[0] == "pip install dmuon", f"the README's first command is {COMMANDS[0]!r}"
    assert COMMANDS.index("pip install dmuon") < min(
        i for i, c in enumerate(COMMANDS) if c.startswith("pip install -e")), COMMANDS


def test_readme_test_command_is_what_ci_runs():
    """The newcomer's test command (install, then ``python -m pytest -q``) is what ``.ci/run``
    does: the same pip installs and the same pytest entry point."""
    blocks = re.findall(r"^```bash\n(.*?)^```", README.read_text(), flags=re.S | re.M)
    chain = next(line for block in blocks for line in block.splitlines() if "pytest" in line)
    readme = [shlex.join(shlex.split(c)) for c in chain.split("&&")]
    ci_lines = [ln.strip() for ln in CI_SCRIPT.read_text().replace("\\\n", " ").splitlines()
                if ln.strip() and not ln.strip().startswith("#")]
    ci_installs = {_pip_install_args(ln) for ln in ci_lines} - {None}
    readme_installs = [_pip_install_args(c) for c in readme if _pip_install_args(c)]
    assert readme_installs and set(readme_installs) <= ci_installs, (readme_installs, ci_installs)
    assert readme[-1] == "python -m pytest -q", readme
    assert any(ln.startswith("python -m pytest -q") for ln in ci_lines), ci_lines
