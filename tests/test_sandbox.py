"""Tests of common/env/sandbox.py: model-written code tries each escape (read the user's files, write outside its
directory, open a socket, loop forever, fork-bomb, print 100 MB, allocate 64 GB) and the sandbox contains it and
answers promptly with a one-line error. Both levels run where they apply: "namespaces" (skipped, with the
reason, where this machine refuses `unshare -Ur`) and "rlimits" (namespaces=False). The threat model:
docs/sandbox.md.

    .venv/bin/python -m pytest -q tests/test_sandbox.py
"""

import concurrent.futures
import ctypes
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest

from common.env import sandbox
from common.env.sandbox import RunResult, SandboxUnavailable, run_python, sandbox_kind

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
USERNS = shutil.which("unshare") is not None and subprocess.run(["unshare", "-Ur", "true"]).returncode == 0
needs_userns = pytest.mark.skipif(not USERNS, reason="`unshare -Ur true` fails here: no user namespaces")
LEVELS = [pytest.param(True, id="namespaces", marks=needs_userns), pytest.param(False, id="rlimits")]
# Landlock's ABI version asked of the kernel here (landlock_create_ruleset(NULL, 0, VERSION)); < 1: none
LANDLOCK = (
    ctypes.CDLL(None, use_errno=True).syscall(444, None, 0, 1) if os.uname().machine in ("x86_64", "aarch64") else -1
)
needs_landlock = pytest.mark.skipif(LANDLOCK < 1, reason="no Landlock in this kernel")
ISOLATED = [
    pytest.param(True, id="namespaces", marks=needs_userns),
    pytest.param(False, id="landlock", marks=needs_landlock),
]


def test_kind_names_the_strongest_level():
    fs = f"filesystem by Landlock ABI {LANDLOCK} (" if LANDLOCK >= 1 else "NO filesystem isolation (Landlock: "
    kind = sandbox_kind()
    assert kind.startswith("namespaces: " if USERNS else f"rlimits only: {fs}"), kind
    assert not USERNS or ", seccomp (no io_uring, ptrace) (" in kind, kind
    kind = sandbox_kind(namespaces=False)
    assert kind.startswith(f"rlimits only: {fs}") and "no network (seccomp), as " in kind, kind


@pytest.mark.parametrize("namespaces", LEVELS)
def test_output_exit_codes_and_errors(namespaces):
    # stdout and stderr interleaved in the order written; a clean exit has no error
    code = "import sys\nprint('a')\nprint('b', file=sys.stderr)\nprint('c')"
    assert run_python(code, namespaces=namespaces).output == "a\nb\nc\n"
    r = run_python("print(6 * 7)", namespaces=namespaces)
    assert (r.output, r.exit_code, r.timed_out, r.error) == ("42\n", 0, False, None)
    r = run_python("raise ValueError('boom')", namespaces=namespaces)
    assert (r.exit_code, r.error) == (1, "exit code 1") and r.output.endswith("ValueError: boom\n")
    r = run_python("import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)", namespaces=namespaces)
    assert (r.exit_code, r.error) == (None, "killed by signal 11 (SIGSEGV)")
    # the code runs as nobody without a single capability, in its own fresh directory
    code = "import os\nprint(os.getuid(), os.getgid(), os.listdir('.'))\nopen('left.txt', 'w').write('x')"
    code += "\nprint([l for l in open('/proc/self/status') if l.startswith('CapEff')][0].split()[1])"
    # everyday things still work: /dev/null, a subprocess, randomness, files and directories in the work dir
    code2 = textwrap.dedent("""
        import os, subprocess
        open('/dev/null', 'w').write('x')
        print(subprocess.run(['ls', '/usr']).returncode)
        open('a', 'w').write('y')
        os.rename('a', 'b')
        os.mkdir('d')
        print(len(os.urandom(4)), sorted(os.listdir()))
        print(open('b').read())
    """)
    r = run_python(code2, namespaces=namespaces, max_output_chars=100_000)
    assert r.output.endswith("\n0\n4 ['b', 'd', 'main.py']\ny\n") and r.error is None, r
    for _ in range(2):  # the second run does not see the first one's file
        r = run_python(code, namespaces=namespaces)
        assert r.output == "65534 65534 ['main.py']\n0000000000000000\n", r


@pytest.mark.parametrize("namespaces", LEVELS)
def test_wall_clock_and_memory_limits(namespaces):
    # the timings leave room for a loaded machine: the point is that a run ends near its limit, not at 10 s
    r = run_python("while True: pass", timeout_s=1, namespaces=namespaces)
    assert (r.exit_code, r.timed_out, r.error) == (None, True, "timed out after 1 s")
    assert 1 <= r.seconds < 4, r.seconds
    r = run_python("import time\ntime.sleep(60)", timeout_s=0.5, namespaces=namespaces)  # sleeping uses no CPU
    assert r.timed_out and r.seconds < 4
    r = run_python("x = bytearray(64 << 30)", namespaces=namespaces)  # 64 GB
    assert (r.exit_code, r.error) == (1, "memory limit (1024 MB) exceeded") and r.seconds < 4
    # 200 MB to a file: /tmp (a tmpfs of memory_mb) fills up, or RLIMIT_FSIZE stops the file (Python ignores
    # SIGXFSZ, so the write fails instead of the process dying)
    code = "f = open('big', 'wb')\nfor i in range(200):\n    f.write(bytes(1 << 20))"
    r = run_python(code, memory_mb=64, namespaces=namespaces)
    assert r.output.endswith("OSError: [Errno 28] No space left on device\n" if namespaces else "File too large\n")


def test_cpu_limit_and_memory_growth():
    # the same rlimits in both levels (one code path): run once, at the strongest level
    r = run_python("while True: pass", timeout_s=30, cpu_s=1)
    assert (r.timed_out, r.error) == (False, "CPU time limit (1 s) exceeded") and r.seconds < 15
    r = run_python("l = []\nwhile True: l.append(bytearray(1 << 20))", memory_mb=96)
    assert r.error == "memory limit (96 MB) exceeded" and r.output.endswith("MemoryError\n")


@pytest.mark.parametrize("namespaces", LEVELS)
def test_100_mb_of_output_is_truncated(namespaces):
    r = run_python("import sys\nsys.stdout.write('x' * 100_000_000)", namespaces=namespaces, max_output_chars=1000)
    assert r.output == "x" * 1000 + "\n... [output truncated: 100000000 bytes in all]"
    assert r.error is None and r.seconds < 10
    r = run_python("print('é' * 10)", max_output_chars=4, namespaces=namespaces)  # characters, not bytes
    assert r.output == "éééé\n... [output truncated: 21 bytes in all]"


def _processes_with(marker):
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    found.append(pid)
        except OSError:
            pass
    return found


@pytest.mark.parametrize("namespaces", LEVELS)
def test_fork_bomb_and_escaped_children_leave_nothing_behind(namespaces):
    marker = f"{time.time_ns() % 10**6 + 10**6}"  # sleep's argument: a number no other process uses
    code = textwrap.dedent(f"""
        import os, subprocess
        subprocess.Popen(["/bin/sleep", "{marker}"], start_new_session=True)  # leaves the process group
        if os.fork() == 0:  # double fork: the orphan is reparented, its session is its own
            os.setsid()
            if os.fork() == 0:
                os.execv("/bin/sleep", ["sleep", "{marker}"])
            os._exit(0)
        while True:
            try:
                os.fork()
            except OSError:
                pass
    """)
    r = run_python(code, timeout_s=2, max_processes=32, namespaces=namespaces)
    assert (r.timed_out, r.error) == (True, "timed out after 2 s") and r.seconds < 4, r
    assert _processes_with(marker) == []
    # a daemon left by a program that exits cleanly is killed too
    code = f"import subprocess\nsubprocess.Popen(['/bin/sleep', '{marker}'], start_new_session=True)\nprint('ok')"
    r = run_python(code, namespaces=namespaces)
    assert (r.output, r.error) == ("ok\n", None) and _processes_with(marker) == []
    # max_processes counts the program itself: 1 + 7 children
    code = "import os, time\nn = 0\ntry:\n    while True:\n        if os.fork() == 0:\n            time.sleep(30)"
    code += "\n        n += 1\nexcept OSError:\n    print(n)"
    if namespaces:  # in its own user namespace the count starts from zero (as nobody on the host it is shared)
        assert run_python(code, max_processes=8, namespaces=namespaces).output == "7\n"


@pytest.mark.parametrize("namespaces", ISOLATED)
def test_no_access_to_the_users_files(tmp_path, namespaces):
    secret = tmp_path / "secret.txt"
    secret.write_text("TOPSECRET")
    os.chmod(tmp_path, 0o755)
    paths = [os.path.expanduser("~/.ssh"), os.path.expanduser("~"), ROOT, os.path.join(ROOT, "README.md"), str(secret)]
    read = textwrap.dedent(f"""
        import os
        for path in {paths!r}:
            try:
                print(os.listdir(path) if os.path.isdir(path) else open(path).read())
            except OSError as e:
                print(type(e).__name__)
    """)
    write = textwrap.dedent(f"""
        for path in ["{tmp_path}/escaped.txt", "/usr/escaped.txt", "/etc/escaped.txt", "/escaped.txt"]:
            try:
                open(path, "w").write("x")
            except OSError as e:
                print(e.strerror)
    """)
    ground_truth = subprocess.run([sys.executable, "-c", read], capture_output=True, text=True).stdout
    assert ground_truth.count("TOPSECRET") == 1  # outside the sandbox the secret is readable
    lines = run_python(read + write, namespaces=namespaces).output.splitlines()
    if namespaces:  # ~/.ssh and the repository are not there at all; HOME only if the Python install is in it
        assert lines[0] == lines[2] == lines[3] == lines[4] == "FileNotFoundError", lines
        assert lines[1] == "FileNotFoundError" or sandbox._python_paths()[0].startswith(paths[1]), lines
        assert lines[5:] == ["No such file or directory"] + ["Read-only file system"] * 3, lines
    else:  # Landlock: there, and refused (HOME may not exist: nobody's is /nonexistent)
        assert set(lines[:2]) <= {"PermissionError", "FileNotFoundError"}, lines
        assert lines[2:] == ["PermissionError"] * 3 + ["Permission denied"] * 4, lines
    assert not os.path.exists(tmp_path / "escaped.txt")


@pytest.mark.parametrize("namespaces", LEVELS)
def test_network(namespaces):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    port = server.getsockname()[1]
    code = (
        f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {port}), timeout=2)\n    print('connected')"
    )
    code += "\nexcept OSError as e:\n    print(e.strerror)"
    try:
        ground_truth = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout
        r = run_python(code, namespaces=namespaces)
    finally:
        server.close()
    assert ground_truth == "connected\n"  # the server is there to reach from outside
    # its own network namespace has only a loopback device, down; without it seccomp refuses the socket
    assert r.output == ("Network is unreachable\n" if namespaces else "Permission denied\n")


@pytest.mark.parametrize("namespaces", LEVELS)
def test_seccomp(namespaces):
    # io_uring (kernel surface, and it can open sockets itself) and ptrace in both levels; without a network
    # namespace every socket family but AF_UNIX too
    code = textwrap.dedent("""
        import ctypes, os, socket
        for family in (socket.AF_INET, socket.AF_INET6, socket.AF_NETLINK, socket.AF_PACKET, socket.AF_UNIX):
            try:
                socket.socket(family, socket.SOCK_RAW if family == socket.AF_PACKET else socket.SOCK_DGRAM).close()
                print("opened")
            except OSError as e:
                print(e.strerror)
        print(len(socket.socketpair()))
        libc = ctypes.CDLL(None, use_errno=True)
        number = {"x86_64": (425, 101), "aarch64": (425, 117)}[os.uname().machine]
        for nr in number:  # io_uring_setup(8, NULL), ptrace(PTRACE_TRACEME)
            print(libc.syscall(nr, 0, 0, 0, 0), os.strerror(ctypes.get_errno()))
    """)
    ground_truth = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout
    io_uring, ptrace = ground_truth.splitlines()[-2:]  # outside: a bad argument, and a success
    assert io_uring.startswith("-1 ") and io_uring != "-1 Operation not permitted" and ptrace.startswith("0 ")
    lines = run_python(code, namespaces=namespaces).output.splitlines()
    assert lines[4:] == ["opened", "2"] + ["-1 Operation not permitted"] * 2, lines
    if namespaces:  # in its own network namespace a socket opens, and leads nowhere (test_network)
        assert lines[:3] == ["opened"] * 3, lines
    else:
        assert lines[:4] == ["Permission denied"] * 4, lines


@needs_userns
def test_cannot_remount_or_regain_privileges():
    # No capability, so no remounting /usr read-write; a nested user namespace gets capabilities there, but
    # the mounts it inherits are locked read-only by the kernel.
    code = textwrap.dedent("""
        import ctypes, os, subprocess
        libc = ctypes.CDLL(None, use_errno=True)
        print(libc.mount(None, b"/usr", None, 4096 | 32, None), os.strerror(ctypes.get_errno()))
        cmd = "mount -o remount,bind,rw /usr && echo REMOUNTED"
        out = subprocess.run(["unshare", "-Urm", "sh", "-c", cmd], capture_output=True, text=True)
        print("REMOUNTED" in out.stdout, out.returncode != 0)
    """)
    r = run_python(code)
    assert r.output == "-1 Operation not permitted\nFalse True\n", r.output


def test_many_threads_at_once():
    codes = [f"import time\ntime.sleep(0.2)\nprint({i} * {i})" for i in range(12)]
    start = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        results = list(pool.map(lambda code: run_python(code, timeout_s=30), codes))
    assert [r.output for r in results] == [f"{i * i}\n" for i in range(12)]
    assert all(isinstance(r, RunResult) and r.error is None for r in results)
    assert time.monotonic() - start < 12 * 0.2 + 10  # they ran side by side, not one after another


def test_bad_arguments_raise_one_line():
    for kwargs, match in [
        (dict(timeout_s=0), "timeout_s=0 must be"),
        (dict(cpu_s=-1), "cpu_s=-1 must be"),
        (dict(memory_mb=10), "memory_mb=10 must be an int >= 64"),
        (dict(max_output_chars=0), "max_output_chars=0"),
        (dict(max_processes=0), "max_processes=0"),
    ]:
        with pytest.raises(ValueError, match=match):
            run_python("print(1)", **kwargs)
    with pytest.raises(TypeError, match="code must be a str"):
        run_python(b"print(1)")


def test_without_namespaces_warns_once_or_refuses(monkeypatch, capsys):
    # as on a node whose kernel refuses user namespaces and has no Landlock (what the probes would find)
    missing = (False, [], "sandbox failed: unshare(...): Operation not permitted")
    no_landlock = (True, [{"seccomp": True}, {"landlock": "Landlock unavailable: Function not implemented"}], "")
    monkeypatch.setattr(sandbox, "_probes", {"namespaces": missing, "rlimits": no_landlock})
    monkeypatch.setattr(sandbox, "_warned", False)
    with pytest.raises(SandboxUnavailable, match=r"rlimits only: NO filesystem isolation \(Landlock: Landlock unavail"):
        run_python("print(1)", require_isolation=True)
    for _ in range(2):
        r = run_python("import os\nprint(os.getcwd())")
        assert r.output.startswith(os.path.join(os.path.realpath(sandbox.tempfile.gettempdir()), "sandbox-"))
    assert capsys.readouterr().err.count("WARNING: sandbox for model-written code: rlimits only") == 1


CHECKS_AS_NOBODY = """
import os, sys
sys.path.insert(0, sys.argv[1])
from common.env.sandbox import run_python, sandbox_kind
assert os.geteuid() != 0
print(sandbox_kind().split(":")[0])
print(run_python("import os; print(os.getuid(), sorted(os.listdir('/')))", require_isolation=True).output, end="")
print(run_python("while True: pass", timeout_s=0.5).error)
"""


def _nobody_can_read(path):
    if not os.stat(path).st_mode & stat.S_IROTH:
        return False
    while path != "/":
        path = os.path.dirname(path)
        if not os.stat(path).st_mode & stat.S_IXOTH:
            return False
    return True


@pytest.mark.skipif(
    os.geteuid() != 0 or not os.path.exists("/usr/bin/python3") or not _nobody_can_read(sandbox.__file__),
    reason="needs root, /usr/bin/python3 and a checkout that nobody can read",
)
def test_as_an_unprivileged_user():
    # Outside root the namespace maps the user's own uid to nobody; `su nobody` with the system's Python
    with tempfile.NamedTemporaryFile("w", suffix=".py", dir="/tmp") as script:
        script.write(CHECKS_AS_NOBODY)
        script.flush()
        os.chmod(script.name, 0o644)
        cmd = f"/usr/bin/python3 {script.name} {ROOT}"
        proc = subprocess.run(["su", "nobody", "-s", "/bin/sh", "-c", cmd], capture_output=True, text=True, cwd="/")
    if proc.returncode != 0 and ("Permission denied" in proc.stderr or "su:" in proc.stderr):
        pytest.skip(f"cannot run as nobody here: {proc.stderr.strip()[-200:]}")
    assert proc.returncode == 0, proc.stderr
    if not USERNS:
        return
    root_entries = "['bin', 'dev', 'etc', 'lib', 'lib64', 'proc', 'sbin', 'tmp', 'usr']"
    assert proc.stdout == f"namespaces\n65534 {root_entries}\ntimed out after 0.5 s\n", proc.stdout


@needs_landlock
def test_landlock_without_namespaces(monkeypatch):
    # With Landlock (and seccomp) the weaker level isolates files and network: require_isolation accepts it
    monkeypatch.setattr(sandbox, "_probes", {"namespaces": (False, [], "no user namespaces")})
    monkeypatch.setattr(sandbox, "_warned", True)
    assert run_python("print(open('/proc/self/status').read().count('CapEff'))", require_isolation=True).output == "1\n"
    if LANDLOCK < 6:
        return
    # Landlock ABI 6 scopes abstract unix sockets: one the host listens on is out of reach
    server = socket.socket(socket.AF_UNIX)
    server.bind(f"\0sandbox-test-{os.getpid()}")
    server.listen(1)
    code = f"import socket\ntry:\n    socket.socket(socket.AF_UNIX).connect('\\0sandbox-test-{os.getpid()}')"
    code += "\n    print('connected')\nexcept OSError as e:\n    print(e.strerror)"
    try:
        ground_truth = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout
        r = run_python(code, require_isolation=True)
    finally:
        server.close()
    assert (ground_truth, r.output) == ("connected\n", "Operation not permitted\n")
    if os.geteuid() != 0:
        return
    # and signals: the code (nobody) cannot kill a process of nobody outside its domain
    victim = subprocess.Popen(["sleep", "30"], user=65534)
    try:
        r = run_python(f"import os\nos.kill({victim.pid}, 9)", require_isolation=True)
        assert r.output.endswith("PermissionError: [Errno 1] Operation not permitted\n"), r.output
        assert victim.poll() is None
    finally:
        victim.kill()
        victim.wait()


def test_caller_cleans_up_when_the_supervisor_stops(monkeypatch):
    # Where nothing stops the code from signalling its supervisor (a user's own uid, no Landlock scoping), it
    # could SIGSTOP it: the caller then kills the supervisor and the code's process group after the grace.
    monkeypatch.setattr(sandbox, "_GRACE_S", 0.5)
    marker = f"{time.time_ns() % 10**6 + 2 * 10**6}"
    pool = concurrent.futures.ThreadPoolExecutor(1)
    code = f"import os\nprint('started', flush=True)\nos.execv('/bin/sleep', ['sleep', '{marker}'])"
    future = pool.submit(run_python, code, timeout_s=1, namespaces=False)
    while not _processes_with(marker):
        time.sleep(0.01)
    boot = [
        p for p in _processes_with("sandbox_child.py") if open(f"/proc/{p}/stat").read().split()[3] == str(os.getpid())
    ]
    os.kill(int(boot[0]), signal.SIGSTOP)
    r = future.result(timeout=10)
    pool.shutdown()
    error = "timed out after 1 s (killed by the caller)"
    assert (r.output, r.exit_code, r.timed_out, r.error) == ("started\n", None, True, error)
    assert r.seconds < 5 and _processes_with(marker) == []
