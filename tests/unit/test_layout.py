"""The layout's rules, checked on the source (AST imports, Lua text).

    service/stream/   imports nothing of the project
    service/store/    only stream/ and settings (and itself)
    service/ledger/   only stream/ and settings (and itself)
    service/api/      never workers/;  workers/ never service.api / service.cli
    service/cli/      the only package that imports both
    settings, errors, tokenize: nothing of the project

And where third-party I/O libraries may be used: Redis only in store/ (elsewhere its
client type and exceptions), SQLAlchemy only in ledger/, vllm only in
workers/engines/vllm.py, torch and transformers only in the CPU engine and the model
conversion. The Lua scripts name no state, verdict or meta field themselves.

One home for each thing: only ``service/stream/endings.py`` builds an ``End`` or a
billing ``Summary``, only the log's terminal write names a terminal state; routes import
no routes; no module is over 400 lines, no function over 60. ``make lint`` runs this file.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from service.store import scripts
from service.store.keys import END_ID_FIELD, EVENT_FIELD, JOB_FIELD, SUMMARY_FIELD
from service.stream.lifecycle import Meta, Requeue, State

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("service", "workers")


def modules() -> Iterator[tuple[str, Path]]:
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).with_suffix("")
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            yield ".".join(parts), path


def imports(path: Path) -> set[str]:
    """Every module ``path`` imports (at any depth: lazy imports count too)."""
    tree = ast.parse(path.read_text(), str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def under(name: str, *prefixes: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


ALLOWED = {  # package -> what of the project it may import besides itself
    "service.stream": (),
    "service.store": ("service.stream", "service.settings"),
    "service.ledger": ("service.stream", "service.settings"),
    "service.settings": (),
    "service.errors": (),
    "service.tokenize": (),
}
PROJECT = ("service", "workers")


def project_imports(module: str, path: Path) -> set[str]:
    return {
        name
        for name in imports(path)
        if under(name, *PROJECT) and name not in ("service",) and not under(name, module)
    }


@pytest.mark.parametrize(("module", "path"), list(modules()), ids=lambda x: str(x))
def test_the_dependency_rule(module: str, path: Path) -> None:
    found = project_imports(module, path)
    for package, allowed in ALLOWED.items():
        if under(module, package):
            wrong = {n for n in found if not under(n, package, *allowed)}
            assert not wrong, f"{module} ({package}/) may not import {sorted(wrong)}"
    if under(module, "service.api"):
        wrong = {n for n in found if under(n, "workers", "service.cli")}
        assert not wrong, f"{module}: the API process imports no worker code: {sorted(wrong)}"
    if under(module, "workers"):
        wrong = {n for n in found if under(n, "service.api", "service.cli")}
        assert not wrong, f"{module}: a worker imports no API code: {sorted(wrong)}"


def test_only_the_cli_imports_both_the_api_and_the_workers() -> None:
    both = [
        module
        for module, path in modules()
        if any(under(n, "service.api") for n in imports(path))
        and any(under(n, "workers") for n in imports(path))
    ]
    assert all(under(m, "service.cli") for m in both), both


THIRD_PARTY = {  # library -> the modules that may import it (its client types aside)
    "sqlalchemy": ("service.ledger", "service.cli.embedded.postgres"),
    "vllm": ("workers.engines.vllm",),
    "torch": (
        "workers.engines.cpu",
        "workers.engines.cpu_batch",
        "workers.engines.cpu_sampling",
        "service.cli.model",
    ),
    "transformers": ("workers.engines.cpu", "service.cli.model"),
}
# outside store/, redis-py may be named for its client type and its exceptions only
REDIS_TYPES = {"redis.asyncio", "redis.asyncio.Redis"}


@pytest.mark.parametrize(("module", "path"), list(modules()), ids=lambda x: str(x))
def test_io_libraries_stay_in_their_room(module: str, path: Path) -> None:
    found = imports(path)
    for library, owners in THIRD_PARTY.items():
        if any(under(n, library) for n in found):
            assert under(module, *owners), f"{module} imports {library}"
    if not under(module, "service.store"):
        redis = {n for n in found if under(n, "redis")}
        wrong = {n for n in redis if n not in REDIS_TYPES and not under(n, "redis.exceptions")}
        assert not wrong, f"{module}: Redis calls belong in service/store: {sorted(wrong)}"


NAMES = sorted(
    {*(s.value for s in State), *(m.value for m in Meta), *(r.value for r in Requeue)},
    key=len,
    reverse=True,
)
FIELDS = [f.decode() for f in (EVENT_FIELD, SUMMARY_FIELD, END_ID_FIELD, JOB_FIELD)]


@pytest.mark.parametrize("name", scripts.NAMES)
def test_scripts_take_their_names_from_the_prelude(name: str) -> None:
    code = "\n".join(
        line for line in scripts.body(name).splitlines() if not line.lstrip().startswith("--")
    )
    literals = set(re.findall(r"'([^']*)'|\"([^\"]*)\"", code))
    spelled = {a or b for a, b in literals} & {*NAMES, *FIELDS}
    assert not spelled, f"{name}.lua spells {sorted(spelled)}: use S., M., V., R., F. instead"


def test_every_script_file_is_known_to_the_loader() -> None:
    files = {p.stem for p in (ROOT / "service" / "store" / "scripts").glob("*.lua")}
    assert files == set(scripts.NAMES)


def test_the_rules_see_a_violation(tmp_path: Path) -> None:
    """The checks above must be able to fail: a store module importing the API does."""
    bad = tmp_path / "bad.py"
    bad.write_text("from service.api.context import Context\nimport sqlalchemy\n")
    found = project_imports("service.store.bad", bad)
    assert found == {"service.api.context", "service.api.context.Context"}
    assert "sqlalchemy" in imports(bad)


# -- one home for each thing ------------------------------------------------------------

ROUTES = "service.api.routes"
ENDINGS = "service.stream.endings"
TERMINAL_WRITE = "service.store.log"  # RedisLog.terminal: the one terminal append
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60


def _calls(path: Path) -> Iterator[ast.Call]:
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call):
            yield node


def _called(call: ast.Call) -> str | None:
    func = call.func
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return None


@pytest.mark.parametrize(("module", "path"), list(modules()), ids=lambda x: str(x))
def test_only_endings_makes_an_ending(module: str, path: Path) -> None:
    """Every ``End`` and billing ``Summary`` is built by ``service/stream/endings.py``, and
    only the log's terminal write gives the append script a terminal state."""
    built = {_called(c) for c in _calls(path)} & {"End", "Summary"}
    if module != ENDINGS:
        assert not built, f"{module} builds {sorted(built)}: ask service/stream/endings.py"
    terminal = [c for c in _calls(path) if any(k.arg == "terminal_state" for k in c.keywords)]
    if module != TERMINAL_WRITE:
        assert not terminal, f"{module} writes a terminal state itself: use RedisLog.end"


@pytest.mark.parametrize(("module", "path"), list(modules()), ids=lambda x: str(x))
def test_routes_import_no_routes(module: str, path: Path) -> None:
    if under(module, ROUTES) and module != ROUTES:
        found = {n for n in project_imports(module, path) if under(n, ROUTES)}
        assert not found, f"{module} imports {sorted(found)}: shared code lives in service/api"


@pytest.mark.parametrize(("module", "path"), list(modules()), ids=lambda x: str(x))
def test_modules_and_functions_stay_small(module: str, path: Path) -> None:
    """A module over 400 lines, or a function over 60, is usually two things."""
    source = path.read_text()
    lines = len(source.splitlines())
    assert lines <= MAX_MODULE_LINES, f"{module} has {lines} lines (at most {MAX_MODULE_LINES})"
    for node in ast.walk(ast.parse(source, str(path))):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            start = min([d.lineno for d in node.decorator_list] + [node.lineno])
            length = (node.end_lineno or node.lineno) - start + 1
            assert length <= MAX_FUNCTION_LINES, f"{module}.{node.name} has {length} lines"


def test_the_new_rules_see_a_violation(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text(
        "from service.api.routes.system import x\n"
        "def f():\n"
        "    ev.End('finished', None, 1, 2)\n"
        "    log.append(r, 1, [], terminal_state='x')\n"
    )
    assert {_called(c) for c in _calls(bad)} >= {"End", "append"}
    assert any(k.arg == "terminal_state" for c in _calls(bad) for k in c.keywords)
    assert "service.api.routes.system" in project_imports("service.api.routes.chat", bad)
