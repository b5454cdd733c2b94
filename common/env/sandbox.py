"""Run model-written Python code behind a trust boundary and return what it printed (docs/sandbox.md).

    result = run_python("print(sum(range(10)))", timeout_s=5)   # RunResult(output="45\\n", exit_code=0, ...)

Each call runs the code in a fresh process tree under the strongest isolation this machine offers, probed once:
  "namespaces"  user + mount + pid + net + ipc + uts namespaces (unprivileged, no root needed), a minimal
                read-only root (system and Python directories only, no HOME, no repository), a tmpfs /tmp as the
                working directory, no network, uid nobody without capabilities, rlimits; the pid namespace
                takes every process the code started down with it.
  "rlimits"     where user namespaces are refused (Ubuntu's AppArmor restriction, some Slurm containers): a
                separate process with rlimits, a fresh temporary directory, nobody when run as root, and a
                subreaper that kills what the code left behind; NO filesystem or network isolation, said
                loudly once. require_isolation=True refuses to run instead.
The work happens in sandbox_child.py (standard library only), started with this machine's base Python
interpreter; this side writes the job, reads the output and turns how the process ended into one line.
Safe to call from many threads at once; never raises for what the code does, only for bad arguments.
"""

import ast
import marshal
import math
import os
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

_CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_child.py")
_PYTHON = os.path.realpath(sys.executable)  # the base interpreter, not the venv's wrapper: stdlib only inside
_GRACE_S = 5.0  # past timeout_s, when this side stops waiting for the sandbox's own supervisor and kills it
_probe_lock = threading.Lock()
_probe = None  # (level, details) once probed
_warned = False


@dataclass
class RunResult:
    output: str  # stdout and stderr interleaved as written, truncated to max_output_chars (said in the text)
    exit_code: int | None  # None when killed by a signal (or the sandbox failed to start)
    timed_out: bool
    error: str | None  # None on a clean exit 0, else one line the model can read
    seconds: float  # wall clock, start-up included


class SandboxUnavailable(RuntimeError):
    """require_isolation=True on a machine that cannot give the filesystem/network isolation."""


def _python_paths():
    """Directories to bind read-only beside /usr, /bin and /lib*: the Python install when it lives elsewhere."""
    paths = set()
    for path in (sys.base_prefix, os.path.dirname(os.path.dirname(_PYTHON))):
        path = os.path.realpath(path)
        if path != "/" and not any(path == d or path.startswith(d + "/") for d in ("/usr", "/bin", "/lib")):
            paths.add(path)
    return sorted(p for p in paths if not any(p.startswith(q + "/") for q in paths))


def _others_can_run(python):
    """Whether uid nobody can execute `python` and read its install (every directory above it searchable)."""
    for path in (python, os.path.realpath(os.path.join(os.path.dirname(python), ".."))):
        while path != "/":
            if not os.stat(path).st_mode & stat.S_IXOTH:
                return False
            path = os.path.dirname(path)
    return True


def _worker_python(level):
    """The interpreter the code runs on. In "rlimits" as root the code runs as nobody on the host's filesystem,
    which cannot reach a Python under /root (pyenv): take the system's python3 then."""
    if level == "namespaces" or os.geteuid() != 0 or _others_can_run(_PYTHON):
        return _PYTHON
    system = shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin")
    return os.path.realpath(system) if system and _others_can_run(os.path.realpath(system)) else _PYTHON


def _run(code, level, *, timeout_s, cpu_s, memory_mb, max_output_chars, max_processes):
    """One run at the given level. Returns (RunResult, the status records the sandbox reported)."""
    start = time.monotonic()
    root = tempfile.mkdtemp(prefix="sandbox-")  # the new root's mount point, or the working dir in "rlimits"
    status_r, status_w = os.pipe()
    job = {
        "level": level,
        "code": code,
        "root": root,
        "status_fd": status_w,
        "python": _worker_python(level),
        "ro_paths": _python_paths(),
        "euid": os.geteuid(),
        "egid": os.getegid(),
        "timeout_s": timeout_s,
        "cpu_s": math.ceil(cpu_s),
        "memory_mb": memory_mb,
        "max_processes": max_processes,
        "ld_library_path": os.environ.get("LD_LIBRARY_PATH", ""),
    }
    proc = None
    try:
        proc = subprocess.Popen(
            [_PYTHON, "-I", "-S", _CHILD],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            pass_fds=(status_w,),
            cwd="/",
            env={"LD_LIBRARY_PATH": job["ld_library_path"]} if job["ld_library_path"] else {},
        )
        os.close(status_w)
        status_w = None
        try:
            proc.stdin.write(marshal.dumps(job))
            proc.stdin.close()
        except BrokenPipeError:
            pass
        head, total, status_text = _read(proc, status_r, max_output_chars, deadline=start + timeout_s + _GRACE_S)
    finally:
        if proc is not None:
            if proc.poll() is None:  # past the grace: the kill reaches the whole tree through PR_SET_PDEATHSIG
                proc.kill()
            proc.wait()
            proc.stdout.close()
        for fd in (status_r, status_w):
            if fd is not None:
                os.close(fd)
        shutil.rmtree(root, ignore_errors=True)
    records = []
    for line in status_text.splitlines():  # written by sandbox_child.py only: the code never holds this pipe
        try:
            records.append(ast.literal_eval(line))
        except (SyntaxError, ValueError):
            records.append({"setup_error": line})
    result = _result(head, total, records, max_output_chars, timeout_s, cpu_s, memory_mb)
    result.seconds = time.monotonic() - start
    return result, records


def _read(proc, status_r, max_output_chars, deadline):
    """Read the output pipe (keeping its head, counting all of it) and the status pipe until both close."""
    keep = 4 * max_output_chars + 4  # bytes: enough for max_output_chars characters of UTF-8
    head, total, status = bytearray(), 0, bytearray()
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout.fileno(), selectors.EVENT_READ, "out")
    sel.register(status_r, selectors.EVENT_READ, "status")
    killed = False
    while sel.get_map():
        left = deadline - time.monotonic()
        if left <= 0 and not killed:  # the supervisor inside did not end it: kill the tree from here
            proc.kill()
            killed, deadline = True, time.monotonic() + 2.0
            continue
        if left <= 0:
            break
        for key, _ in sel.select(timeout=left):
            data = os.read(key.fd, 1 << 16)
            if not data:
                sel.unregister(key.fd)
            elif key.data == "status":
                status += data
            else:
                total += len(data)
                if len(head) < keep:
                    head += data[: keep - len(head)]
    sel.close()
    return bytes(head), total, status.decode(errors="replace")


def _signal_name(num):
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"


def _result(head, total, records, max_output_chars, timeout_s, cpu_s, memory_mb):
    text = head.decode(errors="replace")
    output = text[:max_output_chars]
    if total > len(head) or len(text) > max_output_chars:
        output += f"\n... [output truncated: {total} bytes in all]"
    ended = next((r for r in records if "exit" in r or "signal" in r), None)
    setup = next((r["setup_error"] for r in records if "setup_error" in r), None)
    timed_out = bool(ended and ended["timed_out"])
    exit_code, error = None, None
    if timed_out:
        error = f"timed out after {timeout_s:g} s"
    elif ended is None or setup is not None:
        error = f"sandbox failed: {setup or 'it ended without reporting a status'}"
    elif "signal" in ended:
        sig = ended["signal"]
        if sig == signal.SIGXCPU:
            error = f"CPU time limit ({cpu_s:g} s) exceeded"
        elif sig == signal.SIGXFSZ:
            error = f"file size limit ({memory_mb} MB) exceeded"
        else:
            error = f"killed by signal {sig} ({_signal_name(sig)})"
    else:
        exit_code = ended["exit"]
        last = text.rstrip().rsplit("\n", 1)[-1] if total == len(head) else ""
        if exit_code != 0 and last.startswith("MemoryError"):  # RLIMIT_AS refused an allocation
            error = f"memory limit ({memory_mb} MB) exceeded"
        elif exit_code != 0:
            error = f"exit code {exit_code}"
    return RunResult(output=output, exit_code=exit_code, timed_out=timed_out, error=error, seconds=0.0)


def _probe_level():
    """Which level works here, probed once per process by running print('ok') in namespaces."""
    global _probe
    with _probe_lock:
        if _probe is None:
            limits = dict(timeout_s=10.0, cpu_s=10, memory_mb=1024, max_output_chars=100, max_processes=64)
            result, records = _run("print('ok')", "namespaces", **limits)
            if result.output == "ok\n" and result.exit_code == 0:
                proc = next((r["proc"] for r in records if "proc" in r), False)
                _probe = ("namespaces", "/proc mounted" if proc else "no /proc (the container refuses it)")
            else:
                _probe = ("rlimits", result.error or result.output.strip())
        return _probe


def sandbox_kind(*, namespaces=True) -> str:
    """One line: the isolation run_python gives on this machine (for the start-up log and the docs)."""
    level, details = _probe_level() if namespaces else ("rlimits", "namespaces=False")
    if level == "namespaces":
        return (
            "namespaces: user+mount+pid+net+ipc+uts, read-only minimal root, tmpfs /tmp, no network, "
            f"uid nobody without capabilities, rlimits ({details})"
        )
    return (
        f"rlimits only: NO filesystem or network isolation ({details}); enable unprivileged user namespaces "
        "(sysctl kernel.apparmor_restrict_unprivileged_userns=0 or user.max_user_namespaces>0) to isolate"
    )


def _check_args(code, timeout_s, cpu_s, memory_mb, max_output_chars, max_processes, require_isolation, namespaces):
    if not isinstance(code, str):
        raise TypeError(f"run_python: code must be a str, got {type(code).__name__}")
    for name, value in (("timeout_s", timeout_s), ("cpu_s", cpu_s)):
        if not isinstance(value, (int, float)) or not 0 < value <= 86400:
            raise ValueError(f"run_python: {name}={value!r} must be a number of seconds in (0, 86400]")
    for name, value, low in (("memory_mb", memory_mb, 64), ("max_output_chars", max_output_chars, 1)):
        if not isinstance(value, int) or value < low:
            raise ValueError(f"run_python: {name}={value!r} must be an int >= {low}")
    if not isinstance(max_processes, int) or max_processes < 1:
        raise ValueError(f"run_python: max_processes={max_processes!r} must be an int >= 1 (1: no child processes)")
    if require_isolation and not namespaces:
        raise ValueError("run_python: require_isolation=True needs namespaces=True (the isolation comes from them)")


def run_python(
    code: str,
    *,
    timeout_s: float = 10.0,
    cpu_s: float = 10.0,
    memory_mb: int = 1024,
    max_output_chars: int = 4096,
    max_processes: int = 64,
    require_isolation: bool = False,
    namespaces: bool = True,
) -> RunResult:
    """Run `code` as a Python 3 program (standard library only) in the sandbox; see the module docstring.

    timeout_s: wall clock; cpu_s: CPU seconds of each process (RLIMIT_CPU, rounded up); memory_mb: address
    space of each process (RLIMIT_AS) and the size of the writable /tmp; max_processes: processes and threads
    (RLIMIT_NPROC); require_isolation: raise SandboxUnavailable instead of running without namespaces;
    namespaces=False: skip them (the "rlimits" level), e.g. to compare levels.
    """
    _check_args(code, timeout_s, cpu_s, memory_mb, max_output_chars, max_processes, require_isolation, namespaces)
    level, details = _probe_level() if namespaces else ("rlimits", "namespaces=False")
    if level != "namespaces" and namespaces:
        if require_isolation:
            raise SandboxUnavailable(f"sandbox: no filesystem/network isolation here: {sandbox_kind()}")
        _warn_once()
    limits = dict(timeout_s=timeout_s, cpu_s=cpu_s, memory_mb=memory_mb, max_output_chars=max_output_chars)
    return _run(code, level, max_processes=max_processes, **limits)[0]


def _warn_once():
    global _warned
    kind = sandbox_kind()
    with _probe_lock:
        if not _warned:
            _warned = True
            print(f"WARNING: sandbox for model-written code: {kind}", file=sys.stderr, flush=True)
