"""The shape of the code, checked: layers, names owned by RunDir, docstrings, file sizes,
and the config's allowed-name tables against the implementations (the registries: tests/test_rules_once.py).

Read with ``ast`` (nothing imported), so a violation is reported as file:line.
"""
from __future__ import annotations

import ast
import importlib
import inspect
import re
from pathlib import Path

import pytest
import torch

from hpcrl.config import names, registries

PKG = Path(__file__).resolve().parents[1] / "hpcrl"

BOTTOM_ORDER = [
    ("config",),
    ("process", "tiny"),
    ("rundir",),
    ("logs",),
    ("samples",),
    ("control",),
    ("weights",),
]
"""The bottom layer, lowest first: the run directory's contracts every job and the launcher build on.
A module may import its own package and anything on a lower level, nothing on its own level or above."""
BOTTOM = [part for level in BOTTOM_ORDER for part in level]
UPPER = ("hpcrl.trainer", "hpcrl.rollout", "hpcrl.eval", "hpcrl.reward", "hpcrl.launcher", "hpcrl.analysis",
         "hpcrl.cli")
"""The jobs, the launcher and the analysis: nothing below may import them."""


def _files(*parts: str) -> list[Path]:
    out = []
    for part in parts:
        p = PKG / part
        out += sorted(p.rglob("*.py")) if p.is_dir() else [p]
    return out


def _module(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    return ".".join(rel.parts).removesuffix(".__init__")


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, imported module) for every import, including those inside functions."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
            out += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return out


MODULES = {_module(p): p for p in _files(".")}
"""Every module of the package by dotted name (a package by its ``__init__``)."""


def _target(name: str):
    """The hpcrl module an imported dotted name lives in (``hpcrl.x.y`` for ``hpcrl.x.y.SomeClass``)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _edges() -> dict[str, set[str]]:
    """module -> the hpcrl modules it imports (at the top or inside a function). ``from pkg import
    sub`` is an edge to the submodule only, ``from pkg import name`` to the package's ``__init__``."""
    out = {}
    for mod, path in MODULES.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {_target(a.name) for a in node.names if a.name.startswith("hpcrl")}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("hpcrl"):
                targets |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in MODULES else _target(node.module)
                            for a in node.names}
        out[mod] = {t for t in targets if t and t != mod}
    return out


def _level(mod: str):
    rel = mod.removeprefix("hpcrl.")
    for i, level in enumerate(BOTTOM_ORDER):
        for part in level:
            name = part.removesuffix(".py")
            if rel == name or rel.startswith(name + "."):
                return i, name
    return None


def test_bottom_layers_import_only_lower_levels_and_nothing_above():
    bad = []
    for p in _files(*BOTTOM):
        mod = _module(p)
        level, pkg = _level(mod)
        for line, name in _imports(p):
            target = _target(name) if name.startswith("hpcrl") else None
            if target is None or target == "hpcrl":
                continue
            other = _level(target)
            if other is None:
                bad.append(f"{p.relative_to(PKG.parent)}:{line} imports {target} (not in the bottom layer)")
            elif other[1] != pkg and other[0] >= level:
                bad.append(f"{p.relative_to(PKG.parent)}:{line} imports {target} (level {other[0]}, "
                           f"{BOTTOM_ORDER[other[0]]}), not below its own level {level}")
    assert not bad, "the bottom layer's order is broken:\n" + "\n".join(bad)


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of two or more modules: each is a loop of imports."""
    index, low, stack, on, cycles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while not comp or comp[-1] != v:
                comp.append(stack.pop())
                on.discard(comp[-1])
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return cycles


def test_no_import_cycle_between_any_two_modules():
    """Every import counts, lazy ones inside functions too (a registry importing its backends lazily
    while they import it is still a loop)."""
    cycles = _cycles(_edges())
    assert not cycles, "modules that import each other (through a loop of imports):\n" + "\n".join(map(str, cycles))


def test_the_import_walk_resolves_names_and_finds_loops():
    assert _target("hpcrl.samples.schema.Group") == "hpcrl.samples.schema"
    assert "hpcrl.samples.schema" in _edges()["hpcrl.samples.writer"]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_trainer_and_rollout_never_import_each_other():
    bad = [f"{p.relative_to(PKG.parent)}:{line} imports {m}"
           for side, other in (("trainer", "hpcrl.rollout"), ("rollout", "hpcrl.trainer"))
           for p in _files(side) for line, m in _imports(p) if m == other or m.startswith(other + ".")]
    assert not bad, "the two jobs only meet in the run directory:\n" + "\n".join(bad)


def test_the_reward_job_meets_the_others_only_through_its_service():
    """hpcrl/reward/ imports rollout's engine interface (a judge) and nothing of the trainer or the evaluation; the
    trainer imports nothing of it; the rollout and evaluation jobs reach it through ``reward/scoring.py`` (and the
    exceptions and records of ``reward/wire.py``), never the server or the job."""
    sides = (("reward", ("hpcrl.trainer", "hpcrl.eval")), ("trainer", ("hpcrl.reward",)),
             ("rollout", ("hpcrl.reward.job", "hpcrl.reward.server")), ("eval", ("hpcrl.reward.job", "hpcrl.reward.server")))
    bad = [f"{p.relative_to(PKG.parent)}:{line} imports {m}" for side, others in sides for p in _files(side)
           for line, m in _imports(p) for o in others if m == o or m.startswith(o + ".")]
    assert not bad, "the reward job is reached through its service:\n" + "\n".join(bad)


def test_the_evaluation_job_imports_no_trainer_and_no_job_imports_it():
    """The evaluation uses the rollout job's parts (engines, loops, data, reward); the trainer and the rollout
    job know nothing of it, and it knows nothing of the trainer."""
    bad = [f"{p.relative_to(PKG.parent)}:{line} imports {m}"
           for side, other in (("trainer", "hpcrl.eval"), ("rollout", "hpcrl.eval"), ("eval", "hpcrl.trainer"))
           for p in _files(side) for line, m in _imports(p) if m == other or m.startswith(other + ".")]
    assert not bad, "the evaluation is a reader of the run directory, like the other jobs:\n" + "\n".join(bad)


def test_bottom_layers_import_no_job_launcher_or_analysis():
    bad = [f"{p.relative_to(PKG.parent)}:{line} imports {mod}"
           for p in _files(*BOTTOM) for line, mod in _imports(p)
           if any(mod == u or mod.startswith(u + ".") for u in UPPER)]
    assert not bad, "lower layers import higher ones:\n" + "\n".join(bad)


def test_config_imports_only_the_config():
    bad = [f"{p.relative_to(PKG.parent)}:{line} imports {mod}" for p in _files("config")
           for line, mod in _imports(p) if mod.startswith("hpcrl") and not mod.startswith("hpcrl.config")]
    assert not bad, "the config is the bottom layer:\n" + "\n".join(bad)


def test_fsio_records_and_the_process_primitives_import_nothing_of_hpcrl():
    """``process/`` may use its own primitives (the one pid rule, ``process/pids.py``), nothing else of hpcrl."""
    assert not [m for _, m in _imports(PKG / "rundir" / "json_record.py") if m.startswith("hpcrl")]
    for p in _files("process"):
        assert not [m for _, m in _imports(p) if m.startswith("hpcrl") and not m.startswith("hpcrl.process")], p
    assert {m for _, m in _imports(PKG / "rundir" / "disk.py") if m.startswith("hpcrl")} <= {"hpcrl.process",
                                                                                            "hpcrl.process.faults"}, \
        "disk imports only the fault points (its writes can be made to fail in tests)"
    assert not [m for _, m in _imports(PKG / "rundir" / "fsio.py") if m.startswith("hpcrl")
                and not m.startswith("hpcrl.rundir.disk")], "fsio imports only the guarded writes"


JOB_LIFE = {"setup_logging", "mark_job", "sweep_leftovers", "PreemptionFlag", "requeue_self", "preempted_by_slurm",
            "termination.install", "heartbeat.stop"}
"""What a job does around its own steps (logging, leftovers, signals, preemption, final heartbeat, requeue):
``hpcrl/control/job.py`` only."""


def _called(call: ast.Call) -> str:
    f = call.func
    if isinstance(f, ast.Name):
        return f.id
    if isinstance(f, ast.Attribute):
        owner = f.value.attr if isinstance(f.value, ast.Attribute) else getattr(f.value, "id", "")
        return f.attr if f.attr in JOB_LIFE else f"{owner}.{f.attr}"
    return ""


def test_every_job_lives_in_the_one_lifecycle():
    """A second job skeleton fails here: a call that sets up a job's logging, sweeps an earlier attempt's leftovers,
    takes USR2, installs the SIGTERM handler, writes a final heartbeat or requeues, anywhere but control/job.py (the
    modules that define them excepted)."""
    home = {PKG / "control" / "job.py", PKG / "logs" / "run_logs.py", PKG / "process" / "leftovers.py",
            PKG / "process" / "preemption.py", PKG / "process" / "termination.py", PKG / "control" / "records.py"}
    bad = [f"{p.relative_to(PKG.parent)}:{node.lineno} calls {_called(node)}"
           for p in _files(".") if p not in home for node in ast.walk(ast.parse(p.read_text()))
           if isinstance(node, ast.Call) and _called(node) in JOB_LIFE]
    assert not bad, "a job's life is written once, in hpcrl/control/job.py:\n" + "\n".join(bad)


# Names that only RunDir may spell: file names of the run directory and job/writer names.
RUN_DIR_LITERALS = re.compile(
    r"manifest\.jsonl?|config\.yaml|trainer_done\.json|admission\.(json|lock)|latest\.json|metrics\.jsonl|"
    r"staleness\.jsonl|(?<!-)rollout-|trainer-rank|shard-|base_model(?!_name_or_path)|heartbeat/|loading/|\.setup\.sh|^secret$|"
    r"(^|[^a-z])w\{|w%03d|:03d\}")


def _docstring_ids(tree: ast.AST) -> set[int]:
    """ids of docstrings (modules, classes, functions, and the field docstrings under attributes)."""
    out = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        for stmt in body if isinstance(body, list) else []:
            if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) and isinstance(stmt.value.value, str):
                out.add(id(stmt.value))
    return out


MESSAGE_CALLS = {"debug", "info", "warning", "error", "exception", "emit", "print", "fail", "bad"}


def _message_ids(tree: ast.AST) -> set[int]:
    """ids of strings inside log calls, raised exceptions and reported config problems: prose that may name a file."""
    out = set()
    for node in ast.walk(tree):
        is_msg = isinstance(node, ast.Raise)
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            is_msg = name in MESSAGE_CALLS
        if is_msg:
            out |= {id(n) for n in ast.walk(node) if isinstance(n, ast.Constant)}
    return out


def test_no_path_or_job_name_literal_outside_run_dir():
    bad = []
    for p in _files("."):
        if p == PKG / "rundir" / "paths.py":
            continue
        tree = ast.parse(p.read_text())
        skip = _docstring_ids(tree) | _message_ids(tree)
        bad += [f"{p.relative_to(PKG.parent)}:{n.lineno}: {n.value!r}" for n in ast.walk(tree)
                if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in skip
                and RUN_DIR_LITERALS.search(n.value)]
    assert not bad, "paths and job names belong to hpcrl/rundir/paths.py:\n" + "\n".join(bad)


def _public_objects(module):
    """(qualified name, object) of the public classes and functions a module defines, and their methods."""
    for name, obj in vars(module).items():
        if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
            continue
        if inspect.isclass(obj):
            yield name, obj
            for mname, m in vars(obj).items():
                if not mname.startswith("_") and inspect.isfunction(m) and mname not in ("to_json", "from_json"):
                    yield f"{name}.{mname}", m
        elif inspect.isfunction(obj):
            yield name, obj


def test_cross_job_modules_document_every_public_class_and_function():
    """A method may inherit its docstring from the interface it implements (inspect.getdoc)."""
    missing = []
    for p in _files(*BOTTOM):
        module = importlib.import_module(_module(p))
        for qualname, obj in _public_objects(module):
            cls = getattr(module, qualname.split(".")[0])
            doc = inspect.getdoc(obj) if "." not in qualname else inspect.getdoc(getattr(cls, qualname.split(".")[1]))
            if not doc or (inspect.isclass(obj) and doc.startswith(f"{obj.__name__}(")):  # a dataclass's own
                missing.append(f"{p.relative_to(PKG.parent)} {qualname}")
    assert not missing, "public names without a docstring:\n" + "\n".join(missing)


def test_no_file_over_500_lines():
    long = [f"{p.relative_to(PKG.parent)}: {n} lines" for p in _files(".")
            if (n := len(p.read_text().splitlines())) > 500]
    assert not long, "split these files:\n" + "\n".join(long)


# ---- the allowed-name tables of the config have implementations, and only those --------
# (the registries of hpcrl/config/registries.py, name -> implementation, are checked in tests/test_rules_once.py)

def _calls(fn, names_, bogus="no-such-name"):
    """Every listed name is accepted by ``fn``; a bogus one is refused with ValueError."""
    for n in names_:
        fn(n)
    with pytest.raises(ValueError, match="allowed"):
        fn(bogus)


def test_advantage_estimators_match_the_implementation():
    from hpcrl.trainer.advantages import compute_advantages

    r, m, g = torch.tensor([[0.0, 1.0], [1.0, 0.0]]), torch.ones(2, 2), torch.tensor([0, 0])
    inputs = {"values": torch.zeros(2, 2), "w_token": torch.ones(2, 2), "reward_baselines": torch.zeros(2)}
    _calls(lambda e: compute_advantages(e, r, m, g, gamma=1.0, lam=1.0, **inputs), registries.ADV_ESTIMATORS)


def test_kl_estimators_and_controllers_match_the_implementation():
    from types import SimpleNamespace

    from hpcrl.trainer.kl import kl_estimate, make_controller

    _calls(lambda k: kl_estimate(torch.zeros(2), torch.zeros(2), k), names.KL_ESTIMATORS)
    _calls(lambda t: make_controller(SimpleNamespace(type=t, kl_coef=0.1, target_kl=0.1, horizon=10)),
           names.KL_CTRL_TYPES)


def test_loss_agg_modes_and_policy_losses_match_the_implementation():
    from hpcrl.trainer.losses import agg_loss
    from hpcrl.trainer.policy_losses import LossParams, policy_loss

    _calls(lambda mode: agg_loss(torch.ones(2, 3), torch.ones(2, 3), mode, horizon=3), names.LOSS_AGG_MODES)
    x, m = torch.zeros(2, 3), torch.ones(2, 3)
    _calls(lambda mode: policy_loss(mode, x, x, x, m, LossParams(dro_beta=0.1)), registries.POLICY_LOSS_MODES)


def test_rollout_correction_levels_match_the_implementation():
    from hpcrl.trainer.offpolicy import importance_weights, rejection_mask

    lr, m = torch.zeros(2, 3), torch.ones(2, 3)
    _calls(lambda lv: importance_weights(lr, m, lv, 2.0), names.IS_LEVELS)
    _calls(lambda lv: importance_weights(lr, m, lv, "0.5_2.0"), names.IS_LEVELS)
    _calls(lambda opt: rejection_mask(lr, m, opt, 2.0), names.RS_OPTIONS)


def test_pf_ppo_methods_match_the_implementation():
    from hpcrl.trainer.pf_ppo import pf_ppo_weights

    _calls(lambda method: pf_ppo_weights(torch.tensor([0.0, 1.0]), method, 2.0), names.PF_PPO_REWEIGHT_METHODS)


# ---- one fleet-resize path (launcher/fleet.py) ------------------------------------------------------

FLEET_PATH = "hpcrl/launcher/fleet.py"
RESIZE_NAMES = {
    "request_drain": "writes a drain record",
    "drained_writers": "reads who was drained (who is in the fleet is active_writers')",
    "used_writer_ids": "the numbers used (which numbers new writers get is new_writer_ids')",
    "record_fleet_size": "makes the frozen config follow the fleet",
    "DRAIN_REQUESTED": "logs a drain",
    "SCALE_APPLIED": "logs a resize",
}
"""What only the one resize path may do; besides it, the module that defines a name and the analysis (which reads
the fleet's history and drain records to show them) may name it."""
RESIZE_DEFINED_IN = {"request_drain": "hpcrl/control/fleet.py", "drained_writers": "hpcrl/control/fleet.py",
                     "DRAIN_REQUESTED": "hpcrl/control/fleet_log.py", "SCALE_APPLIED": "hpcrl/control/fleet_log.py",
                     "used_writer_ids": FLEET_PATH, "record_fleet_size": FLEET_PATH}


def _resize_outside_the_fleet_path(rel: str, source: str) -> list[str]:
    """Lines of ``source`` (the file ``rel``) that name what only ``launcher/fleet.py`` may do."""
    if rel == FLEET_PATH or rel.startswith("hpcrl/analysis/") or not any(n in source for n in RESIZE_NAMES):
        return []
    bad = []
    for node in ast.walk(ast.parse(source)):
        name = (node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute)
                else node.name if isinstance(node, ast.alias) else None)
        if name in RESIZE_NAMES and RESIZE_DEFINED_IN[name] != rel:
            bad.append(f"{rel}:{getattr(node, 'lineno', '?')}: {name} ({RESIZE_NAMES[name]})")
    return bad


def test_only_one_module_resizes_the_rollout_fleet():
    """``Run.scale``, ``hpcrl scale`` (with and without a launcher) and autoscale all go through ``Fleet.resize``:
    a second place that drains writers, picks writer numbers or logs a resize is a second resize path."""
    bad = [b for p in _files(".") for b in _resize_outside_the_fleet_path(str(p.relative_to(PKG.parent)),
                                                                           p.read_text())]
    assert not bad, f"only {FLEET_PATH} resizes the rollout fleet (Fleet.resize):\n" + "\n".join(bad)


def test_the_resize_check_finds_a_second_path():
    planted = ("from hpcrl.control.fleet import request_drain\nfrom hpcrl.launcher import fleet\n"
               "def shrink(rd, w):\n    request_drain(rd, w, 'me')\n    return max(fleet.used_writer_ids(rd)) + 1\n")
    assert _resize_outside_the_fleet_path("hpcrl/launcher/scale_cmd.py", planted) == [
        "hpcrl/launcher/scale_cmd.py:1: request_drain (writes a drain record)",
        "hpcrl/launcher/scale_cmd.py:4: request_drain (writes a drain record)",
        "hpcrl/launcher/scale_cmd.py:5: used_writer_ids (the numbers used (which numbers new writers get is "
        "new_writer_ids'))"]
    assert _resize_outside_the_fleet_path(FLEET_PATH, planted) == []


def _callbacks_handed_out(rel: str, source: str) -> list[str]:
    """Calls in a class's methods that pass one of its own methods (``self.scale``), or a lambda that uses
    ``self``, to something else: that something calls this object back."""
    bad = []
    for cls in [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef)]:
        methods = {f.name for f in cls.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                   and not any(isinstance(d, ast.Name) and d.id == "property" for d in f.decorator_list)}
        for call in [n for n in ast.walk(cls) if isinstance(n, ast.Call)]:
            for arg in [*call.args, *(k.value for k in call.keywords)]:
                own = (isinstance(arg, ast.Attribute) and isinstance(arg.value, ast.Name) and arg.value.id == "self"
                       and arg.attr in methods)
                closes = isinstance(arg, ast.Lambda) and any(isinstance(n, ast.Name) and n.id == "self"
                                                             for n in ast.walk(arg))
                if own or closes:
                    bad.append(f"{rel}:{arg.lineno}: {cls.name} hands {ast.unparse(arg)} to {ast.unparse(call.func)}")
    return bad


def test_no_launcher_object_hands_its_own_methods_to_another():
    """The launcher's objects form a tree (``RunHandle`` builds the jobs, the fleet, the autoscaler, the console and
    the follower; each calls only those below it): no two call each other through a callback."""
    bad = [b for p in _files("launcher") for b in _callbacks_handed_out(str(p.relative_to(PKG.parent)),
                                                                         p.read_text())]
    assert not bad, "launcher objects that would be called back:\n" + "\n".join(bad)
    planted = ("class RunHandle:\n    def __init__(self):\n        self.follower = RunFollower(scale=self.scale,\n"
               "            resubmit=lambda name: self.submit(name))\n    def scale(self, n): ...\n")
    assert _callbacks_handed_out("x.py", planted) == [
        "x.py:3: RunHandle hands self.scale to RunFollower",
        "x.py:4: RunHandle hands lambda name: self.submit(name) to RunFollower"]
