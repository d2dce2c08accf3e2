"""
The demo corpus: a small, real English pre-training corpus built offline from the
docstrings of the Python standard library, at DEMO_CORPUS (the trainer's and the
tokenizer trainer's default --data_path). scripts/build_demo_corpus.py is its command line.

Every stdlib module is imported in its own short-lived child process (this file, run
as `python -I -S demo_corpus.py MODULE`), so an import that hangs, crashes or prints
cannot hurt the build: it is skipped. The output is one {"text": ...} JSON object per
line and is byte-identical between runs on the same Python. This module imports the
standard library only, since its children run without site-packages.
"""
import inspect
import json
import os
import re
import signal
import subprocess
import sys
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

DEMO_CORPUS = Path(__file__).resolve().parent / "demo_pretrain.jsonl"

MIN_CHARS = 200
DEFAULT_TIMEOUT = 30.0

# Modules that open windows, start browsers, print on import, are test suites,
# or are hijacked by third-party packages (distutils is replaced by setuptools'
# copy in most venvs, which would make the corpus depend on site-packages).
# encodings is kept but not walked: its ~120 codec submodules are boilerplate.
SKIP_MODULES = {
    "antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo",
    "test", "lib2to3", "pydoc_data", "ensurepip", "distutils",
}
SKIP_WALK = {"encodings"}
SKIP_SUBMODULES = {"test", "tests", "idle_test"}


# -----------------------------------------------------------------------------
# Module discovery (parent process: nothing is imported here)

def _submodules(name, search_locations):
    """Public submodules of a package, depth first and sorted, found on disk only."""
    import pkgutil
    infos = sorted(pkgutil.iter_modules(search_locations), key=lambda info: info.name)
    for info in infos:
        if info.name.startswith("_") or info.name in SKIP_SUBMODULES:
            continue
        full = f"{name}.{info.name}"
        yield full
        if info.ispkg:
            yield from _submodules(full, [os.path.join(info.module_finder.path, info.name)])


def discover_modules():
    """All public stdlib modules and their public submodules, in a fixed order."""
    import importlib.util
    names = []
    for name in sorted(sys.stdlib_module_names):
        if name.startswith("_") or name in SKIP_MODULES:
            continue
        names.append(name)
        if name in SKIP_WALK:
            continue
        # find_spec on a top-level name locates the package without executing it.
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations:
            names.extend(_submodules(name, list(spec.submodule_search_locations)))
    return names


# -----------------------------------------------------------------------------
# Docstring collection (child process)

def clean_doc(doc):
    """Dedent and tidy a docstring while keeping its paragraphs and code layout."""
    # Lone surrogates cannot be written as UTF-8; "?" keeps the rest of the doc.
    doc = doc.encode("utf-8", "replace").decode("utf-8")
    doc = doc.replace("\r\n", "\n").replace("\r", "\n").replace("\f", "\n").replace("\v", "\n")
    text = inspect.cleandoc(doc)
    text = "\n".join(line.rstrip() for line in text.split("\n"))
    # A single blank line is a paragraph break; longer gaps carry no meaning.
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.strip()


def _own_doc(obj):
    """obj.__doc__ if it is a string, guarding against objects with odd __getattr__."""
    try:
        doc = getattr(obj, "__doc__", None)
    except Exception:
        return None
    return doc if isinstance(doc, str) else None


def _belongs_to(obj, modname):
    """True if obj was defined in modname, in one of its submodules, or in its C
    accelerator (e.g. _io for io), so re-exported names are collected only once."""
    try:
        owner = getattr(obj, "__module__", None)
    except Exception:
        return False
    if not isinstance(owner, str):
        return False
    owner = owner.lstrip("_")
    return owner == modname or owner.startswith(modname + ".")


def _class_docs(cls, qualname):
    """(name, docstring) of the class followed by those of its own methods and properties."""
    docs = [(qualname, _own_doc(cls))]
    try:
        members = dict(vars(cls))
    except TypeError:
        return docs
    for name in sorted(members):
        attr = members[name]
        if isinstance(attr, (staticmethod, classmethod)):
            attr = attr.__func__
        if inspect.isclass(attr):
            continue  # nested classes are rare and mostly private helpers
        if callable(attr) or isinstance(attr, property):
            docs.append((f"{qualname}.{name}", _own_doc(attr)))
    return docs


def collect_named_docs(modname, min_chars=MIN_CHARS):
    """(qualified name, cleaned docstring of min_chars or more) of a module, its classes, methods
    and functions, in sorted-name order. Imports the module: call in a child."""
    import importlib
    module = importlib.import_module(modname)
    docs = [(modname, _own_doc(module))]
    namespace = dict(vars(module))
    for name in sorted(namespace):
        obj = namespace[name]
        qualname = f"{modname}.{name}"
        if name.startswith("__") or inspect.ismodule(obj):
            continue
        if inspect.isclass(obj):
            if _belongs_to(obj, modname):
                docs.extend(_class_docs(obj, qualname))
        elif inspect.isfunction(obj) or inspect.isbuiltin(obj):
            if _belongs_to(obj, modname):
                docs.append((qualname, _own_doc(obj)))
        else:
            # Instances with a docstring of their own, e.g. typing.Union.
            doc = _own_doc(obj)
            if doc is not None and doc != _own_doc(type(obj)):
                docs.append((qualname, doc))
    cleaned = ((qualname, clean_doc(doc)) for qualname, doc in docs if doc)
    return [(qualname, doc) for qualname, doc in cleaned if len(doc) >= min_chars]


def collect_module_docs(modname):
    """The cleaned docstrings of collect_named_docs, without their names."""
    return [doc for _, doc in collect_named_docs(modname)]


def _worker_main(modname, named=False):
    """Child entry point: print the module's docs as one JSON list on stdout; with --named, every
    docstring, however short, as [name, doc] pairs (dataset/demo_sft.py's)."""
    # Route anything the import prints, even from C code, to stderr so that
    # stdout carries nothing but our JSON.
    result_fd = os.dup(1)
    os.dup2(2, 1)
    warnings.simplefilter("ignore")
    docs = collect_named_docs(modname, min_chars=1) if named else collect_module_docs(modname)
    with os.fdopen(result_fd, "w", encoding="utf-8") as out:
        json.dump(docs, out, ensure_ascii=False)


# -----------------------------------------------------------------------------
# Build (parent process)

def _run_worker(modname, timeout, named=False):
    """Docs of one module from an isolated child, or None if it failed or hung."""
    # -I: ignore PYTHON* env vars and the script's folder on sys.path;
    # -S: no site-packages, so only the stdlib itself can be imported.
    cmd = [sys.executable, "-I", "-S", str(Path(__file__).resolve()), modname, *(["--named"] if named else [])]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # Kill the whole session in case the import started helpers of its own.
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return None
    if proc.returncode != 0:
        return None
    try:
        docs = json.loads(out.decode("utf-8"))
    except ValueError:
        return None
    return docs if isinstance(docs, list) else None


def build_demo_corpus(out_path=DEMO_CORPUS, modules=None, jobs=2, timeout=DEFAULT_TIMEOUT,
                      progress=True):
    """Write the corpus to out_path atomically and return a summary dict."""
    from tqdm import tqdm  # here, not at the top: the children import this file without site-packages

    from common.storage import AtomicFile
    t0 = time.time()
    out_path = Path(out_path)
    modules = list(modules) if modules is not None else discover_modules()
    seen, n_docs, skipped = set(), 0, []
    out_path.parent.mkdir(parents=True, exist_ok=True)
    # shared: a temp file of this process's own, should two processes build it at once.
    corpus = AtomicFile(out_path, "the demo corpus", shared=True,
                        elsewhere="build it elsewhere (scripts/build_demo_corpus.py --out)")
    with corpus, ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        # map() yields in submission order, so parallelism cannot reorder docs.
        results = pool.map(lambda name: _run_worker(name, timeout), modules)
        bar = tqdm(zip(modules, results), total=len(modules), desc="stdlib docstrings",
                   unit="mod", disable=not (progress and sys.stderr.isatty()))  # no \r noise in log files
        for name, docs in bar:
            if docs is None:
                skipped.append(name)
                continue
            for doc in docs:
                if isinstance(doc, str) and doc not in seen:
                    seen.add(doc)
                    corpus.write((json.dumps({"text": doc}, ensure_ascii=False) + "\n").encode("utf-8"))
                    n_docs += 1
    return {
        "path": str(out_path),
        "documents": n_docs,
        "bytes": out_path.stat().st_size,
        "seconds": round(time.time() - t0, 1),
        "modules": len(modules),
        "skipped": skipped,
    }


def ensure_demo_corpus(path=DEMO_CORPUS):
    """Return path, building the demo corpus there first if it does not exist yet.
    Call it from one process only (e.g. rank 0); the write itself is atomic."""
    path = Path(path)
    if not path.is_file() or path.stat().st_size == 0:
        print(f"[demo corpus] {path} not found, building it from stdlib docstrings...")
        print(format_summary(build_demo_corpus(path)))
    return path


def format_summary(summary):
    return (f"[demo corpus] {summary['documents']} documents, {summary['bytes']:,} bytes, "
            f"{summary['seconds']}s ({summary['modules']} modules, {len(summary['skipped'])} skipped)"
            f" -> {summary['path']}")


if __name__ == "__main__":
    _worker_main(sys.argv[1], named="--named" in sys.argv[2:])  # a child of _run_worker
