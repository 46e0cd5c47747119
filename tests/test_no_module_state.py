"""No module-level mutable state in the library: what a pipeline keeps lives on an object passed in.

Read with ``ast`` from every ``conveyor/**/*.py``. Refused:

- a module-level or class-level name bound to a mutable value: a dict, list or set display or
  comprehension, or a call of a mutable container or lock (``dict()``, ``defaultdict()``,
  ``weakref.WeakSet()``, ``threading.Lock()``, ...). A constant is immutable instead: a tuple, a
  ``frozenset``, or a dict wrapped read-only in ``types.MappingProxyType``;
- a ``global`` statement;
- ``functools.cache`` / ``lru_cache`` on a function that takes anything but immutable values
  (parameters annotated ``int``, ``str``, ``float``, ``bool``, ``bytes``): a cache keyed by an
  object that can change (or die and hand its id on) is state;
- assigning to an attribute of ``cls`` (a class attribute shared by every instance).

``__all__`` is a list by Python's convention, read by ``import *`` and by tests/test_surface.py and
written nowhere. What really is process-wide is in ``ALLOWED``, each with the reason.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

MUTABLE_CALLS = frozenset({
    "dict", "list", "set", "bytearray", "array", "defaultdict", "OrderedDict", "Counter", "deque", "ChainMap",
    "WeakSet", "WeakKeyDictionary", "WeakValueDictionary", "local", "Lock", "RLock", "Event", "Condition",
    "Semaphore", "BoundedSemaphore", "Queue", "SimpleQueue", "count",
})
MUTABLE_DISPLAYS = (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)
CACHE_DECORATORS = frozenset({"cache", "lru_cache"})
IMMUTABLE_ANNOTATIONS = frozenset({"int", "str", "float", "bool", "bytes"})

# (file, name): why it is process-wide. An entry that no longer matches anything fails too.
ALLOWED = {
    ("conveyor/schedule/registry.py", "_REGISTRY"):
        "the schedule names that build(), `conveyor simulate` and pipeline(schedule=name) resolve; users add "
        "theirs with register(), which every later build in the process must see (as Python's codec registry)",
    ("conveyor/runtime/transport/shm_ring.py", "_FENCE"):
        "a lock that guards no data: acquiring and releasing it is this thread's full memory fence",
    ("conveyor/runtime/transport/shm.py", "SharedMemoryTransport._instances"):
        "numbers the transports this process builds over each process group, so that every rank derives "
        "the same store keys in build order; a counter per transport would restart at 0 for each pipeline",
    ("conveyor/runtime/transport/hybrid.py", "HostExchange._rounds"):
        "numbers the host exchanges this process runs over each process group, as _instances above",
    ("conveyor/runtime/transport/shm_ring.py", "_LAYOUTS"):
        "pending (issue 42 item 4 gives the shared-memory sender an object of its own, its home): a bounded "
        "cache (256 entries) of the byte layout per message structure, holding the structure it is keyed by",
}


def _call_name(node: ast.expr) -> str | None:
    func = node.func if isinstance(node, ast.Call) else None
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return None


def _is_mutable(value: ast.expr | None) -> bool:
    return isinstance(value, MUTABLE_DISPLAYS) or (isinstance(value, ast.Call) and _call_name(value) in MUTABLE_CALLS)


def _bindings(body: list[ast.stmt]) -> Iterator[tuple[str, ast.expr | None, int]]:
    for node in body:
        if isinstance(node, ast.Assign):
            for target in node.targets:
                for name in ast.walk(target):
                    if isinstance(name, ast.Name):
                        yield name.id, node.value, node.lineno
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            yield node.target.id, node.value, node.lineno


def _cache_of_mutable_arguments(function: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    decorators = {_call_name(d) if isinstance(d, ast.Call) else
                  (d.id if isinstance(d, ast.Name) else getattr(d, "attr", None)) for d in function.decorator_list}
    if not decorators & CACHE_DECORATORS:
        return False
    arguments = function.args.posonlyargs + function.args.args + function.args.kwonlyargs
    return any(not isinstance(a.annotation, ast.Name) or a.annotation.id not in IMMUTABLE_ANNOTATIONS
               for a in arguments)


def module_state(path: Path, source: str) -> list[tuple[str, str, int]]:
    """``(name, what, line)`` for each piece of mutable state in one module's ``source`` (see the module docstring).

    Example:
        >>> module_state(Path("m.py"), "SEEN = set()\\nSIZES = (1, 2)\\nclass A:\\n    hits = {}\\n")
        [('SEEN', 'a mutable value at module level', 1), ('A.hits', 'a mutable class attribute', 4)]
    """
    tree = ast.parse(source, str(path))
    found = [(name, "a mutable value at module level", line) for name, value, line in _bindings(tree.body)
             if name != "__all__" and _is_mutable(value)]
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            found += [(f"{node.name}.{name}", "a mutable class attribute", line)
                      for name, value, line in _bindings(node.body) if _is_mutable(value)]
        elif isinstance(node, ast.Global):
            found += [(name, "a global statement", node.lineno) for name in node.names]
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and _cache_of_mutable_arguments(node):
            found.append((node.name, "a cache keyed by arguments that are not immutable values", node.lineno))
        elif isinstance(node, ast.Assign | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            found += [(f"cls.{t.attr}", "an assignment to a class attribute", node.lineno) for t in targets
                      if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "cls"]
    return found


def library_state() -> dict[tuple[str, str], str]:
    """Every piece of mutable state in ``conveyor/``, by (file, name): what it is and where."""
    state = {}
    for path in sorted((ROOT / "conveyor").rglob("*.py")):
        relative = path.relative_to(ROOT).as_posix()
        for name, what, line in module_state(path, path.read_text()):
            state[relative, name] = f"{relative}:{line}: {name} is {what}"
    return state


def test_the_library_keeps_no_module_level_mutable_state():
    state = library_state()
    refused = [where for key, where in state.items() if key not in ALLOWED]
    assert not refused, (
        "module-level mutable state (a pipeline's state belongs on an object the caller holds):\n  "
        + "\n  ".join(refused)
        + "\nMake it a constant (a tuple, a frozenset, a MappingProxyType), or put it on the object that owns it; "
        "if it truly is process-wide, add it to ALLOWED in tests/test_no_module_state.py with the reason."
    )


def test_every_allowed_entry_is_still_there():
    stale = sorted(set(ALLOWED) - set(library_state()))
    assert not stale, f"ALLOWED entries that match no state any more (moved or gone: update or drop them): {stale}"


def test_the_check_finds_each_kind_of_state():
    source = (
        "import functools, threading, weakref\n"
        "from types import MappingProxyType\n"
        "CACHE = {}\n"
        "seen: weakref.WeakSet = weakref.WeakSet()\n"
        "LOCK = threading.Lock()\n"
        "UNITS = MappingProxyType({'k': 1000})\n"
        "KINDS = frozenset({'F', 'B'})\n"
        "__all__ = ['CACHE']\n"
        "class Exchange:\n"
        "    rounds = []\n"
        "    @classmethod\n"
        "    def next(cls):\n"
        "        cls.count = 1\n"
        "def flag():\n"
        "    global DONE\n"
        "@functools.cache\n"
        "def spec(length: int): ...\n"
        "@functools.lru_cache(maxsize=8)\n"
        "def layout(meta): ...\n"
    )
    assert sorted(name for name, _, _ in module_state(Path("example.py"), source)) == sorted([
        "CACHE", "seen", "LOCK", "Exchange.rounds", "cls.count", "DONE", "layout"])
