"""The command line is derived from the configs: every documented command parses with the real parser, every
flag's default is its dataclass field's, every flag has help, and the layout keeps no old path."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import shlex
import subprocess

import pytest
from conftest import PYTHON, REPO, mpi_run

from hpcdl.cli import build_parser
from hpcdl.flags import add_flags, config_from_args, flag_defaults

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
PLACEHOLDER = re.compile(r"\[|\.\.\.|\b[A-Z][A-Z_]*\b(?![=/])")  # a synopsis: [--flag], ..., NAME


def documented_commands(text: str) -> list[str]:
    """The ``hpcdl ...`` command lines of a Markdown text: in code blocks (continued lines joined) and in inline
    code that gives arguments; a synopsis with placeholders is prose, not a command line."""
    found, block, lines = [], False, text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.strip().startswith("```"):
            block = not block
        elif block:
            while line.rstrip().endswith("\\") and i + 1 < len(lines):
                i += 1
                line = line.rstrip()[:-1] + " " + lines[i].strip()
            match = re.search(r"(?:^|[\s/])(?:hpcdl|-m hpcdl)\s+([a-z].*)$", line)
            if match and not line.lstrip().startswith(("#", "from ", "import ")):
                found.append(match.group(1))
        else:
            found += [m.group(1) for span in re.findall(r"`([^`]*)`", line)
                      if (m := re.match(r"(?:.*\s)?hpcdl\s+([a-z].*\s-.*)$", span))]
        i += 1
    commands = (re.split(r"\s+#\s|\s+[|;&>]\s*|\s+2>", c)[0] for c in found)
    return [c for c in commands if not PLACEHOLDER.search(c)]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_documented_command_parses(doc):
    parser = build_parser()
    commands = documented_commands(doc.read_text())
    for command in commands:
        try:
            parser.parse_args(shlex.split(command))
        except SystemExit as exc:
            if exc.code == 0:  # --help
                continue
            pytest.fail(f"{doc.name}: 'hpcdl {command}' does not parse with hpcdl's parser")


def test_the_docs_give_many_commands():
    assert sum(len(documented_commands(d.read_text())) for d in DOCS) >= 50  # the extraction finds them


def _commands(parser: argparse.ArgumentParser, prefix=()):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _commands(sub, (*prefix, name))
    if parser.get_default("fn"):
        yield prefix, parser


def test_every_flag_default_is_its_fields_and_every_flag_has_help():
    import hpcdl.cli as cli

    checked = 0
    for words, parser in _commands(build_parser()):
        # command()'s closure holds its config classes; hpcdl exec has none (its arguments are a command line)
        configs = parser.get_default("fn").__closure__ or ()
        classes = [c for cell in configs for c in (cell.cell_contents if isinstance(cell.cell_contents, tuple)
                                                   else ()) if dataclasses.is_dataclass(c)]
        defaults = {k: v for cls in classes for k, v in flag_defaults(cls).items()}
        for action in parser._actions:
            if not action.option_strings or action.dest in ("help",):
                continue
            # the first long flag: --compile of a --compile/--no-compile pair (a field whose default is True)
            flag = next((o for o in action.option_strings if o.startswith("--")), action.option_strings[0])
            assert action.help and not action.help.startswith("default"), f"hpcdl {' '.join(words)} {flag} has no help: comment its config field"
            assert flag in defaults, f"hpcdl {' '.join(words)} {flag} comes from no config field"
            expected = defaults[flag]
            if action.required:
                assert expected is dataclasses.MISSING
            elif action.default is not None or expected not in ((), None):
                assert action.default == expected, (words, flag)
            checked += 1
    assert checked > 150 and cli.GROUPS


def test_a_new_config_field_is_a_flag_with_its_default_and_help():
    @dataclasses.dataclass(kw_only=True)
    class Example:
        warmup_rounds: int = 3  # untimed rounds before the timed ones
        # images per rank, per step
        batch: int = 8
        name: str | None = None  # a name for the report
        sizes: tuple[int, ...] = (1, 2)  # sizes to sweep

    parser = argparse.ArgumentParser()
    add_flags(parser, Example)
    text = parser.format_help()
    assert "--warmup-rounds" in text and "untimed rounds before the timed ones (default: 3)" in text
    assert "images per rank, per step (default: 8)" in text and "a name for the report" in text
    made = config_from_args(Example, parser.parse_args(["--warmup-rounds", "5", "--sizes", "4,8"]))
    assert made == Example(warmup_rounds=5, sizes=(4, 8))
    assert config_from_args(Example, parser.parse_args([])) == Example()


def test_a_bad_flag_value_names_the_flag():
    run = subprocess.run([PYTHON, "-m", "hpcdl", "bench", "scaling", "--ranks", "1,two"], capture_output=True,
                         text=True)
    assert run.returncode == 2 and "--ranks" in run.stderr and "'1,two'" in run.stderr


def test_no_old_path_remains():
    """The dist and perf packages became distributed, bench and plan: no import, path or doc names them."""
    old = re.compile(r"hpcdl[./](dist|perf)\b")
    files = [p for p in REPO.rglob("*") if p.suffix in (".py", ".md", ".sh", ".sbatch", ".cfg", ".toml") or
             p.name in ("Makefile", "setup.py")]
    hits = [f"{p.relative_to(REPO)}:{i}" for p in files if ".venv" not in p.parts and ".git" not in p.parts
            and "egg-info" not in str(p) for i, line in enumerate(p.read_text(errors="replace").splitlines(), 1)
            if old.search(line)]
    assert not hits, hits


def test_every_outcome_has_one_exit_status():
    from hpcdl.cli import Exit, exit_code
    from hpcdl.runs.outcome import Outcome

    assert {o: exit_code(o.value) for o in Outcome} == {Outcome.FINISHED: Exit.OK, Outcome.REQUEUED: Exit.OK,
                                                        Outcome.STOPPED: Exit.STOPPED, Outcome.TERMINATED: Exit.STOPPED}


def test_the_contributing_example_benchmark_is_one_module_and_one_row(tmp_path, monkeypatch, capsys):
    """docs/contributing.md's matmul benchmark, as written there: a module and a registry row make a command
    with flags, help, a printed table and a JSON report."""
    import importlib.util
    import sys

    import hpcdl.bench as bench
    import hpcdl.bench.reports as report_module

    text = (REPO / "docs" / "contributing.md").read_text()
    config = re.search(r"```python\n# hpcdl/bench/configs.py\n(.*?)```", text, re.S).group(1)
    reports = re.search(r"```python\n# hpcdl/bench/reports/train.py\n(.*?)```", text, re.S).group(1)
    source = re.search(r"```python\n# hpcdl/bench/matmul.py\n(.*?)```", text, re.S).group(1)
    row = re.search(r"```python\n\s+(Benchmark\(.*?\)),\n```", text, re.S).group(1)
    configs = tmp_path / "matmul_configs.py"  # files, as in the package: the flags' help is read from the source
    configs.write_text("from dataclasses import dataclass\n\n\n" + config)
    spec = importlib.util.spec_from_file_location("matmul_configs", configs)
    config_module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "matmul_configs", config_module)
    spec.loader.exec_module(config_module)
    monkeypatch.setattr(bench.configs, "MatmulBench", config_module.MatmulBench, raising=False)
    report_types = {}  # the report's dataclasses, in the typed reports' module for the benchmark's imports
    report_types["MatmulBench"] = config_module.MatmulBench
    exec(compile("from dataclasses import dataclass, field\nfrom typing import ClassVar\n"
                 "from hpcdl.bench.reports import Provenance, Report\n" + reports, "reports.py", "exec",
                 dont_inherit=True), report_types)  # not this file's annotations future: ClassVar must resolve
    for name in ("MatmulRow", "MatmulReport"):
        monkeypatch.setattr(report_module, name, report_types[name], raising=False)
    path = tmp_path / "matmul.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("hpcdl.bench.matmul", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "hpcdl.bench.matmul", module)
    spec.loader.exec_module(module)
    monkeypatch.setitem(bench.BENCHMARKS, "matmul", eval(row, {"Benchmark": bench.Benchmark, "configs": bench.configs}))
    parser = build_parser()
    args = parser.parse_args(["bench", "matmul", "--sizes", "32,64", "--rounds", "1", "--json", str(tmp_path / "mm.json")])
    assert args.fn(args) == 0
    assert "GFLOP/s" in capsys.readouterr().out
    report = json.loads((tmp_path / "mm.json").read_text())
    assert [r["size"] for r in report["rows"]] == [32, 64] and report["config"]["sizes"] == [32, 64]
    assert report["benchmark"] == "matmul" and report["provenance"]["machine"]["cores"] >= 1
    again = report_types["MatmulReport"].from_dict(report)  # read back through its type
    assert [r.size for r in again.rows] == [32, 64] and again.provenance.machine.cores >= 1
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["bench"]
    matmul = next(a for a in sub._actions if isinstance(a, argparse._SubParsersAction)).choices["matmul"]
    assert "square matrix sides to time (default: 256,512)" in " ".join(matmul.format_help().split())


def test_a_finished_command_ends_without_the_teardown_but_after_the_exit_handlers(tmp_path):
    """leave_done, as ``hpcdl`` ends a command that loaded torch: threads that are not daemons finish first (a
    thread pool's worker too, which waits for threading's exit callback: joining it before that hung a rank),
    the atexit callbacks run (the heartbeat's stop is among them in a rank), the streams are
    flushed, the status is kept; the objects' teardown, which costs a torch process most of a second, does not
    run."""
    script = f"""
import atexit, sys, threading, time
import torch
from hpcdl.utils import leave_done
out = {str(tmp_path)!r}
class Teardown:
    def __del__(self, mark=open):  # open itself is gone from builtins by then
        mark(out + "/teardown", "w").close()
kept = Teardown()
threading.Thread(target=lambda: (time.sleep(0.3), open(out + "/thread", "w").close())).start()
from concurrent.futures import ThreadPoolExecutor
pool = ThreadPoolExecutor(1)  # its worker is no daemon: joined only after threading's exit callbacks end it
pool.submit(lambda: open(out + "/pool", "w").close())
atexit.register(lambda: open(out + "/atexit", "w").close())
print("printed", end="")
sys.stdout.write(" unflushed")
leave_done(3)
"""
    done = subprocess.run([PYTHON, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 3 and done.stdout == "printed unflushed", done
    assert (tmp_path / "thread").exists() and (tmp_path / "atexit").exists() and (tmp_path / "pool").exists()
    assert not (tmp_path / "teardown").exists()  # a normal exit runs __del__ of module globals


def test_a_finished_mpi_rank_finalizes_mpi_before_it_leaves(mpiexec, tmp_path):
    """mpi4py finalizes MPI after the atexit callbacks, where os._exit never gets: Open MPI's mpirun fails a job
    whose rank leaves without MPI_Finalize (seen on the lent Xeon), so leave_done calls it. MPI_Finalize deletes
    MPI_COMM_SELF's attributes first: the delete callback marks that it ran."""
    script = f"""
import os
from mpi4py import MPI
from hpcdl.utils import leave_done
mark = os.path.join({str(tmp_path)!r}, f"finalized{{MPI.COMM_WORLD.Get_rank()}}")
key = MPI.Comm.Create_keyval(delete_fn=lambda comm, keyval, value: open(mark, "w").close())
MPI.COMM_SELF.Set_attr(key, "finalize marks this")
leave_done(0)
"""
    done = mpi_run(mpiexec, "-c", script, n=2, timeout=60)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "finalized0").exists() and (tmp_path / "finalized1").exists()
