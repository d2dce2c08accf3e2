"""The shape of the code, read from the source and from runs: `tests` may import anything;
`scripts` the product packages but never `tests`; `trainer` imports `model`, `dataset` and
`common`; `model` and `dataset` import only `common` (and themselves), which imports nothing
of the repository; no two modules import each other at load time, directly or through others.
And a reader follows one optimizer step, or one save, through a handful of files, none long."""
import ast
import sys
from pathlib import Path

import pytest

from tests.support import REPO_ROOT

PACKAGES = ("common", "model", "dataset", "trainer", "scripts", "tests")
MAY_IMPORT = {
    "common": {"common"},
    "model": {"common", "model"},
    "dataset": {"common", "dataset"},
    "trainer": {"common", "model", "dataset", "trainer"},
    "scripts": {"common", "model", "dataset", "trainer", "scripts"},
    "tests": set(PACKAGES),
}


def repo_imports(path: Path, top_level_only: bool) -> set[str]:
    """Modules of the repository that `path` imports (all of them, or those at load time).
    Relative imports count from the file's package, and `from package import name` counts as
    an import of package.name when that is a module."""
    package = ".".join(path.parent.relative_to(REPO_ROOT).parts)
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else ast.walk(tree)
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module if node.level == 0 else ".".join(filter(None, [package, node.module]))
            if base:
                found.add(base)
                found |= {f"{base}.{alias.name}" for alias in node.names
                          if (REPO_ROOT / base.replace(".", "/") / f"{alias.name}.py").is_file()}
    return {name for name in found if name.split(".")[0] in PACKAGES and name not in PACKAGES}


def modules() -> dict[str, Path]:
    """Every module of the packages, sub-packages too (scripts/bench, tests/support), by dotted name."""
    return {".".join(p.relative_to(REPO_ROOT).with_suffix("").parts): p for package in PACKAGES
            for p in (REPO_ROOT / package).rglob("*.py") if p.stem != "__init__"}


def test_every_package_imports_only_its_own_layer_and_below():
    wrong = [f"{name} imports {target}" for name, path in modules().items()
             for target in repo_imports(path, top_level_only=False)
             if target.split(".")[0] not in MAY_IMPORT[name.split(".")[0]]]
    assert not wrong, wrong


def test_no_import_cycle_at_load_time():
    found = modules()
    graph = {name: {t for t in repo_imports(path, top_level_only=True) if t in found} for name, path in found.items()}
    done, on_path = set(), []

    def visit(name):
        if name in on_path:
            raise AssertionError("import cycle: " + " -> ".join(on_path[on_path.index(name):] + [name]))
        if name in done:
            return
        on_path.append(name)
        for target in sorted(graph[name]):
            visit(target)
        on_path.pop()
        done.add(name)

    for name in sorted(graph):
        visit(name)


def test_the_check_sees_a_cycle_and_a_wrong_way_import(tmp_path, monkeypatch):
    """The two checks above can fail: a planted cycle, a model -> trainer and a scripts -> tests
    import are found."""
    for package, text in {"model": "from trainer import b\n", "trainer": "from .c import x\n"}.items():
        (tmp_path / package).mkdir()
        (tmp_path / package / ("a.py" if package == "model" else "b.py")).write_text(text)
    (tmp_path / "trainer" / "c.py").write_text("import model.a\n")
    for package in ("common", "dataset", "scripts", "tests"):
        (tmp_path / package).mkdir(exist_ok=True)
    (tmp_path / "scripts" / "bench.py").write_text("from tests.support.jobs import run_trainer\n")
    (tmp_path / "tests" / "jobs.py").write_text("")
    monkeypatch.setattr(sys.modules[__name__], "REPO_ROOT", tmp_path)
    with pytest.raises(AssertionError, match="model.a imports trainer.b") as wrong_way:
        test_every_package_imports_only_its_own_layer_and_below()
    assert "scripts.bench imports tests.support.jobs" in str(wrong_way.value)
    with pytest.raises(AssertionError, match="import cycle"):
        test_no_import_cycle_at_load_time()


PRODUCT = ("common", "model", "dataset", "trainer")
# The bounds a reader holds us to: files one optimizer step and one checkpoint save run through
# (scripts/dev/call_paths.py: 8 and 6 when these bounds were set, from 17 and 11; the step 10
# since the schedules and Muon's work across ranks have modules of their own), the modules of
# trainer/ (20 with auto.py, schedule.py and muon_ranks.py), and the lines of a product file.
# They guard against a sprawl, not against a module that gives a concept its own place.
STEP_FILES, SAVE_FILES, TRAINER_MODULES, MAX_LINES = 10, 8, 20, 450


@pytest.mark.slow
def test_one_step_and_one_save_run_through_a_handful_of_files():
    from scripts.dev.call_paths import measure

    paths = measure()
    assert 0 < len(paths["step"]) <= STEP_FILES, sorted(paths["step"])
    assert 0 < len(paths["save"]) <= SAVE_FILES, sorted(paths["save"])
    assert "trainer/checkpoint.py" in paths["save"] and "trainer/optim.py" in paths["step"]  # it measures a save, a step


def test_trainer_holds_few_modules_and_no_product_file_is_long():
    assert len([p for p in (REPO_ROOT / "trainer").glob("*.py") if p.stem != "__init__"]) <= TRAINER_MODULES
    long = [f"{p.relative_to(REPO_ROOT)} ({n} lines)" for package in PRODUCT for p in (REPO_ROOT / package).rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES]
    assert not long, long
