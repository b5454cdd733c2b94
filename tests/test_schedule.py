"""tests/schedule.py: the order of the suite's files (longest first, a file's tests together and in order)."""

from types import SimpleNamespace

from tests.schedule import longest_first, seconds_per_file


def test_longest_files_first_and_each_files_tests_in_order():
    ids = ["tests/test_a.py::x", "tests/test_b.py::y", "tests/test_a.py::z", "tests/test_c.py::w", "tests/test_d.py::v"]
    items = [SimpleNamespace(nodeid=i) for i in ids]
    table = {"tests/test_b.py": 90.0, "tests/test_a.py": 20.0}  # c and d not listed: after them, in their order
    order = [item.nodeid for item in longest_first(items, table)]
    assert order == ["tests/test_b.py::y", "tests/test_a.py::x", "tests/test_a.py::z", "tests/test_c.py::w",
                     "tests/test_d.py::v"]  # fmt: skip


def test_seconds_per_file_from_a_junit_report(tmp_path):
    report = tmp_path / "suite.xml"
    report.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.test_a" name="x" file="tests/test_a.py" time="1.25"/>'
        '<testcase classname="tests.test_b" name="y" file="tests/test_b.py" time="7.5"/>'
        '<testcase classname="tests.test_a" name="z" time="2.5"/>'  # xunit2 writes no file
        '<testcase classname="tests.gpu.test_c.TestCase" name="v" time="0.5"/>'
        "</testsuite></testsuites>"
    )
    table = seconds_per_file(report)
    assert table == {"tests/test_b.py": 7.5, "tests/test_a.py": 3.8, "tests/gpu/test_c.py": 0.5}
    assert list(table) == ["tests/test_b.py", "tests/test_a.py", "tests/gpu/test_c.py"]
