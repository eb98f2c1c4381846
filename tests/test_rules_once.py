"""Each rule written once: the admission budget's formula has one home (``hpcrl/config/knobs.py``), and the async
knobs one class.

Read with ``ast`` (nothing imported), so a copy is reported as file:line. Each search is also run on copies it
must find (the ones this code once held), so a search that stopped finding anything would fail too.
"""
from __future__ import annotations

import ast
import functools
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCANNED = [*sorted((REPO / "hpcrl").rglob("*.py")), *sorted((REPO / "bench").rglob("*.py")),
           *sorted((REPO / "analysis").rglob("*.py"))]
"""The package, the benches and the analysis scripts (tests keep their own oracles: verl's arithmetic)."""
BUDGET_HOME = REPO / "hpcrl" / "config" / "knobs.py"


@functools.lru_cache(maxsize=None)
def _parsed(path: Path) -> ast.AST:
    return ast.parse(path.read_text())


def _tree(code) -> ast.AST:
    """A file (parsed once for all the searches) or a snippet."""
    return _parsed(code) if isinstance(code, Path) else ast.parse(code)

ROUNDING = {"floor", "ceil", "int", "trunc", "round"}


def _factors(node: ast.AST) -> list[ast.AST]:
    """The factors of a product ``a * b * c`` (the node itself if it is not one)."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
        return _factors(node.left) + _factors(node.right)
    return [node]


def _one_plus(node: ast.AST) -> bool:
    """``1 + x`` or ``x + 1`` (``1.0`` too) with ``x`` not a constant: ``(1 + s)``."""
    sides = (node.left, node.right) if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add) else ()
    return (any(isinstance(x, ast.Constant) and x.value == 1 for x in sides)
            and not all(isinstance(x, ast.Constant) for x in sides))


def _identifiers(node: ast.AST) -> set[str]:
    return {n.id if isinstance(n, ast.Name) else n.attr for n in ast.walk(node)
            if isinstance(n, (ast.Name, ast.Attribute))}


def _rounded(tree: ast.AST):
    """Every expression rounded to a whole number: the arguments of floor/ceil/int/trunc/round, a ``//``'s left."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            if name in ROUNDING:
                yield from node.args
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.FloorDiv):
            yield node.left


def budget_copies(code) -> list[int]:
    """Lines that compute an admission budget: a product rounded to a whole number with a ``(1 + x)`` factor, or
    with a staleness among its factors (``floor((1 + s) * K * R)``, verl's ``int(R * (s + 1) * K)``,
    ``K*R + floor(staleness_threshold * K*R)``)."""
    lines = set()
    for expr in _rounded(_tree(code)):
        for node in ast.walk(expr):
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
                factors = _factors(node)
                if any(_one_plus(f) for f in factors) or any("stale" in name.lower() for f in factors
                                                              for name in _identifiers(f)):
                    lines.add(node.lineno)
    return sorted(lines)


def test_the_budget_search_finds_copies_and_nothing_else():
    copies = [
        "B = math.floor((1.0 + self.staleness_threshold) * self.trigger_parameter_sync_step\n"
        "               * self.groups_per_update + 1e-9)",                   # plan/pipeline.py had this
        "B = math.floor((1.0 + s) * self.K * self.R + 1e-9)",                   # analysis/budget_bound.py
        "lag = (math.floor((1 + s_new) * kr + 1e-9) - 1) // kr",                # analysis/recommend.py
        "budget = int((1 + a.staleness) * 4)",                                  # bench/bench_elastic.py
        "n = int(required_samples * (s + 1) * trigger)",                        # verl's own
        "b = kr + floor(cfg.async_training.staleness_threshold * kr)",          # the same rule rewritten
    ]
    for code in copies:
        assert budget_copies(code), code
    clean = ["x = math.floor(math.log10(abs(x)))", "c = torch.clamp(r, 1.0 - lo, 1.0 + hi)",
             "b = admission_budget(s, K, R)", "v = -((B - j * R) // (K * R))", "self.value *= 1.0 + e * n / h",
             "k = max(1, int(n * ratio))"]
    for code in clean:
        assert not budget_copies(code), code


def test_the_admission_budget_is_computed_only_in_config_knobs():
    found = [f"{p.relative_to(REPO)}:{line}" for p in SCANNED if p != BUDGET_HOME
             for line in budget_copies(p)]
    assert budget_copies(BUDGET_HOME), "the search no longer finds the formula in its home"
    assert not found, ("the admission budget floor((1 + s) * K * R) is computed again; call "
                       "hpcrl.config.knobs.admission_budget (or RunConfig.admission_budget) instead:\n"
                       + "\n".join(found))


SHARE_USERS = [REPO / "hpcrl" / "control" / "admission.py", REPO / "hpcrl" / "plan" / "events.py",
               REPO / "tests" / "plan_reference.py"]
"""Where a group start is decided: the admission lock, ``hpcrl plan``'s simulation and its reference (the tests'
oracle)."""


def _calls(tree: ast.AST, name: str) -> bool:
    return any(isinstance(n, ast.Call) and (getattr(n.func, "id", None) == name or getattr(n.func, "attr", None) == name)
               for n in ast.walk(tree))


ORDERING = (ast.Lt, ast.LtE, ast.Gt, ast.GtE)


def _cap_comparisons(code) -> list[int]:
    """Lines that order something against ``max_concurrent_groups`` (a per-job cap applied on its own)."""
    return sorted({n.lineno for n in ast.walk(_tree(code)) if isinstance(n, ast.Compare)
                   and any(isinstance(op, ORDERING) for op in n.ops)
                   and any("max_concurrent_groups" in _identifiers(side) for side in (n.left, *n.comparators))})


def test_the_budget_share_is_decided_by_one_function():
    """The share rule (``config/knobs.py: may_start``) and how many starts a job takes when it asks
    (``starts_allowed``: all the rule allows, in one turn) are the one description both the admission lock and the
    planner apply (as the budget's formula is): each calls it, and nothing compares with the per-job cap itself."""
    assert _cap_comparisons("while self.in_flight < k.max_concurrent_groups and pipe.started < limit:\n    pass")
    missing = [str(p.relative_to(REPO)) for p in SHARE_USERS if not _calls(_tree(p), "starts_allowed")]
    assert not missing, f"these decide group starts without hpcrl.config.knobs.starts_allowed: {missing}"
    config = REPO / "hpcrl" / "config"  # its checks of the value itself
    found = [f"{p.relative_to(REPO)}:{line}" for p in dict.fromkeys([*SCANNED, *SHARE_USERS])
             if config not in p.parents
             for line in _cap_comparisons(p)]
    assert not found, ("a per-job cap compared outside the share rule; call hpcrl.config.knobs.may_start (or read "
                       "Knobs.group_bound):\n" + "\n".join(found))


PLANNER_CANDIDATE = REPO / "hpcrl" / "plan"
"""``hpcrl plan``'s candidate (``hpcrl/plan/model.py: Knobs``) derives from the config's ``Knobs`` and adds the
simulator's own fields (trainer GPUs, ``max_num_seqs``, lengths): the one other class named so."""


def test_one_class_holds_the_async_knobs():
    defined = [f"{p.relative_to(REPO)}:{node.lineno}" for p in SCANNED
               if p != BUDGET_HOME and PLANNER_CANDIDATE not in p.parents
               for node in ast.walk(_tree(p))
               if isinstance(node, ast.ClassDef) and "knobs" in node.name.lower()]
    assert not defined, ("a second class of async knobs; use hpcrl.config.knobs.Knobs (RunConfig.knobs):\n"
                         + "\n".join(defined))


def test_the_config_the_knobs_and_the_admission_counter_agree():
    """RunConfig's B and lag bound are the Knobs' (one formula), for the settings the tests pin elsewhere."""
    from hpcrl.config import load_config
    from hpcrl.config.knobs import Knobs, admission_budget

    cfg = load_config("configs/simulated.yaml", ["actor.ppo_mini_batch_size=3", "actor.ppo_micro_batch_size=3",
                                                 "async_training.staleness_threshold=0.4",
                                                 "async_training.trigger_parameter_sync_step=5"])
    k = cfg.knobs
    assert isinstance(k, Knobs) and cfg.admission_budget == k.admission_budget == admission_budget(0.4, 5, 3) == 21
    assert cfg.max_lag_bound == k.max_lag_bound == (21 - 1) // 15
    assert k.describe().startswith("s=0.4, K=5, R=3, B=21 groups per version, max lag bound 1")


# ---- pid liveness: one rule (hpcrl/process/pids.py) ------------------------------------------------------

PID_HOME = REPO / "hpcrl" / "process" / "pids.py"


def _signal_zero_calls(code) -> list[int]:
    """Lines that probe a pid with signal 0 (``os.kill(pid, 0)``, ``kill(pid, 0)``)."""
    out = []
    for node in ast.walk(_tree(code)):
        if isinstance(node, ast.Call) and len(node.args) == 2 and isinstance(node.args[1], ast.Constant) \
                and node.args[1].value == 0:
            f = node.func
            if (f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")) in ("kill", "pidfd_send_signal"):
                out.append(node.lineno)
    return out


def test_only_the_pid_rule_probes_a_pid():
    assert _signal_zero_calls("try:\n    os.kill(pid, 0)\nexcept ProcessLookupError:\n    pass") == [2]
    assert not _signal_zero_calls("os.kill(pid, signal.SIGKILL)")
    assert _signal_zero_calls(PID_HOME), "the search no longer finds the rule in its home"
    found = [f"{p.relative_to(REPO)}:{line}" for p in SCANNED if p != PID_HOME
             for line in _signal_zero_calls(p)]
    assert not found, ("a second pid-alive check; call hpcrl.process.pids.pid_running (another user's process "
                       "runs, a zombie has ended):\n" + "\n".join(found))


def test_a_pid_runs_until_it_ends_a_zombie_has_ended():
    import os
    import subprocess
    import sys
    import time

    from hpcrl.process.pids import pid_running

    assert pid_running(os.getpid())
    assert not pid_running(0) and not pid_running(-1)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert pid_running(child.pid)
    finally:
        child.kill()
    deadline = time.monotonic() + 10
    while "Z" != open(f"/proc/{child.pid}/stat").read().rsplit(")", 1)[1].split()[0]:
        assert time.monotonic() < deadline, "the killed child never became a zombie"
        time.sleep(0.01)
    assert not pid_running(child.pid), "a zombie has ended (only its parent's wait is missing)"
    child.wait()
    assert not pid_running(child.pid), "a reaped pid names no process"


def _interpreter_for(uid: int):
    """An interpreter user ``uid`` may run (this one may sit under root's home), or None."""
    import subprocess
    import sys

    for exe in (sys.executable, "/usr/bin/python3"):
        try:
            if subprocess.run([exe, "-c", "pass"], user=uid, capture_output=True, timeout=30).returncode == 0:
                return exe
        except OSError:
            continue
    return None


def test_a_process_of_another_user_runs():
    """The kernel answers EPERM for another user's process: it exists (status, the rendezvous, the buffer
    sweep and the start-up sweep once disagreed on this). Run as the other user where this session is root."""
    import os
    import subprocess

    import pytest

    from hpcrl.process.pids import pid_running

    if os.geteuid() != 0:
        owner = os.stat("/proc/1").st_uid
        if owner == os.geteuid():
            pytest.skip("pid 1 is this user's: no other user's process to probe")
        assert pid_running(1)
        return
    nobody = 65534
    exe = _interpreter_for(nobody)
    if exe is None:
        pytest.skip("no Python interpreter that user 65534 may run")
    me = os.getpid()
    probe = (PID_HOME.read_text()  # the rule's own source: the other user cannot import this checkout
             + f"\ntry:\n    os.kill({me}, 0)\n    raise SystemExit('no EPERM: the probe runs as this user')\n"
             + f"except PermissionError:\n    pass\nprint(pid_running({me}), pid_running(2 ** 22 + 1))\n")
    out = subprocess.run([exe, "-c", probe], user=nobody, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "False"], out.stdout


# ---- the registries: each name once, in hpcrl/config/registries.py, read by the config and the jobs alike ----

REGISTRIES_HOME = REPO / "hpcrl" / "config" / "registries.py"


def _registries() -> dict:
    from hpcrl.config import names, registries

    return {"ENGINES": registries.ENGINES, "ADV_ESTIMATORS": registries.ADV_ESTIMATORS,
            "AGENT_LOOPS": registries.AGENT_LOOPS,
            "TOOL_PARSERS": registries.TOOL_PARSERS, "WEIGHT_TRANSPORTS": registries.WEIGHT_TRANSPORTS,
            "REWARDS": {**registries.REWARDS, names.BY_DATA_SOURCE: ""},
            "POLICY_LOSS_MODES": registries.POLICY_LOSS_MODES}


def _spelled(code) -> list[tuple[int, frozenset]]:
    """(line, the strings it spells) of every tuple, list or set literal and every dict literal's keys with two
    or more strings."""
    out = []
    for node in ast.walk(_tree(code)):
        items = node.keys if isinstance(node, ast.Dict) else node.elts if isinstance(
            node, (ast.Tuple, ast.List, ast.Set)) else []
        spelled = frozenset(x.value for x in items if isinstance(x, ast.Constant) and isinstance(x.value, str))
        if len(spelled) >= 2:
            out.append((node.lineno, spelled))
    return out


_spelled_in_file = functools.lru_cache(maxsize=None)(_spelled)


def name_lists(code, registry_names) -> list[int]:
    """Lines of a tuple, list or set literal, or a dict literal's keys, that spell more than half of a registry's
    names (two at least): a copy, also one made before the newest name was added. A few names that state a rule
    about them (``loss_mode in ("dppo_tv", "dppo_kl")`` needs ``clip_ratio_c``) are no copy."""
    wanted = set(registry_names)
    found = _spelled_in_file(code) if isinstance(code, Path) else _spelled(code)
    return [line for line, spelled in found if len(spelled & wanted) > max(1, len(wanted) // 2)]


def test_the_name_list_search_finds_the_lists_that_stood_beside_the_registries():
    regs = _registries()
    old = {  # what hpcrl/config/names.py and the jobs held before the registries
        "ENGINES": ['ENGINES = ("transformers", "vllm", SIMULATED_ENGINE)',
                    'ENGINES = {"transformers": _transformers, "vllm": _vllm, "simulated": _simulated}'],
        "AGENT_LOOPS": ['AGENT_LOOPS = ("single_turn", "tool_agent")'],
        "TOOL_PARSERS": ['PARSERS = {"hermes": HermesParser, "tiny": TinyParser}'],
        "WEIGHT_TRANSPORTS": ['BACKENDS = {"filesystem": ("m", "P", "S"), "broadcast": ("m", "P", "S")}'],
        "REWARDS": ['REWARD_NAMES = (BY_DATA_SOURCE, "toy_copy", "token_match", "exact_match", "last_number",\n'
                    '                "math_verify", "gsm8k", "toy_calc")',
                    'REWARDS = {"toy_copy": token_match, "token_match": token_match, "exact_match": exact_match,\n'
                    '           "last_number": last_number, "math_verify": math_verify_reward, "gsm8k": gsm8k}'],
        "POLICY_LOSS_MODES": ['LOSSES = {"vanilla": _vanilla, "gspo": gspo_loss, "cispo": cispo_loss,\n'
                              '          "gpg": gpg_loss, "clip_cov": clip_cov_loss, "kl_cov": kl_cov_loss,\n'
                              '          "geo_mean": geo_mean_loss, "dppo_tv": dppo_tv_loss}'],
    }
    for registry, copies in old.items():
        for code in copies:
            assert name_lists(code, regs[registry]), code
    assert not name_lists('if engine == "vllm" and device == "cuda": pass', regs["ENGINES"])
    assert not name_lists('DATA_SOURCES = {"openai/gsm8k": "gsm8k", "math": "math_verify"}', regs["REWARDS"])
    assert not name_lists('if mode in ("dppo_tv", "dppo_kl") and clip_ratio_c is None: pass', regs["POLICY_LOSS_MODES"])


def test_no_name_list_beside_a_registry():
    regs = _registries()
    assert all(name_lists(REGISTRIES_HOME, regs[r]) for r in ("ENGINES", "REWARDS", "POLICY_LOSS_MODES")), \
        "the search no longer finds the registries themselves (their keys spelled as strings)"
    found = [f"{p.relative_to(REPO)}:{line} spells {registry}'s names" for p in SCANNED if p != REGISTRIES_HOME
             for registry, names in regs.items() for line in name_lists(p, names)]
    assert not found, ("a list of names beside a registry of hpcrl/config/registries.py; read the registry "
                       "(registries.ENGINES, ...) instead:\n" + "\n".join(found))


def _defines(path: str) -> bool:
    """The registry entry ``module:attribute`` names a module of this checkout defining ``attribute`` at its top
    level (read, not imported: vLLM is optional)."""
    import importlib.util

    module, _, attribute = path.partition(":")
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        return False
    tree = ast.parse(Path(spec.origin).read_text())
    return any(isinstance(n, (ast.ClassDef, ast.FunctionDef)) and n.name == attribute for n in tree.body)


def _paths(entry) -> list[str]:
    """The ``module:attribute`` paths a registry entry names: the entry itself, each of a tuple, or each of a spec's
    fields that is one (an engine's class and its LoRA probe, ...)."""
    import dataclasses
    import re

    values = [entry] if isinstance(entry, str) else list(entry) if isinstance(entry, tuple) else \
        [getattr(entry, f.name) for f in dataclasses.fields(entry)]
    return [v for v in values if isinstance(v, str) and re.fullmatch(r"[\w.]+:\w+", v)]


def test_every_registry_entry_names_an_implementation():
    from hpcrl.config import names, registries

    entries = [(f"{registry}[{name!r}]", path) for registry, reg in _registries().items()
               for name, value in reg.items() if value for path in _paths(value)]
    assert ("ENGINES['vllm']", "hpcrl.rollout.vllm_engine:cannot_serve_lora") in entries  # a spec's every path
    missing = [f"{where} = {path!r}" for where, path in entries if not _defines(path)]
    assert not missing, "registry entries without an implementation:\n" + "\n".join(missing)
    assert not _defines("hpcrl.rollout.engines:NoSuchEngine") and not _defines("hpcrl.no_such_module:X")
    assert registries.reward_names() == (names.BY_DATA_SOURCE, *registries.REWARDS)


def test_config_validation_reads_the_registries_themselves():
    """A name added to a registry is accepted, one removed is refused: the checks hold no copy of the names. (Each
    registry is put back as it was, in its order: the allowed names are listed in it.)"""
    import pytest

    from hpcrl.config import (AgentConfig, AlgorithmConfig, ConfigError, PolicyLossConfig, RewardConfig,
                              RolloutConfig, WeightsConfig, registries)
    from hpcrl.config.evaluation import EvalRewardConfig

    checks = [(registries.ENGINES, "transformers", lambda v: RolloutConfig(engine=v).validate()),
              (registries.ADV_ESTIMATORS, "grpo", lambda v: AlgorithmConfig(adv_estimator=v).validate()),
              (registries.AGENT_LOOPS, "single_turn", lambda v: AgentConfig(default=v).validate()),
              (registries.TOOL_PARSERS, "hermes", lambda v: AgentConfig(tool_parser=v).validate()),
              (registries.WEIGHT_TRANSPORTS, "broadcast", lambda v: WeightsConfig(transport=v).validate()),
              (registries.REWARDS, "gsm8k", lambda v: RewardConfig(name=v).validate()),
              (registries.REWARDS, "gsm8k", lambda v: EvalRewardConfig(name=v).validate()),
              (registries.POLICY_LOSS_MODES, "gspo", lambda v: PolicyLossConfig(loss_mode=v).validate())]
    for registry, existing, validate in checks:
        validate(existing)
        with pytest.raises(ConfigError):
            validate("brand_new")
        was = dict(registry)
        try:
            registry["brand_new"] = registry[existing]
            validate("brand_new")
            del registry[existing]
            with pytest.raises(ConfigError, match="brand_new"):
                validate(existing)
        finally:
            registry.clear()
            registry.update(was)


def test_the_jobs_build_what_the_registries_name(monkeypatch):
    """The jobs' lookups are the same objects: one line in the registry is a new loop for the rollout job."""
    from hpcrl.config import AgentConfig, names, registries
    from hpcrl.rollout import engines, loops
    from hpcrl.rollout.single_turn import SingleTurnLoop
    from hpcrl.weights import registry

    assert engines.ENGINES is registries.ENGINES and loops.AGENT_LOOPS is registries.AGENT_LOOPS
    assert registry.WEIGHT_TRANSPORTS is registries.WEIGHT_TRANSPORTS
    monkeypatch.setitem(registries.AGENT_LOOPS, "echo", registries.AGENT_LOOPS[names.SINGLE_TURN])
    built = loops.make_loops(AgentConfig(), None, [{"agent_name": "echo"}, {}])
    assert set(built) == {"echo", names.SINGLE_TURN} and isinstance(built["echo"], SingleTurnLoop)
    assert SingleTurnLoop.name == names.SINGLE_TURN
    assert registries.resolve(registries.AGENT_LOOPS[names.TOOL_AGENT]).name == names.TOOL_AGENT
