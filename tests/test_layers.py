"""The import contracts in pyproject.toml's [tool.importlinter] hold (DESIGN.md, "Layers").

Each contract is its own test, `lint-imports --contract ID`; a broken one fails with the
linter's report, which names every offending import as `importer -> imported (l.N)`.
import-linter reads every import statement of a file: those inside functions and under
`if TYPE_CHECKING:` count, and so do chains through other modules.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

try:
    from importlinter.api import read_configuration
except ModuleNotFoundError as exc:  # pragma: no cover - an environment without the test extra
    raise ImportError("tests/test_layers.py needs import-linter: run `make setup` (requirements/cpu.txt) "
                      "or `.venv/bin/pip install import-linter`") from exc

from recps.config import PROJECT_ROOT

PYPROJECT = PROJECT_ROOT / "pyproject.toml"
CONFIG = read_configuration(str(PYPROJECT))
CONTRACTS = {c["id"]: c for c in CONFIG["contracts_options"]}
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")  # the console script next to this python
# Modules of recps/ and recps/ps/ that the layers contract leaves out on purpose: name -> why.
UNLAYERED: dict[str, str] = {}


def _lint(*args: str) -> subprocess.CompletedProcess:
    if not LINT_IMPORTS.is_file():
        pytest.fail(f"no {LINT_IMPORTS}: install import-linter into this environment "
                    f"(`{sys.executable} -m pip install import-linter`)")
    # cwd: lint-imports puts it first on sys.path, so this checkout is analysed, not an installed copy.
    # --no-cache: leave no .import_linter_cache in the checkout.
    return subprocess.run([str(LINT_IMPORTS), "--no-cache", "--no-logo", *args, str(PYPROJECT)],
                          cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=120)


def test_the_contracts_are_the_ones_designed():
    """A contract deleted or renamed in pyproject.toml fails here, not silently."""
    assert sorted(CONTRACTS) == sorted([
        "layers", "l0-independent", "models-pure", "engine-names-models", "observers-not-trainer",
        "orchestration-through-fleet", "transport-client-server", "funnel-runner-not-stream",
        "generators-ctr-alone", "observers-not-config",
    ])
    assert CONFIG["session_options"]["root_packages"] == ["recps", "models"]


@pytest.mark.e2e
@pytest.mark.parametrize("contract", list(CONTRACTS))
def test_contract_holds(contract):
    proc = _lint("--contract", contract)
    report = (proc.stdout + proc.stderr).strip()
    if proc.returncode != 0 or "KEPT" not in report:
        pytest.fail(f"import contract {contract!r} ({CONTRACTS[contract]['name']}) is not kept "
                    f"(lint-imports exit {proc.returncode}):\n{report}", pytrace=False)


def _layer_modules(layers: list[str]) -> set[str]:
    """The module names a layers contract lists: "a | b", "a : b", "(optional)"."""
    return {tail.strip().strip("()") for layer in layers for tail in re.split(r"[|:]", layer)}


def test_every_module_has_a_layer():
    """Each module directly in recps/ and recps/ps/ is named by the layers contract: one that is
    not is free to import anything (only chains through it are checked). A new module gets a
    layer in pyproject.toml, or, with a reason, an entry in UNLAYERED."""
    named = _layer_modules(CONTRACTS["layers"]["layers"])
    graph = grimp.build_graph("recps", cache_dir=None)
    children = graph.find_children("recps") | graph.find_children("recps.ps")
    containers = {"recps.ps"}  # its children are the layers
    unplaced = sorted(m for m in children - named - containers - set(UNLAYERED) if not m.endswith(".__main__"))
    if unplaced:
        pytest.fail(f"{unplaced}: in no layer of pyproject.toml's `layers` contract; add each to the "
                    "layer between what it imports and what imports it", pytrace=False)


# Code above Fleet (orchestration, the engine, the entry points) reaches the PS through Fleet's
# verbs (recps.ps.fleet: create_dense_table, wait_for_workers, pull_dense_into, save, channel(), ...),
# never through the node-level client behind it. Below Fleet (recps/ps/) and the base (recps/fs/,
# whose HDFS client is its own) are left out.
_REACHES_THROUGH = re.compile(r"\b(?:fleet|communicator)\.client\b|\._client\b")
_BELOW_FLEET = ("recps/ps/", "recps/fs/")


def test_nothing_above_fleet_reaches_through_its_client():
    root = PROJECT_ROOT / "recps"
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(PROJECT_ROOT).as_posix()
        if rel.startswith(_BELOW_FLEET):
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if _REACHES_THROUGH.search(line.split("#", 1)[0]):
                found.append(f"{rel}:{n}: {line.strip()}")
    assert len(list(root.rglob("*.py"))) > 100  # the walk found the package
    assert not found, ("code above Fleet reaches through fleet.client / ._client; give recps.ps.fleet.Fleet "
                       "the verb and call it:\n" + "\n".join(found))


def test_the_guard_sees_a_reach_through():
    """The pattern above matches the forms it forbids, and not Fleet's own verbs."""
    assert _REACHES_THROUGH.search("fleet.client.barrier('x')")
    assert _REACHES_THROUGH.search("x = self.fleet.client")
    assert _REACHES_THROUGH.search("ServerReader(communicator.client)")
    assert _REACHES_THROUGH.search("obj._client.pull(t, k)")
    assert not _REACHES_THROUGH.search("fleet.wait_for_workers('x'); fleet.channel()")


def _circles(graph, modules) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in sorted(modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root) & modules)))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on.add(child)
                    work.append((child, iter(sorted(graph.find_modules_directly_imported_by(child) & modules))))
                elif child in on:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                scc = []
                while True:
                    m = stack.pop()
                    on.discard(m)
                    scc.append(m)
                    if m == node:
                        break
                if len(scc) > 1:
                    out.append(sorted(scc))
    return out


def test_no_import_circles():
    """No two modules of recps import each other, directly or through others (imports inside
    functions count: they are circles all the same, only later). Closed in issue 28: config <->
    debug.dump / metrics.reporter, transport client <-> server, pipeline runner <-> incremental,
    fs <-> fs.hdfs."""
    graph = grimp.build_graph("recps", cache_dir=None)
    modules = set(graph.modules)
    assert len(modules) > 100
    circles = _circles(graph, modules)
    assert not circles, "import circles:\n" + "\n".join(" <-> ".join(c) for c in circles)
