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
conversion. The Lua scripts name no state, verdict, meta field or reply code themselves,
and only a script's typed face (``service/store/scripts/<name>.py``) runs it and decodes
its reply. ``service/store/`` has no import circle.

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
from service.store.scripts.codes import REPLIES
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


# -- one typed face per script ----------------------------------------------------------

LOADER = "service.store.scripts"
RUNS_A_SCRIPT = {"register_script", "run_pipelined", "evalsha", "script_load"}
# a reply code spelled in a script: ``return 2``, ``return {'OK', ...}``, ``return false``
SPELLED_REPLY = re.compile(r"\breturn\s*\{?\s*(?:'|\"|-?\d|false\b|true\b)|redis\.\w+_reply\(")


def _lua_code(name: str) -> str:
    body = scripts.body(name).splitlines()
    return "\n".join(line.split("--")[0] for line in body)


def _runs_a_script(call: ast.Call) -> bool:
    called = _called(call)
    consts = [a.value for a in call.args if isinstance(a, ast.Constant)]
    if called == "execute_command":
        return "EVALSHA" in consts
    if called == "register":  # (the loader's; not ``atexit.register``)
        on = call.func.value if isinstance(call.func, ast.Attribute) else None
        return (isinstance(on, ast.Name) and on.id == "scripts") or bool(
            set(consts) & set(scripts.NAMES)
        )
    if called == "eval":  # (Redis's: a script and its number of keys; not a model's)
        return len(call.args) >= 2
    return called in RUNS_A_SCRIPT


def script_runs(module: str, path: Path) -> list[str]:
    """Where ``module`` runs a script other than as its own face (each call's text)."""
    wrong = []
    face = module.removeprefix(LOADER + ".")
    for call in _calls(path):
        if module == LOADER or not _runs_a_script(call):
            continue
        names = [a.value for a in call.args if isinstance(a, ast.Constant)]
        own = under(module, LOADER) and (
            (_called(call) == "register" and names == [face]) or _called(call) == "run_pipelined"
        )
        if not own:
            wrong.append(ast.unparse(call))
    return wrong


@pytest.mark.parametrize(("module", "path"), list(modules()), ids=lambda x: str(x))
def test_only_its_face_runs_a_script(module: str, path: Path) -> None:
    """A script is registered (and run) by its face alone, so its reply is decoded there
    and nowhere else: a caller gets the face's enum or struct, never the raw reply."""
    wrong = script_runs(module, path)
    assert not wrong, f"{module} runs a script itself: {wrong}; call its face in {LOADER}"


@pytest.mark.parametrize("name", scripts.NAMES)
def test_every_script_has_a_face_and_spells_no_reply(name: str) -> None:
    face = ROOT / "service" / "store" / "scripts" / f"{name}.py"
    assert face.exists(), f"{name}.lua has no typed face ({face.name})"
    code = _lua_code(name)
    spelled = SPELLED_REPLY.findall(code)
    assert not spelled, f"{name}.lua spells a reply {spelled}: return REPLY.{name.upper()}_..."
    codes = {f"{s.upper()}_{c.name}" for s, enum_ in REPLIES.items() for c in enum_}
    used = set(re.findall(r"\bREPLY\.(\w+)", code))
    assert used <= codes, f"{name}.lua returns unknown codes {sorted(used - codes)}"
    others = {u for u in used if not u.startswith(name.upper() + "_")}
    assert not others, f"{name}.lua returns another script's codes {sorted(others)}"


def store_import_graph() -> dict[str, set[str]]:
    """service/store's modules -> the service/store modules each imports."""
    store = {m: p for m, p in modules() if under(m, "service.store")}
    graph: dict[str, set[str]] = {}
    for module, path in store.items():
        found = {n for n in imports(path) if n in store and n != module}
        found |= {n.rpartition(".")[0] for n in imports(path) if n.rpartition(".")[0] in store}
        graph[module] = found - {module}
    return graph


def circle(graph: dict[str, set[str]]) -> list[str] | None:
    """An import circle of ``graph`` (a package's ``__init__`` importing nothing of its
    own modules, a module importing its package is not one), or None."""
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> list[str] | None:
        if node in path:
            return [*path[path.index(node) :], node]
        if node in done:
            return None
        for nxt in sorted(graph.get(node, ())):
            if under(node, nxt):  # (a package imported by its own module: loaded first)
                continue
            found = visit(nxt, [*path, node])
            if found:
                return found
        done.add(node)
        return None

    for start in sorted(graph):
        found = visit(start, [])
        if found:
            return found
    return None


def test_the_store_has_no_import_circle() -> None:
    """Type-checking-only imports count too: a circle is a circle."""
    assert circle(store_import_graph()) is None, circle(store_import_graph())


def test_the_face_rules_see_a_violation(tmp_path: Path) -> None:
    """A module that registers a script itself, a script that spells a reply and an import
    circle are each found."""
    bad = tmp_path / "bad.py"
    bad.write_text(
        "claim = scripts.register(redis, 'claim')\n"
        "atexit.register(stop)\n"
        "x = await scripts.run_pipelined(redis, s, [])\n"
        "pipe.execute_command('EVALSHA', sha, 1, key)\n"
        "model.eval()\n"
    )
    assert len(script_runs("service.store.log", bad)) == 3
    assert len(script_runs("service.store.scripts.park", bad)) == 2  # (not its own name)
    assert script_runs("service.store.scripts.claim", bad) == [
        "pipe.execute_command('EVALSHA', sha, 1, key)"
    ]
    for lua in (
        "return 2",
        "return {-2}",
        "return {'OK', id}",
        "return false",
        "  return redis.error_reply('X')",
    ):
        assert SPELLED_REPLY.search(lua), lua
    assert not SPELLED_REPLY.search("return {REPLY.CLAIM_GONE}\nreturn -math.ceil(left)")
    assert circle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert circle({"p.x": {"p"}, "p": set()}) is None


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
# modules that are one thing, and longer: why
LONGER = {
    "service.store.log": (540, "every request's log: its writes and its reads, one class"),
}
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
    limit = LONGER.get(module, (MAX_MODULE_LINES, ""))[0]
    assert lines <= limit, f"{module} has {lines} lines (at most {limit})"
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
