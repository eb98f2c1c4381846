"""Tools a multi-turn agent may call, and the registry that builds them from YAML.

Built-ins (one class each, looked up by ``name`` in :data:`TOOLS`):

- ``calculator``: arithmetic on numbers (``+ - * / // % **``, parentheses, unary minus)
  evaluated by walking Python's ``ast``, never ``eval``; powers and results are capped so
  that ``9**9**9`` is an error, not a hang.
- ``python``: runs code in a fresh interpreter (``python -I``) in a scratch directory that
  is removed afterwards, with CPU-time (RLIMIT_CPU), address-space (RLIMIT_AS) and output
  (RLIMIT_FSIZE on the file stdout goes to) limits, a wall-clock deadline that kills its whole
  process group, and no network where the machine allows a new network namespace
  (``unshare --net``; :attr:`PythonTool.network_isolated` says whether it did).

Every call returns a :class:`ToolResult`; a tool never raises for bad input or a limit hit:
``ok=False`` and ``error`` say what happened (the agent loop ends the episode cleanly and
counts it).
"""
from __future__ import annotations

import ast
import math
import operator
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Optional


@dataclass
class ToolResult:
    """What one call returned."""

    text: str
    """Shown to the model (truncated to the tool's limit)."""
    ok: bool = True
    error: Optional[str] = None
    """Why the call failed (``ok=False``): bad input, a limit hit, a crash."""
    latency_s: float = 0.0


class ToolConfigError(ValueError):
    """A tool spec in the config is wrong: the key, what is allowed, the fix."""


# ---- calculator
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}


@dataclass
class Calculator:
    """Safe arithmetic: ``{"expression": "3 * (4 + 5)"}`` -> ``27``."""

    max_chars: int = 200
    """Longest expression accepted."""
    max_abs: float = 1e100
    """Largest magnitude of any intermediate result."""
    max_exponent: int = 100
    """Largest exponent of ``**``."""

    def __call__(self, expression: str = "") -> ToolResult:
        t0 = time.monotonic()
        try:
            if not isinstance(expression, str) or not expression.strip():
                raise ValueError("expected a non-empty 'expression' string")
            if len(expression) > self.max_chars:
                raise ValueError(f"expression longer than {self.max_chars} characters")
            value = self._eval(ast.parse(expression.strip(), mode="eval").body)
            text = str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)
            return ToolResult(text, latency_s=time.monotonic() - t0)
        except (ValueError, SyntaxError, ZeroDivisionError, OverflowError) as e:
            return ToolResult(f"error: {e}", ok=False, error=f"{type(e).__name__}: {e}", latency_s=time.monotonic() - t0)

    def _eval(self, node: ast.AST):
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return self._checked(node.value)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return self._checked(_UNARY[type(node.op)](self._eval(node.operand)))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = self._eval(node.left), self._eval(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > self.max_exponent:
                raise ValueError(f"exponent {right} above {self.max_exponent}")
            return self._checked(_BINARY[type(node.op)](left, right))
        raise ValueError(f"only numbers and + - * / // % ** ( ) are allowed, got {type(node).__name__}")

    def _checked(self, value):
        if isinstance(value, complex) or (isinstance(value, float) and not math.isfinite(value)) \
                or abs(value) > self.max_abs:
            raise ValueError(f"result out of range (|x| <= {self.max_abs:g})")
        return value


# ---- python
def _network_namespace_works() -> bool:
    """Whether ``unshare --net`` can start a process here (needs root or user namespaces)."""
    if shutil.which("unshare") is None:
        return False
    for cmd in (["unshare", "--net", "true"], ["unshare", "--net", "--map-root-user", "true"]):
        try:
            if subprocess.run(cmd, capture_output=True, timeout=10).returncode == 0:
                return True
        except (OSError, subprocess.TimeoutExpired):
            pass
    return False


@dataclass
class PythonTool:
    """Runs ``{"code": "..."}`` in a sandboxed interpreter; the reply is its stdout + stderr."""

    cpu_s: int = 5
    """CPU seconds (RLIMIT_CPU): the process is killed by SIGXCPU/SIGKILL beyond it."""
    memory_mb: int = 512
    """Address space (RLIMIT_AS) in MiB: allocations beyond it fail (MemoryError)."""
    wall_s: float = 10.0
    """Wall-clock seconds before its process group is killed (sleeping code uses no CPU)."""
    max_output_chars: int = 2000
    """The reply is cut to this many characters (and the file behind it to 64x that in bytes)."""
    isolate_network: bool = True
    """Run in a new, empty network namespace where the machine allows it."""

    def __post_init__(self):
        self.network_isolated = self.isolate_network and _network_namespace_works()

    def _limits(self) -> None:  # runs in the child before exec
        os.setsid()
        resource.setrlimit(resource.RLIMIT_CPU, (self.cpu_s, self.cpu_s + 1))
        mem = self.memory_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
        out = self.max_output_chars * 64
        resource.setrlimit(resource.RLIMIT_FSIZE, (out, out))

    def __call__(self, code: str = "") -> ToolResult:
        t0 = time.monotonic()
        if not isinstance(code, str) or not code.strip():
            return ToolResult("error: expected a non-empty 'code' string", ok=False, error="no code")
        scratch = Path(tempfile.mkdtemp(prefix="hpcrl-tool-"))
        try:
            (scratch / "main.py").write_text(code)
            cmd = [sys.executable, "-I", "main.py"]
            if self.network_isolated:
                cmd = ["unshare", "--net", *([] if os.geteuid() == 0 else ["--map-root-user"]), *cmd]
            with open(scratch / "out.txt", "wb") as out:
                proc = subprocess.Popen(cmd, cwd=scratch, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                        preexec_fn=self._limits, env={"PATH": os.environ.get("PATH", ""),
                                                                      "HOME": str(scratch)})
                error = self._wait(proc)
            if (scratch / "out.txt").stat().st_size >= self.max_output_chars * 64:  # Python ignores SIGXFSZ:
                error = f"output limit reached ({self.max_output_chars * 64} bytes)"  # its writes failed instead
            text = (scratch / "out.txt").read_bytes()[: self.max_output_chars * 4].decode(errors="replace")
            text = text[: self.max_output_chars]
            if error:
                text = f"{text}\nerror: {error}".strip()
            return ToolResult(text, ok=error is None, error=error, latency_s=time.monotonic() - t0)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    def _wait(self, proc: subprocess.Popen) -> Optional[str]:
        """None if the code exited 0, else why it did not."""
        try:
            rc = proc.wait(timeout=self.wall_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return f"wall-clock limit of {self.wall_s:g}s reached"
        if rc in (-signal.SIGXCPU, -signal.SIGKILL) or rc == 128 + signal.SIGXCPU:
            return f"CPU-time limit of {self.cpu_s}s reached"
        return None if rc == 0 else f"exit code {rc}"


TOOLS: dict[str, type] = {"calculator": Calculator, "python": PythonTool}
"""Tool class by the ``name`` of its spec."""


def make_tools(specs: list[dict]) -> dict[str, object]:
    """Tools from YAML specs (``[{name: calculator}, {name: python, cpu_s: 2}]``); ToolConfigError
    naming the spec, the key, what is allowed and the fix."""
    tools = {}
    for i, spec in enumerate(specs):
        if not isinstance(spec, dict) or spec.get("name") not in TOOLS:
            raise ToolConfigError(f"tools[{i}]: got {spec!r}; allowed: a mapping with name one of "
                                  f"{', '.join(TOOLS)}; fix: e.g. {{name: calculator}}")
        cls = TOOLS[spec["name"]]
        defaults = {f.name: f.default for f in fields(cls)}
        args = {k: v for k, v in spec.items() if k != "name"}
        for key, value in args.items():
            if key not in defaults:
                raise ToolConfigError(f"tools[{i}] ({spec['name']}): unknown key {key!r}; allowed: "
                                      f"{', '.join(defaults)}; fix: remove it")
            default = defaults[key]
            if isinstance(default, bool):
                ok, kind = isinstance(value, bool), "true or false"
            else:
                number = int if isinstance(default, int) else (int, float)
                ok = isinstance(value, number) and not isinstance(value, bool) and value > 0
                kind = f"a positive {'integer' if number is int else 'number'}"
            if not ok:
                raise ToolConfigError(f"tools[{i}] ({spec['name']}).{key}: got {value!r}; allowed: {kind}; "
                                      f"fix: e.g. {key}: {default}")
        if spec["name"] in tools:
            raise ToolConfigError(f"tools[{i}]: {spec['name']} is configured twice; fix: keep one")
        tools[spec["name"]] = cls(**args)
    return tools
