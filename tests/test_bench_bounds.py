"""The benchmarks' shared ending (bench/bounds.py): every figure printed beside its baseline and its bound, and
exit 1 when one is past its bound, so that a figure quoted in the docs cannot regress silently. Every bench/*.py
ends through it (read from its source, not run: most need hosts, a GPU or minutes). And each figure
bench/recovery.py reads is found in the very line its cluster test prints (the f-string, read from the test)."""

from __future__ import annotations

import ast
import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[1]


def load(name: str) -> ModuleType:
    sys.path.insert(0, str(REPO / "bench"))  # the scripts import bounds as their neighbour
    try:
        spec = importlib.util.spec_from_file_location(name, REPO / "bench" / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # its dataclasses look themselves up there
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(REPO / "bench"))


def test_a_figure_past_its_bound_exits_1_and_says_which(capsys: pytest.CaptureFixture[str]) -> None:
    bounds = load("bounds")
    faster = bounds.Figure("speed-up", 26.5, "x", "classic 3763 images/s", 10.0, True)
    slow = bounds.Figure("training again", 130.0, "s", "109-144 s before", 109.0, False)
    assert bounds.finish([faster]) == 0
    assert bounds.finish([faster, slow]) == 1
    out = capsys.readouterr().out
    assert "speed-up: 26.5 x | baseline: classic 3763 images/s | bound: >= 10 x | ok" in out
    assert "training again: 130 s | baseline: 109-144 s before | bound: <= 109 s | PAST THE BOUND" in out
    assert out.rstrip().endswith("past the bound: training again")


BENCHES = sorted(p.stem for p in (REPO / "bench").glob("*.py") if p.stem != "bounds")


def _is_call_of(node: ast.AST | None, name: str) -> bool:
    """`name(...)` or `<module>.name(...)`."""
    return isinstance(node, ast.Call) and (getattr(node.func, "id", None) == name or
                                           getattr(node.func, "attr", None) == name)


def ends_through_bounds(source: str) -> list[str]:
    """PURE: what keeps a bench script from ending through bench/bounds.py (empty: nothing): it imports `finish`
    from `bounds`; its main() ends with `return finish(...)`; the script exits with main()'s value
    (`sys.exit(main())` or `raise SystemExit(main())` under `if __name__ == "__main__":`). `import bounds` and
    `bounds.finish(...)` count alike."""
    tree = ast.parse(source)
    wrong = []
    if not any((isinstance(n, ast.ImportFrom) and n.module == "bounds" and "finish" in [a.name for a in n.names]) or
               (isinstance(n, ast.Import) and "bounds" in [a.name for a in n.names]) for n in tree.body):
        wrong.append("no `from bounds import ... finish` (or `import bounds`)")
    main = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main"), None)
    last = main.body[-1] if main else None
    if not (isinstance(last, ast.Return) and last.value is not None and  # `finish(...) or 1` (another failure) too
            any(_is_call_of(n, "finish") for n in ast.walk(last.value))):
        wrong.append("main() does not end with `return finish(...)`")
    guard = tree.body[-1] if tree.body else None
    exits = [s for s in getattr(guard, "body", []) if
             (isinstance(s, ast.Expr) and _is_call_of(s.value, "exit") and _is_call_of(s.value.args[0], "main")) or
             (isinstance(s, ast.Raise) and _is_call_of(s.exc, "SystemExit") and
              _is_call_of(s.exc.args[0], "main"))]  # type: ignore[union-attr]
    if not (isinstance(guard, ast.If) and "__main__" in ast.unparse(guard.test) and exits):
        wrong.append("the script does not end with `sys.exit(main())` under `if __name__ == \"__main__\":`")
    return wrong


@pytest.mark.parametrize("name", BENCHES)
def test_every_bench_ends_through_the_bounds(name: str) -> None:
    assert ends_through_bounds((REPO / "bench" / f"{name}.py").read_text()) == []


def test_a_bench_that_returns_0_or_ignores_main_is_refused() -> None:
    good = "from bounds import Figure, finish\ndef main():\n    return finish([])\n" \
           "if __name__ == '__main__':\n    sys.exit(main())\n"
    assert ends_through_bounds(good) == []
    assert ends_through_bounds(good.replace("return finish([])", "finish([])\n    return 0")) == \
        ["main() does not end with `return finish(...)`"]
    assert len(ends_through_bounds(good.replace("sys.exit(main())", "main()"))) == 1
    assert len(ends_through_bounds(good.replace("from bounds import Figure, finish", "import json"))) == 1
    assert ends_through_bounds(good.replace("from bounds import Figure, finish", "import bounds")
                               .replace("return finish", "return bounds.finish")) == []


def printed_lines(test: str) -> list[str]:
    """The f-strings a test's function prints, with each {expression} as 1.5 (a figure)."""
    path, name = test.split("::")
    tree = ast.parse((REPO / path).read_text())
    func = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name)
    lines = []
    for call in ast.walk(func):
        if isinstance(call, ast.Call) and getattr(call.func, "id", "") == "print" and call.args:
            parts = call.args[0].values if isinstance(call.args[0], ast.JoinedStr) else []
            lines.append("".join(p.value if isinstance(p, ast.Constant) else "1.5" for p in parts))
    return lines


def test_each_figure_of_the_recovery_bench_is_in_a_line_its_test_prints() -> None:
    recovery = load("recovery")
    for test, measures in recovery.SCENARIOS.values():
        lines = printed_lines(test)
        for m in measures:
            assert any(re.search(m.pattern, line) for line in lines), (m.name, test, lines)
