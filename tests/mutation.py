"""Mutation testing of the core modules, on demand, not in CI (scripts/mutate; the method and
the scores are in docs/testing.md).

    scripts/mutate                         every module of tests/mutation.toml
    scripts/mutate proxy/wire/sse.py ...        some of them
    scripts/mutate --list proxy/wire/sse.py     its mutants, numbered
    scripts/mutate --show proxy/wire/sse.py:12  run mutant 12 with pytest's output (with the
                                           module's tests, or the test files named after)
    scripts/mutate --report                the scores, from the cache (markdown)
    scripts/mutate --timeouts MODULE ...   run again what a timeout killed (on a quiet machine)

A mutant is one small change to a module's syntax tree (tests/mutants.py). It is run by the
tests of its module's files (the table) that execute its lines: a coverage pass per module
records which test runs which line. One pytest at a time, in a child forked from a process
that has imported pytest and the test dependencies once (a pytest starts in seconds here,
a mutant's tests often take less); the child imports the mutated module from the mutated
tree (an import hook: no file is written), runs with -x, and is killed with its process
group past its time (`--factor` x its tests' own time, plus a margin): a timeout counts as
killed. Results are cached in .mutants/ per module source: an interrupted run resumes, and a
run after the tests changed runs again only what survived.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.abc
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
import tomllib
from collections.abc import Sequence
from pathlib import Path
from types import CodeType, ModuleType
from typing import Any

from tests.mutants import Mutant, mutants, mutated_code

ROOT = Path(__file__).resolve().parent.parent
TABLE = ROOT / "tests" / "mutation.toml"
CACHE = ROOT / ".mutants"
KILLED, SURVIVED, TIMEOUT, UNCOVERED = "killed", "survived", "timeout", "uncovered"


def load_table() -> dict[str, Any]:
    with TABLE.open("rb") as f:
        return tomllib.load(f)


def module_name(path: str) -> str:
    return path.removesuffix(".py").replace("/", ".")


def digest(*paths: str | Path) -> str:
    h = hashlib.sha256()
    for path in paths:
        h.update(Path(ROOT, path).read_bytes())
    return h.hexdigest()[:16]


def tests_digest(files: Sequence[str]) -> str:
    """The module's test files and the helpers every test uses."""
    helpers = sorted(p.relative_to(ROOT) for p in (ROOT / "tests").glob("*.py"))
    return digest(*sorted(set(files)), *helpers)


# -- running pytest in a forked child --------------------------------------------------------
class _Mutated(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports `name` from `code` (the mutated tree, compiled) instead of its file."""

    def __init__(self, name: str, path: Path, code: CodeType) -> None:
        self.name, self.path, self.code = name, path, code

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        return importlib.util.spec_from_file_location(fullname, self.path, loader=self)

    def create_module(self, spec: Any) -> None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        exec(self.code, module.__dict__)


class _Durations:
    """A pytest plugin: each test's own time (setup, call and teardown)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def pytest_runtest_logreport(self, report: Any) -> None:
        self.seconds[report.nodeid] = self.seconds.get(report.nodeid, 0.0) + report.duration


def run_child(
    args: list[str],
    *,
    timeout: float,
    mutant: tuple[str, Path, CodeType] | None = None,
    quiet: bool = True,
    after: Any = None,
) -> int | None:
    """pytest `args` in a forked child, in its own process group; its exit code, or None
    when it ran past `timeout` seconds (then the whole group is killed)."""
    pid = os.fork()
    if pid == 0:  # the child
        code = 3
        try:
            os.setpgid(0, 0)
            if quiet:
                null = os.open(os.devnull, os.O_WRONLY)
                os.dup2(null, 1)
                os.dup2(null, 2)
            if mutant is not None:
                sys.meta_path.insert(0, _Mutated(*mutant))
            import pytest

            code = int(pytest.main(args, plugins=[after] if after is not None else []))
            if after is not None and hasattr(after, "done"):
                after.done()
        except BaseException:
            import traceback

            traceback.print_exc()
        finally:
            os._exit(code)
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return None
        time.sleep(0.05)


# Plugins imported in the parent cannot be rewritten any more: what the warning says is true.
PYTEST = ["-p", "no:cacheprovider", "-p", "no:langsmith_plugin", "-q", "-o", "addopts="]
PYTEST += ["-W", "ignore::pytest.PytestAssertRewriteWarning"]


def warm_up(files: Sequence[str]) -> None:
    """Import, once, in the parent, every module that the tests of `files` import, except
    the proxy's and the tests' own (each child imports those, the mutated one among them):
    a child then starts in a fraction of a second instead of two."""
    names = ["tests.conftest", *(_module(f) for f in files)]
    listing = subprocess.run(
        [sys.executable, "-c", _LIST_IMPORTS, *names],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    for name in listing:
        with contextlib.suppress(Exception):
            importlib.import_module(name)
    import pytest  # noqa: F401


def _module(test: str) -> str:
    """The module of a test file or of one test's node id (`path.py::name[param]`)."""
    return test.partition("::")[0].removesuffix(".py").replace("/", ".")


# Third-party modules only: none whose file is in the repository (bench/ imports the proxy).
_LIST_IMPORTS = """
import importlib, os, sys
for name in sys.argv[1:]:
    importlib.import_module(name)
root = os.path.realpath(".") + os.sep
def ours(module):
    path = os.path.realpath(getattr(module, "__file__", None) or "")
    return path.startswith(root) and "site-packages" not in path
print("\\n".join(n for n, m in list(sys.modules.items()) if n != "__main__" and not ours(m)))
"""


# -- the coverage pass: which test runs which line -------------------------------------------
class _Recorder(_Durations):
    def __init__(self, out: Path) -> None:
        super().__init__()
        self.out = out

    def done(self) -> None:
        self.out.write_text(json.dumps(self.seconds))


def line_map(module: str, files: list[str], work: Path) -> tuple[dict[int, set[str]], dict]:
    """Per line of `module`, the test ids that execute it ("" for import time), and each
    test's time, from one run of `files` under coverage with per-test contexts."""
    data_file = work / "coverage"
    times = work / "durations.json"
    for stale in (data_file, times):
        stale.unlink(missing_ok=True)
    os.environ["COVERAGE_FILE"] = str(data_file)
    args = [
        *PYTEST,
        "--cov=proxy",
        "--cov-branch",
        "--cov-context=test",
        "--cov-report=",
        *files,
    ]
    print(f"  coverage pass: {' '.join(files)}", flush=True)
    code = run_child(args, timeout=3600, after=_Recorder(times))
    if code != 0:
        raise SystemExit(f"{module}: its tests fail without any mutant (exit {code})")
    import coverage

    data = coverage.CoverageData(basename=str(data_file))
    data.read()
    by_line: dict[int, set[str]] = {}
    path = str(ROOT / module)
    for line, contexts in data.contexts_by_lineno(path).items():
        by_line[line] = {c.rpartition("|")[0] if "|" in c else c for c in contexts}
    return by_line, json.loads(times.read_text())


# -- one module ------------------------------------------------------------------------------
def select(mutant: Mutant, by_line: dict[int, set[str]], times: dict[str, float]) -> list[str]:
    """The tests to run for `mutant`: those executing its lines (every test, for a line run
    at import), quickest first: with -x a mutant is killed by the first test that fails."""
    ids: set[str] = set()
    for line in range(mutant.line, mutant.end_line + 1):
        ids |= by_line.get(line, set())
    if "" in ids:  # executed at import: any test may see it
        ids = set(times)
    return sorted(ids - {""}, key=lambda i: (times.get(i, 1.0), i))


def run_module(path: str, spec: dict[str, Any], args: argparse.Namespace) -> None:
    files = [str(f) for f in spec["tests"]]
    source_digest, test_digest = digest(path), tests_digest(files)
    CACHE.mkdir(exist_ok=True)
    cache_file = CACHE / (path.replace("/", "_") + ".json")
    cache: dict[str, Any] = json.loads(cache_file.read_text()) if cache_file.exists() else {}
    if cache.get("source") != source_digest or args.fresh:
        cache = {"source": source_digest, "results": {}}
    work = CACHE / path.replace("/", "_")
    work.mkdir(exist_ok=True)
    if cache.get("tests") != test_digest or "lines" not in cache:
        by_line, times = line_map(path, files, work)
        cache.update(
            tests=test_digest,
            lines={str(k): sorted(v) for k, v in by_line.items()},
            times=times,
        )
        save(cache_file, cache)
    by_line = {int(k): set(v) for k, v in cache["lines"].items()}
    times: dict[str, float] = cache["times"]
    found = mutants(ROOT / path, lua=bool(spec.get("lua")))
    results: dict[str, Any] = cache["results"]
    name = module_name(path)
    if name in sys.modules:  # the children would run it as it is, not mutated
        raise SystemExit(f"{name} was imported before its mutants ran: a bug of the warm-up")
    started = time.monotonic()
    for n, mutant in enumerate(found):
        done = results.get(mutant.key)
        again = args.timeouts and done is not None and done["status"] == TIMEOUT
        if done and not again and (done["status"] != SURVIVED or done.get("tests") == test_digest):
            continue  # a kill stays a kill; a survivor is tried again on changed tests
        chosen = select(mutant, by_line, times)
        if not chosen:
            results[mutant.key] = {"status": UNCOVERED, "line": mutant.line}
            save(cache_file, cache)
            continue
        limit = min(args.factor * sum(times.get(i, 1.0) for i in chosen) + 20.0, 900.0)
        code = run_child(
            [*PYTEST, "-x", "--tb=no", "--no-cov", "-p", "no:randomly", *chosen],
            timeout=limit,
            mutant=(name, ROOT / path, mutated_code(ROOT / path, n, lua=bool(spec.get("lua")))),
        )
        status = TIMEOUT if code is None else SURVIVED if code == 0 else KILLED
        results[mutant.key] = {
            "status": status,
            "line": mutant.line,
            "code": code,
            "tests": test_digest,
            "ran": len(chosen),
        }
        save(cache_file, cache)
        mark = {KILLED: ".", TIMEOUT: "T", SURVIVED: "S"}[status]
        print(mark, end="" if status != SURVIVED else f" {mutant.line}: {mutant.key}\n", flush=True)
    print(f"\n  {path}: {time.monotonic() - started:.0f} s")
    report_module(path, found, results)


def save(path: Path, cache: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(cache, indent=1, sort_keys=True))
    tmp.replace(path)


# -- reports ---------------------------------------------------------------------------------
def counts(found: list[Mutant], results: dict[str, Any], accepted: set[str]) -> dict[str, int]:
    c = dict.fromkeys((KILLED, TIMEOUT, SURVIVED, UNCOVERED, "accepted", "pending"), 0)
    for mutant in found:
        status = results.get(mutant.key, {}).get("status", "pending")
        if status == SURVIVED and mutant.key in accepted:
            status = "accepted"
        c[status] += 1
    return c


def accepted_keys(path: str) -> set[str]:
    return {a["mutant"] for a in load_table().get("accepted", []) if a["module"] == path}


def report_module(path: str, found: list[Mutant], results: dict[str, Any]) -> None:
    c = counts(found, results, accepted_keys(path))
    print(f"  {path}: {summary(c)}")
    for mutant in found:
        result = results.get(mutant.key, {})
        if result.get("status") == SURVIVED and mutant.key not in accepted_keys(path):
            print(f"    survived  line {mutant.line}: {mutant.key}")


def scores(c: dict[str, int]) -> tuple[int, float, float]:
    """Reachable mutants, and two scores: the share of them killed (accepted survivors count
    against it), and the share of those not accepted as equivalent or speed-only (the usual
    mutation score, which leaves equivalent mutants out)."""
    killed = c[KILLED] + c[TIMEOUT]
    reach = killed + c[SURVIVED] + c["accepted"]
    testable = reach - c["accepted"]
    return reach, killed / reach if reach else 0.0, killed / testable if testable else 0.0


def summary(c: dict[str, int]) -> str:
    reach, strict, usual = scores(c)
    return (
        f"{reach + c[UNCOVERED]} mutants, {c[UNCOVERED]} on lines its tests never run; "
        f"of the {reach} reachable: {c[KILLED]} killed, {c[TIMEOUT]} by a timeout, "
        f"{c['accepted']} survivors accepted, {c[SURVIVED]} others survived "
        f"({c['pending']} not run yet): {100 * strict:.1f} % killed, "
        f"{100 * usual:.1f} % of those not accepted"
    )


def report(table: dict[str, Any]) -> None:
    print(
        "| module | mutants | never run | reachable | killed | accepted | survived "
        "| killed of reachable | killed of not accepted |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for path, spec in table["modules"].items():
        cache_file = CACHE / (path.replace("/", "_") + ".json")
        results = json.loads(cache_file.read_text())["results"] if cache_file.exists() else {}
        found = mutants(ROOT / path, lua=bool(spec.get("lua")))
        c = counts(found, results, accepted_keys(path))
        reach, strict, usual = scores(c)
        print(
            f"| `{path}` | {len(found)} | {c[UNCOVERED]} | {reach} | {c[KILLED] + c[TIMEOUT]} "
            f"| {c['accepted']} | {c[SURVIVED]} | {100 * strict:.1f} % | {100 * usual:.1f} % |"
        )


def show(target: str, table: dict[str, Any], tests: list[str]) -> None:
    path, _, number = target.rpartition(":")
    spec = table["modules"][path]
    lua = bool(spec.get("lua"))
    mutant = mutants(ROOT / path, lua=lua)[int(number)]
    print(f"line {mutant.line}: {mutant.key}", flush=True)
    code = run_child(
        [*PYTEST, "-x", "--no-cov", *(tests or [str(f) for f in spec["tests"]])],
        timeout=3600,
        mutant=(module_name(path), ROOT / path, mutated_code(ROOT / path, int(number), lua=lua)),
        quiet=False,
    )
    print(f"exit {code}: {'survived' if code == 0 else 'killed'}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="scripts/mutate", description=__doc__.split("\n")[0])
    parser.add_argument("modules", nargs="*", help="paths as in tests/mutation.toml")
    parser.add_argument("--list", action="store_true", help="list the mutants, numbered")
    parser.add_argument("--show", metavar="MODULE:N", help="run one mutant, with its output")
    parser.add_argument("--report", action="store_true", help="scores from the cache")
    parser.add_argument("--fresh", action="store_true", help="ignore cached results")
    parser.add_argument(
        "--timeouts",
        action="store_true",
        help="run again the mutants killed by a timeout (one that came of a loaded machine)",
    )
    parser.add_argument("--factor", type=float, default=3.0, help="time limit per mutant")
    args = parser.parse_args(argv)
    os.chdir(ROOT)
    sys.path.insert(0, str(ROOT))
    table = load_table()
    if args.report:
        return report(table)
    if args.show:  # the positional arguments are then the tests to run it with
        warm_up(args.modules or table["modules"][args.show.rpartition(":")[0]]["tests"])
        return show(args.show, table, args.modules)
    chosen = args.modules or list(table["modules"])
    for path in chosen:
        if path not in table["modules"]:
            raise SystemExit(f"{path} is not in {TABLE.relative_to(ROOT)}")
    if args.list:
        for path in chosen:
            for n, mutant in enumerate(
                mutants(ROOT / path, lua=bool(table["modules"][path].get("lua")))
            ):
                print(f"{path}:{n}  line {mutant.line}: {mutant.key}")
        return None
    warm_up(sorted({f for path in chosen for f in table["modules"][path]["tests"]}))
    for path in chosen:
        print(f"{path}", flush=True)
        run_module(path, table["modules"][path], args)
    return None


if __name__ == "__main__":
    main()
