"""The package's shape, read from its source (ast): offload's stages import only downward,
no import cycle among modules, and the torch-free layers import without torch.

STAGES is the one statement of offload's layer order (README, Layout, repeats it)."""

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOPS = ("offload", "optim", "cli", "profiles")

# offload's sub-packages, lowest first: a module may import its own stage and those before it.
STAGES = ["core", "update", "plan", "runtime", "engine", "tools"]

# Cycles allowed, as (importer, imported) edges: none. (The engine's helpers took the whole
# Engine back until it became a composition.)
KNOWN_CYCLE_EDGES: set[tuple[str, str]] = set()


def python_files(root: Path, *dirs: str) -> list[Path]:
    """The .py files under `dirs` that are the project's: those git tracks (not a venv or a
    build a developer made in the tree, e.g. bench/.ds-venv); outside a git checkout, a walk
    that skips dot-directories and what a .gitignore names."""
    try:
        top = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=root, capture_output=True, text=True)
        if top.returncode == 0 and Path(top.stdout.strip()).resolve() == root.resolve():
            listed = subprocess.run(["git", "ls-files", "-z", "--", *dirs], cwd=root, capture_output=True,
                                    text=True, check=True).stdout.split("\0")
            return sorted(root / f for f in listed if f.endswith(".py") and (root / f).is_file())
    except OSError:  # no git: walk
        pass
    return sorted(p for d in dirs for p in walk(root, root / d) if p.suffix == ".py")


def walk(root: Path, folder: Path) -> list[Path]:
    """Files under `folder`, without dot-directories and what the .gitignore files (root's and
    those on the way) name, read simply: one name or glob a line."""
    import fnmatch
    import os

    def patterns(d: Path) -> list[str]:
        f = d / ".gitignore"
        lines = f.read_text().splitlines() if f.is_file() else []
        return [ln.strip().strip("/") for ln in lines if ln.strip() and not ln.startswith(("#", "!"))]

    found, rules = [], patterns(root)
    for here, dirs, files in os.walk(folder):
        here_path = Path(here)
        local = rules + [r for d in (here_path, *here_path.parents) if d != root and root in d.parents
                         for r in patterns(d)]

        def ignored(name: str) -> bool:
            rel = (here_path / name).relative_to(root).as_posix()
            return any(fnmatch.fnmatch(name, r) or fnmatch.fnmatch(rel, r) for r in local)

        dirs[:] = [d for d in dirs if not d.startswith(".") and not ignored(d)]
        found += [here_path / f for f in files if not ignored(f)]
    return found


def modules(root: Path = ROOT, prefix: str = "tierwise.") -> dict[str, Path]:
    """Dotted name -> file for every module of the package (packages by their __init__)."""
    found = {}
    for top in TOPS:
        for path in python_files(root, top):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[prefix + ".".join(parts)] = path
    return found


def import_graph(root: Path = ROOT, prefix: str = "tierwise.") -> dict[str, set[str]]:
    """module -> the package modules it imports anywhere (top level, functions, TYPE_CHECKING)."""
    mods = modules(root, prefix)
    graph = {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                bases, names = [a.name for a in node.names], []
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                else:
                    base = node.module
                bases, names = [base], [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for target in names + bases:
                if target in mods:
                    targets.add(target)
                    if target in names:
                        break  # `from pkg import submodule`: the submodule, not pkg's face
        targets.discard(name)
        graph[name] = targets
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def test_graph_sees_imports():
    graph = import_graph()
    assert "tierwise.offload.core.errors" in graph["tierwise.offload.engine.engine"]
    assert "tierwise.cli.checkpoint" in graph["tierwise.cli.train"]  # `from . import checkpoint`
    assert "tierwise.profiles" in graph["tierwise.offload.plan.planner"]


def test_source_files_are_the_tracked_ones_not_a_venv_in_the_tree(tmp_path):
    """A developer's bench/.ds-venv (a DeepSpeed venv, or a symlink to one) and other ignored or
    untracked files are not the project's: the structure tests read what git tracks, or without
    git, a walk that skips dot-directories and ignored paths."""
    for rel in ("bench/a.py", "bench/.ds-venv/lib/deepspeed/x.py", "bench/build/y.py", "bench/b.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("import offload\n")
    (tmp_path / "bench/.gitignore").write_text("build/\n")
    assert walk(tmp_path, tmp_path / "bench") and python_files(tmp_path, "bench") == \
        [tmp_path / "bench/a.py", tmp_path / "bench/b.py"]  # no git here: the walk
    git = ["git", "-c", "init.defaultBranch=main"]
    subprocess.run([*git, "init", "-q"], cwd=tmp_path, check=True)
    subprocess.run([*git, "add", "bench/a.py"], cwd=tmp_path, check=True)
    assert python_files(tmp_path, "bench") == [tmp_path / "bench/a.py"]  # b.py is not tracked
    assert (ROOT / "bench/e2e_vs_deepspeed.py") in python_files(ROOT, "bench")


def test_no_bare_top_level_imports():
    """Inside the package imports are relative; tests, bench and examples import `tierwise.…`.
    A bare `offload`/`optim`/`cli`/`profiles` works in a checkout and breaks once installed."""
    bare = []
    for path in python_files(ROOT, *TOPS, "tests", "bench", "examples"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) and not node.level else [])
            bare += [f"{path.relative_to(ROOT)}:{node.lineno}: {n}" for n in names if n and n.split(".")[0] in TOPS]
    assert not bare, "bare imports:\n" + "\n".join(bare)


def test_offload_stages_import_only_downward():
    assert sorted(p.name for p in (ROOT / "offload").iterdir() if (p / "__init__.py").exists()) == sorted(STAGES)
    rank = {stage: i for i, stage in enumerate(STAGES)}
    up = []
    for mod, targets in import_graph().items():
        parts = mod.split(".")
        if parts[1] != "offload" or len(parts) < 4:
            continue  # offload's face (lazy) and the other top-level packages
        for target in targets:
            tparts = target.split(".")
            if tparts[1] == "offload" and len(tparts) >= 3 and rank[tparts[2]] > rank[parts[2]]:
                up.append(f"{mod} -> {target}")
    assert not up, "imports running up offload's stages:\n" + "\n".join(up)


def test_profiles_and_optim_stay_below_the_engine():
    """profiles reads only offload.core (the planner imports profiles); optim imports none of ours."""
    bad = [f"{m} -> {t}" for m, ts in import_graph().items() for t in ts
           if (m.startswith("tierwise.profiles") and not t.startswith(("tierwise.profiles", "tierwise.offload.core")))
           or (m.startswith("tierwise.optim") and not t.startswith("tierwise.optim"))]
    assert not bad, bad


def test_no_import_cycle_but_the_known_one():
    graph = import_graph()
    stale = [e for e in KNOWN_CYCLE_EDGES if e[1] not in graph.get(e[0], ())]
    assert not stale, f"no longer imported, remove from KNOWN_CYCLE_EDGES: {stale}"
    pruned = {m: {t for t in ts if (m, t) not in KNOWN_CYCLE_EDGES} for m, ts in graph.items()}
    assert cycles(pruned) == [], "new import cycle(s)"


def test_layers_import_without_torch():
    """profiles, offload's face, core, the planner's modules and the CLI's entry import on a
    machine without torch/transformers, and plan: make_plan for every shipped model profile
    (the optimizer table's state bytes are closed-form) and `finetune plan --model 7b
    --hardware h100` (a profile plans by name; a model directory still needs transformers)."""
    script = textwrap.dedent("""
        import contextlib, io, pathlib, sys
        class NoTorch:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("torch", "transformers"):
                    raise ModuleNotFoundError("no " + name)
        sys.meta_path.insert(0, NoTorch())
        import tierwise.cli.main, tierwise.offload.core.chunks
        import tierwise.offload.plan.homes, tierwise.offload.plan.perfmodel, tierwise.offload.plan.placement
        import tierwise.offload.plan.planner, tierwise.offload.plan.schedule
        from tierwise.offload import TierwiseError, format_size, parse_size
        from tierwise.profiles import load_hardware_profile, load_model_profile
        assert load_model_profile("7b").num_params > 6e9 and load_hardware_profile("h100").gpu
        assert format_size(parse_size("24G")) == "24.00 GiB"
        from tierwise.offload.plan.planner import make_plan
        from tierwise.offload.update.table import NAMES
        for i, toml in enumerate(sorted(pathlib.Path("profiles/models").glob("*.toml"))):
            rotated = NAMES[i % len(NAMES)]  # (MeZO on a MoE is refused: MOE_ZEROTH)
            rotated = "adamw" if rotated == "mezo" and load_model_profile(toml.stem).moe else rotated
            for optimizer in NAMES if toml.stem == "100m" else (rotated,):  # every table entry
                plan = make_plan(model=toml.stem, hardware="h100", gpu_mem="80G", cpu_mem="8T",
                                 optimizer=optimizer, precision="bf16", batch_size=1, seq_len=128)
                assert plan.step_s > 0 and plan.peak["gpu"] <= 80 << 30, (toml.stem, optimizer)
        out = io.StringIO()
        sys.argv = ["finetune", "plan", "--model", "7b", "--hardware", "h100", "--optimizer", "galore"]
        with contextlib.redirect_stdout(out):
            try:
                tierwise.cli.main.main()
            except SystemExit as e:
                assert not e.code, e.code
        assert "llama-2-7b" in out.getvalue().lower() and "bottleneck" in out.getvalue(), out.getvalue()
        assert "torch" not in sys.modules, sorted(m for m in sys.modules if m.startswith("torch"))
        print("ok")
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]
