"""The agent's built-in tools: a calculator that never evaluates code, and a Python tool that
cannot exceed its CPU, memory, wall-clock and output limits, reach the network (where the
machine allows a network namespace) or leave files behind."""
import socket
import tempfile
from pathlib import Path

import pytest

from hpcrl.rollout.tools import Calculator, PythonTool, ToolConfigError, make_tools


@pytest.mark.parametrize("expression, value", [("3 * (4 + 5)", "27"), ("-2 ** 3", "-8"), ("7 / 2", "3.5"),
                                               ("17 // 5 + 17 % 5", "5"), ("2 ** 0.5 * 2 ** 0.5", "2.0000000000000004")])
def test_calculator_evaluates_arithmetic(expression, value):
    r = Calculator()(expression)
    assert r.ok and r.text == value


@pytest.mark.parametrize("expression, fragment", [
    ("__import__('os').system('true')", "only numbers"), ("x + 1", "only numbers"), ("9 ** 9 ** 9", "exponent"),
    ("1 / 0", "ZeroDivisionError"), ("10.0 ** 99 * 10.0 ** 99", "out of range"), ("", "non-empty"),
    ("1 +", "SyntaxError"), ("1" * 300, "longer than")])
def test_calculator_refuses_what_is_not_plain_arithmetic(expression, fragment):
    r = Calculator()(expression)
    assert not r.ok and fragment in (r.error or "") + r.text


def test_python_tool_returns_output_and_leaves_no_files():
    before = set(Path(tempfile.gettempdir()).glob("hpcrl-tool-*"))
    r = PythonTool()("import os\nopen('f.txt', 'w').write('x')\nprint(sum(range(10)), os.listdir('.'))")
    assert r.ok and r.text.startswith("45") and "f.txt" in r.text
    assert set(Path(tempfile.gettempdir()).glob("hpcrl-tool-*")) == before, "the scratch dir is removed"
    bad = PythonTool()("raise SystemExit(3)")
    assert not bad.ok and "exit code 3" in bad.error


def test_python_tool_cpu_limit():
    r = PythonTool(cpu_s=1, wall_s=30)("while True:\n    pass")
    assert not r.ok and "CPU-time limit" in r.error and r.latency_s < 10


def test_python_tool_memory_limit():
    r = PythonTool(memory_mb=200)("x = bytearray(1024 ** 3)\nprint('allocated')")
    assert not r.ok and "MemoryError" in r.text and "allocated" not in r.text


def test_python_tool_wall_clock_limit_kills_the_process_group():
    r = PythonTool(wall_s=1.0)("import subprocess, time\nsubprocess.Popen(['sleep', '60'])\ntime.sleep(60)")
    assert not r.ok and "wall-clock limit" in r.error and r.latency_s < 10


def test_python_tool_output_is_truncated():
    r = PythonTool(max_output_chars=100)("print('y' * 10 ** 6)")
    assert len(r.text) <= 100 + len("\nerror: output limit reached (6400 bytes)")
    assert r.text.startswith("y" * 50) and "output limit" in (r.error or ""), "RLIMIT_FSIZE stopped the writer"


def test_python_tool_has_no_network_where_a_namespace_is_allowed():
    tool = PythonTool(wall_s=10)
    if not tool.network_isolated:
        pytest.skip("this machine allows no new network namespace (unshare --net); the tool says so")
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    code = f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {port}), timeout=2)\n    print('connected')\n" \
           f"except OSError as e:\n    print('refused', e)"
    r = tool(code)
    plain = PythonTool(isolate_network=False)(code)
    server.close()
    assert r.ok and "refused" in r.text, r.text
    assert plain.text.startswith("connected"), f"the same code connects without the namespace: {plain.text}"


def test_tools_come_from_yaml_specs_with_clear_errors():
    tools = make_tools([{"name": "calculator"}, {"name": "python", "cpu_s": 2, "isolate_network": False}])
    assert set(tools) == {"calculator", "python"} and tools["python"].cpu_s == 2
    for specs, fragment in [([{"name": "shell"}], "name one of calculator, python"),
                            ([{"name": "python", "cpu": 2}], "unknown key 'cpu'"),
                            ([{"name": "python", "cpu_s": -1}], "a positive integer"),
                            ([{"name": "python", "wall_s": "5"}], "a positive number"),
                            ([{"name": "calculator"}, {"name": "calculator"}], "configured twice")]:
        with pytest.raises(ToolConfigError, match=fragment):
            make_tools(specs)
