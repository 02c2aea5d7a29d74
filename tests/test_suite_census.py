"""bench/suite_census.py (issue 72): the checks of each test function counted from its source, and every test id
gone or test with fewer checks between two commits reported, with its reason or as a failure."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT


@pytest.fixture
def census(monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import suite_census

    yield suite_census
    sys.modules.pop("suite_census", None)


def test_asserts_raises_and_warns_are_counted_per_function_and_method(census, tmp_path: Path) -> None:  # noqa: ANN001
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_a.py").write_text(
        "import pytest\n\ndef helper(x):\n    assert x\n\ndef test_one():\n    assert 1\n    assert 2\n"
        "    with pytest.raises(ValueError):\n        int('x')\n    with pytest.warns(UserWarning):\n        pass\n\n"
        "class TestGroup:\n    def test_two(self):\n        assert [x for x in (1,) if x]\n")
    assert census.checks_of(tmp_path) == {"tests/test_a.py::helper": 1, "tests/test_a.py::test_one": 4,
                                          "tests/test_a.py::TestGroup::test_two": 1}


def test_a_test_gone_or_with_fewer_checks_fails_the_census_unless_a_reason_is_given(census, capsys) -> None:  # noqa: ANN001
    old = census.Suite("old", ["tests/t.py::test_a", "tests/t.py::test_b[1]", "tests/t.py::test_b[2]"],
                       {"tests/t.py::test_a": 3, "tests/t.py::test_b": 1, "tests/t.py::helper": 2})
    new = census.Suite("new", ["tests/t.py::test_a", "tests/t.py::test_c"],
                       {"tests/t.py::test_a": 2, "tests/t.py::test_c": 5})
    assert census.compare(old, new, {}, list_added=False) == 4  # test_b's two ids, test_a's check, the helper
    out = capsys.readouterr().out
    assert "removed: tests/t.py::test_b[1]" in out and "fewer checks in a test: tests/t.py::test_a (3 -> 2)" in out
    assert "helper gone: tests/t.py::helper (2 checks)" in out and "1 only in new" in out
    why = {"tests/t.py::test_b": "merged into test_c", "tests/t.py::test_a": "one moved to test_c",
           "tests/t.py::helper": "inlined into test_c"}
    assert census.compare(old, new, why, list_added=False) == 0
