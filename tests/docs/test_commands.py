"""The commands and links in README.md and docs/*.md work on this code.

- every `python -m recps.train ...` in a code block composes (Hydra's compose API, in this process:
  what `python -m recps.train <overrides> --cfg job` prints) and passes the checks recps.train runs
  before any data is read or process started: `validate_config`, and a pipeline's stage checks
  (`pipeline_specs`, `schedule`) or a stream's keys (`StreamConfig`); a `-m` sweep: every job.
  A command whose line says `# fails` must fail that check instead (the docs show a mistake).
  Commands on hdfs:// URLs only compose: nothing is read here. Without a GPU, a `device=cuda`
  command must fail the device check (naming device='cuda...') after composing.
- every other `python -m recps.<module>` answers `--help` (run in this process: no subprocess);
  a `python -m benchmarks.<module>` or `python examples/<file>` names a file that exists.
- the README's Fleet example is the code of examples/train_fleet.py, character for character.
- every relative link and image points to an existing file.

A failure names the file and line of the command or link. Runs in seconds: no process is started.
"""

from __future__ import annotations

import contextlib
import io
import re
import runpy
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from recps.config import PROJECT_ROOT, register_resolvers, validate_config
from recps.errors import ConfigError

pytestmark = pytest.mark.timeout(120)

PAGES = [PROJECT_ROOT / "README.md", *sorted((PROJECT_ROOT / "docs").glob("*.md"))]
# Placeholders the pages use in commands, and what the test puts in their place.
PLACEHOLDERS = {"$HDFS_URL": "hdfs://127.0.0.1:9000", "<secret>": "s3cret", "<rank 0's host>:<port>": "10.0.0.1:29600"}


@dataclass(frozen=True)
class Command:
    page: Path
    line: int  # 1-based, the command's first line
    text: str  # continuation lines joined, the trailing comment removed
    comment: str

    def where(self) -> str:
        return f"{self.page.relative_to(PROJECT_ROOT)}:{self.line}: {self.text}"


def _code_lines(page: Path):
    """(line number, text) of the lines inside code blocks: fenced or indented by 4 spaces."""
    fenced = False
    for number, line in enumerate(page.read_text().splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced or line.startswith("    "):
            yield number, line


def _commands(page: Path) -> list[Command]:
    commands, pending = [], None  # pending: (first line, text so far) of a command continued with `\`
    for number, line in _code_lines(page):
        text = line.strip()
        if pending is not None:
            start, head = pending
            text, pending = head + " " + text, None
        else:
            start = number
        if text.endswith("\\"):
            pending = (start, text[:-1].rstrip())
            continue
        code, _, comment = text.partition(" #")
        if re.search(r"(^|[\s/])(python|torchrun)\b.*\s-m\s+(recps|benchmarks)\.|python\s+examples/", code):
            commands.append(Command(page, start, code.strip(), comment.strip()))
    return commands


COMMANDS = [c for page in PAGES for c in _commands(page)]


def _args_after(command: Command, module: str) -> list[str]:
    text = command.text
    for key, value in PLACEHOLDERS.items():
        text = text.replace(key, value)
    words = shlex.split(text)
    for i in range(len(words) - 1):
        if words[i] == "-m" and words[i + 1] == module:
            return words[i + 2:]
    raise AssertionError(f"{command.where()}: no `-m {module}` in it")


def _compose_jobs(args: list[str]):
    """The configs `python -m recps.train ARGS` runs: one, or one per job of a -m sweep."""
    from hydra import compose, initialize_config_dir
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    overrides, config_name, config_dirs, multirun = [], "config", [], False
    words = iter(args)
    for word in words:
        if word in ("-m", "--multirun"):
            multirun = True
        elif word in ("--cfg", "-c"):
            next(words)
        elif word in ("--config-name", "-cn"):
            config_name = next(words)
        elif word in ("--config-dir", "-cd"):
            config_dirs.append(str((PROJECT_ROOT / next(words)).resolve()))
        elif word.startswith("-"):
            raise AssertionError(f"flag {word} is not known to this test")
        else:
            overrides.append(word)
    if config_dirs:
        overrides.append("hydra.searchpath=[" + ",".join(f"file://{d}" for d in config_dirs) + "]")
    jobs = [overrides]
    if multirun:
        parsed = OverridesParser.create().parse_overrides(overrides)
        jobs = [job for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]
    register_resolvers()
    for job in jobs:
        with initialize_config_dir(config_dir=str(PROJECT_ROOT / "conf"), version_base="1.3"):
            yield job, compose(config_name=config_name, overrides=job)


def _check(cfg, overrides: list[str]) -> None:
    """What recps.train checks before it reads data or starts a process."""
    validate_config(cfg, overrides=overrides)
    if cfg.get("pipeline") is not None and str(cfg.pipeline.get("name", "none")) != "none":
        from recps.pipeline.stages import pipeline_specs, schedule

        schedule(cfg, pipeline_specs(cfg))
    if cfg.get("stream") is not None and bool(cfg.stream.get("enabled", False)):
        from recps.stream.plan import StreamConfig

        StreamConfig.from_config(cfg.stream)


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


TRAIN = [c for c in COMMANDS if re.search(r"-m recps\.train\b", c.text)]


def test_the_pages_have_commands():
    assert len(TRAIN) >= 40, [c.where() for c in TRAIN]  # the extraction found them (README + docs)
    assert {c.page.name for c in TRAIN} >= {"README.md", "configuration.md", "distributed.md", "streaming.md",
                                             "funnel.md", "checkpoints.md", "gpu.md"}


@pytest.mark.parametrize("command", TRAIN, ids=lambda c: f"{c.page.name}:{c.line}")
def test_train_command_composes(command: Command):
    jobs = _compose_jobs(_args_after(command, "recps.train"))
    while True:
        try:
            job, cfg = next(jobs)
        except StopIteration:
            return
        except Exception as exc:  # noqa: BLE001 - a command that does not compose: name it
            pytest.fail(f"{command.where()}\n  does not compose: {type(exc).__name__}: {exc}", pytrace=False)
        if "fails" in command.comment:
            with pytest.raises(ConfigError):
                _check(cfg, job)
            continue
        if str(cfg.device).startswith("cuda") and not _cuda():  # composes; the device check says why not here
            with pytest.raises(ConfigError, match=r"device='cuda"):
                _check(cfg, job)
            continue
        try:
            _check(cfg, job)
        except Exception as exc:  # noqa: BLE001 - the failure names the command
            pytest.fail(f"{command.where()}\n  job {job}: {type(exc).__name__}: {exc}", pytrace=False)


OTHER_MODULES = sorted({m for c in COMMANDS for m in re.findall(r"-m (recps\.[\w.]+)", c.text)} - {"recps.train"})


@pytest.mark.parametrize("module", OTHER_MODULES)
def test_other_module_answers_help(module: str, monkeypatch):
    where = [c.where() for c in COMMANDS if f"-m {module}" in c.text][0]
    monkeypatch.setattr(sys, "argv", [module, "--help"])
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_:
        runpy.run_module(module, run_name="__main__", alter_sys=False)
    assert exit_.value.code in (0, None), f"{where}\n  {module} --help: exit {exit_.value.code}"
    assert "usage" in out.getvalue().lower(), f"{where}\n  {module} --help printed: {out.getvalue()[:300]}"


def test_benchmark_and_example_files_exist():
    missing = []
    for command in COMMANDS:
        for module in re.findall(r"-m (benchmarks\.[\w.]+)", command.text):
            if not (PROJECT_ROOT / (module.replace(".", "/") + ".py")).is_file():
                missing.append(command.where())
        for path in re.findall(r"python (examples/\S+\.py)", command.text):
            if not (PROJECT_ROOT / path).is_file():
                missing.append(command.where())
    assert not missing, "\n".join(missing)


def test_readme_fleet_example_is_the_example_file():
    readme = (PROJECT_ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, flags=re.S)
    fleet = [b for b in blocks if "fleet.init()" in b]
    assert len(fleet) == 1, "README.md: one ```python block with the Fleet example"
    assert fleet[0] in (PROJECT_ROOT / "examples" / "train_fleet.py").read_text(), \
        "README.md's Fleet example is not a verbatim part of examples/train_fleet.py"


LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def test_relative_links_point_to_files():
    broken = []
    for page in PAGES:
        for number, line in enumerate(page.read_text().splitlines(), 1):
            for target in LINK.findall(line):
                if re.match(r"[a-z]+:", target) or target.startswith("#"):
                    continue  # http(s):, mailto:, an anchor on the same page
                if not (page.parent / target.split("#")[0]).exists():
                    broken.append(f"{page.relative_to(PROJECT_ROOT)}:{number}: {target}")
    assert not broken, "\n".join(broken)
