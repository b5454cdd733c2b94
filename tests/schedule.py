"""The order in which `make test`'s two workers take the test files: the longest first.

pytest-xdist (`--dist loadfile`) hands out whole files in collection order, and by default reorders
them by their number of tests, which put a file of one long test (a learning run) last, alone on
one worker while the other idled. `make test` turns that off (`--no-loadscope-reorder`) and
tests/conftest.py sorts the collection by each file's seconds in `file_seconds.json` (longest first;
files not listed keep their place after them): the longest-processing-time-first schedule.

Refresh the table after a suite run that wrote a JUnit report:

    .venv/bin/python -m pytest -q -n 2 --dist loadfile --junitxml=/tmp/suite.xml tests
    .venv/bin/python tests/schedule.py /tmp/suite.xml
"""

import json
import os
import sys
import xml.etree.ElementTree as ET

TABLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "file_seconds.json")


def load_table():
    if not os.path.exists(TABLE):
        return {}
    with open(TABLE) as f:
        return json.load(f)


def longest_first(items, table):
    """items stably sorted by their file's seconds, descending (a file's tests stay together, in order)."""
    return sorted(items, key=lambda item: -table.get(item.nodeid.split("::")[0], 0.0))


def seconds_per_file(junit_xml):
    """{"tests/test_x.py": seconds} from a JUnit report (xunit1 or xunit2): each test case's time, summed per
    file (fixtures' set-up included)."""
    seconds = {}
    for case in ET.parse(junit_xml).getroot().iter("testcase"):
        path = case.get("file") or _module_path(case.get("classname", ""))
        seconds[path] = seconds.get(path, 0.0) + float(case.get("time", 0))
    return dict(sorted(((k, round(v, 1)) for k, v in seconds.items()), key=lambda kv: -kv[1]))


def _module_path(classname):
    """xunit2's classname ("tests.gpu.test_x" or "tests.test_x.TestCase") -> "tests/gpu/test_x.py"."""
    parts = classname.split(".")
    module = next(i for i, part in enumerate(parts) if part.startswith("test_"))
    return "/".join(parts[: module + 1]) + ".py"


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python tests/schedule.py JUNIT_XML   (writes tests/file_seconds.json)")
    table = seconds_per_file(sys.argv[1])
    with open(TABLE, "w") as f:
        json.dump(table, f, indent=1)
        f.write("\n")
    print(f"{len(table)} files, {sum(table.values()) / 60:.1f} minutes of tests: wrote {TABLE}")
