"""The sandbox's side of common/env/sandbox.py: started as `python -I -S sandbox_child.py` (the standard library
only, nothing of the project), it reads its job (a marshal'ed dict) on stdin, builds the isolation and runs the
model's code.

Process tree in the "namespaces" level (each line forks the next; PR_SET_PDEATHSIG chains a kill from the top):

    boot     (the caller's user namespace)  writes the uid/gid maps of its child, waits for it
    child    unshare(user, mount, pid, net, ipc, uts); forks the pid namespace's init
    init     pid 1: builds a minimal read-only root (pivot_root), forks the worker, enforces the wall clock;
             when it exits the kernel kills every process left in the namespace (fork bombs included)
    worker   uid nobody, no capabilities, no_new_privs, rlimits; execs `python -I -S -u main.py` in /tmp

In the "rlimits" level boot is init itself (no namespaces): a child subreaper that kills whatever the code
leaves behind, and the worker drops to nobody when boot runs as root.
What the code sees goes to one pipe (stdout and stderr interleaved); what happened goes as JSON lines on a
second pipe (the status fd) as dict literals: {"exit": 0} | {"signal": 9, "timed_out": true} | {"setup_error": "..."}.
"""

import ctypes
import marshal
import os
import resource
import signal
import sys
import time

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC, MS_PRIVATE, MS_RELATIME = 1024, 2048, 4096, 16384, 1 << 18, 1 << 21
ST_RELATIME, MNT_DETACH = 4096, 2
PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 36, 38
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 217, "ppc64le": 203}.get(os.uname().machine)
NOBODY = 65534  # the uid (and gid) the code runs as, inside and, when we are root, outside the namespace
LIBC = ctypes.CDLL(None, use_errno=True)


def _libc(name, *args):
    """Call a libc function; raise OSError naming it when it returns -1."""
    args = [a.encode() if isinstance(a, str) else a for a in args]
    if getattr(LIBC, name)(*args) != 0:
        err = ctypes.get_errno()
        raise OSError(
            err, f"{name}{tuple(a.decode() if isinstance(a, bytes) else a for a in args)}: {os.strerror(err)}"
        )


def _die_with_parent():
    _libc("prctl", PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _report(status_fd, **fields):
    os.write(status_fd, (repr(fields) + "\n").encode())  # a dict literal a line


# ---- the namespaces: boot -> child (unshare) -> init (pid 1) ----
def _write_maps(pid, euid, egid):
    """The uid/gid maps of the child's new user namespace, written from outside it (root may map any uid).

    As root: inside 0 = outside 0 (init builds the mounts with capabilities that count only in the namespace)
    and nobody = nobody, so the code, once it drops to nobody, is nobody on the host too. As a user: the one
    uid a user may map, its own, appears as nobody inside; the worker loses every capability at exec.
    """
    if euid == 0:
        uid_map, gid_map = f"0 0 1\n{NOBODY} {NOBODY} 1\n", f"0 0 1\n{NOBODY} {NOBODY} 1\n"
    else:
        uid_map, gid_map = f"{NOBODY} {euid} 1\n", f"{NOBODY} {egid} 1\n"
        with open(f"/proc/{pid}/setgroups", "w") as f:  # required before an unprivileged gid_map
            f.write("deny")
    with open(f"/proc/{pid}/uid_map", "w") as f:
        f.write(uid_map)
    with open(f"/proc/{pid}/gid_map", "w") as f:
        f.write(gid_map)


def _namespaces(job, out_fd, status_fd):
    """boot: fork the child, map its ids once it has unshared, wait for it. Returns boot's exit status."""
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            _die_with_parent()
            os.close(ready_r), os.close(go_w)
            flags = CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS
            _libc("unshare", flags)
            os.write(ready_w, b"u")
            if os.read(go_r, 1) != b"g":
                os._exit(1)
            init = os.fork()  # pid 1 of the new pid namespace
            if init == 0:
                _die_with_parent()
                _init(job, out_fd, status_fd)
                os._exit(0)
            os.close(out_fd)
            os._exit(os.waitstatus_to_exitcode(os.waitpid(init, 0)[1]) & 0xFF)
        except BaseException as e:
            _report(status_fd, setup_error=str(e))
            os._exit(1)
    os.close(ready_w), os.close(go_r), os.close(out_fd)
    if os.read(ready_r, 1) == b"u":
        try:
            _write_maps(pid, job["euid"], job["egid"])
            os.write(go_w, b"g")
        except OSError as e:
            _report(status_fd, setup_error=f"writing the uid/gid maps: {e}")
    os.close(go_w)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def _bind_ro(src, dst):
    """Bind src on dst read-only, nosuid, nodev (keeping the flags the kernel locks from the source mount)."""
    try:
        _libc("mount", src, dst, None, MS_BIND, None)
    except OSError:  # a mount with submounts locked by the namespace can only be bound recursively
        _libc("mount", src, dst, None, MS_BIND | MS_REC, None)
    st = os.statvfs(src).f_flag
    keep = (st & (MS_NOEXEC | MS_NOATIME | MS_NODIRATIME)) | (MS_RELATIME if st & ST_RELATIME else 0)
    _libc("mount", None, dst, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | keep, None)


def _build_root(job):
    """Mount a fresh tmpfs on job["root"] holding read-only binds of the system and Python directories, /dev's
    harmless nodes, /proc of the new pid namespace and a writable /tmp; pivot_root into it, drop the old root."""
    root = job["root"]
    _libc("mount", None, "/", None, MS_REC | MS_PRIVATE, None)  # nothing we mount propagates to the host
    _libc("mount", "sandbox", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=16m,mode=755")
    for name in ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        if os.path.islink("/" + name):  # merged /usr: /bin -> usr/bin
            os.symlink(os.readlink("/" + name), f"{root}/{name}")
        elif os.path.isdir("/" + name):
            os.mkdir(f"{root}/{name}")
            _bind_ro("/" + name, f"{root}/{name}")
    for path in job["ro_paths"]:  # the Python install when it lives outside /usr (pyenv, conda)
        os.makedirs(root + path)
        _bind_ro(path, root + path)
    os.mkdir(f"{root}/etc")
    for name, text in (("passwd", f"nobody:x:{NOBODY}:{NOBODY}::/tmp:/bin/sh\n"), ("group", f"nogroup:x:{NOBODY}:\n")):
        with open(f"{root}/etc/{name}", "w") as f:
            f.write(text)
    if os.path.isfile("/etc/ld.so.cache"):
        open(f"{root}/etc/ld.so.cache", "w").close()
        _bind_ro("/etc/ld.so.cache", f"{root}/etc/ld.so.cache")
    os.mkdir(f"{root}/dev")
    for name in ("null", "zero", "full", "random", "urandom"):
        open(f"{root}/dev/{name}", "w").close()
        _libc("mount", f"/dev/{name}", f"{root}/dev/{name}", None, MS_BIND, None)
    for i, name in enumerate(("stdin", "stdout", "stderr")):
        os.symlink(f"/proc/self/fd/{i}", f"{root}/dev/{name}")
    os.symlink("/proc/self/fd", f"{root}/dev/fd")
    # /tmp (the working directory) is the only writable place: its size is the memory budget again
    os.mkdir(f"{root}/tmp")
    _libc("mount", "tmp", f"{root}/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"size={job['memory_mb']}m,mode=755")
    os.chown(f"{root}/tmp", NOBODY, NOBODY)
    os.mkdir(f"{root}/dev/shm")  # POSIX shared memory and semaphores (multiprocessing)
    _libc("mount", "shm", f"{root}/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, "size=64m,mode=1777")
    with open(f"{root}/tmp/main.py", "w") as f:
        f.write(job["code"])
    os.mkdir(f"{root}/proc")
    try:  # refused where the container masks parts of the host's /proc; Python runs without it
        _libc("mount", "proc", f"{root}/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
        proc = True
    except OSError:
        proc = False
    os.chdir(root)
    if SYS_PIVOT_ROOT is not None:  # pivot_root(".", ".") stacks the old root on the new one; detach it
        _libc("syscall", SYS_PIVOT_ROOT, ".", ".")
        _libc("umount2", ".", MNT_DETACH)
    else:
        _libc("chroot", ".")
    os.chdir("/")
    _libc("mount", None, "/", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, None)
    _libc("sethostname", b"sandbox", 7)
    return proc


def _init(job, out_fd, status_fd):
    """pid 1 of the sandbox's pid namespace: build the root, run the worker, report. Its exit kills the rest."""
    try:
        proc = _build_root(job)
    except BaseException as e:
        _report(status_fd, setup_error=f"building the sandbox's root: {e}")
        return
    _report(status_fd, proc=proc)
    _supervise(job, out_fd, status_fd, workdir="/tmp", drop_to_nobody=job["euid"] == 0)


# ---- both levels: the worker and its supervision ----
def _worker(job, out_fd, workdir, drop_to_nobody):
    """In the forked worker: its own session, nobody, no new privileges, rlimits, then exec the code."""
    os.setsid()
    if drop_to_nobody:  # from root: all ids to nobody, which also clears every capability
        os.setgroups([])
        os.setresgid(NOBODY, NOBODY, NOBODY)
        os.setresuid(NOBODY, NOBODY, NOBODY)
    _libc("prctl", PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    mb = 1 << 20
    limits = {
        resource.RLIMIT_AS: job["memory_mb"] * mb,  # address space: a big allocation fails with MemoryError
        resource.RLIMIT_CPU: (job["cpu_s"], job["cpu_s"] + 1),  # SIGXCPU at the soft limit, SIGKILL a second later
        resource.RLIMIT_FSIZE: job["memory_mb"] * mb,  # a larger file: SIGXFSZ
        resource.RLIMIT_CORE: 0,
        resource.RLIMIT_NPROC: job["max_processes"],  # counted per uid (per user namespace in "namespaces")
        resource.RLIMIT_NOFILE: 1024,
    }
    for which, value in limits.items():
        soft, hard = value if isinstance(value, tuple) else (value, value)
        old_hard = resource.getrlimit(which)[1]
        if old_hard != resource.RLIM_INFINITY:  # never ask above the hard limit we were given
            soft, hard = min(soft, old_hard), min(hard, old_hard)
        resource.setrlimit(which, (soft, hard))
    os.chdir(workdir)
    null = os.open("/dev/null", os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(out_fd, 1)
    os.dup2(out_fd, 2)
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8"}
    if job.get("ld_library_path"):
        env["LD_LIBRARY_PATH"] = job["ld_library_path"]
    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    python = job["python"]
    os.execve(python, [python, "-I", "-S", "-u", "main.py"], env)


def _children():
    me = os.getpid()
    try:
        with open(f"/proc/{me}/task/{me}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


def _kill_descendants(pgid):
    """As a child subreaper: SIGKILL the code's process group, then every process reparented to us, until none is
    left (a process that left the group with setsid is reparented to us when its parent dies)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except OSError:
        pass
    while True:
        for pid in _children():
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                time.sleep(0.002)
        except ChildProcessError:
            return


def _supervise(job, out_fd, status_fd, workdir, drop_to_nobody):
    """Fork the worker, SIGKILL its process group at the wall-clock limit, report how it ended, clean up."""
    timed_out = False
    pid = os.fork()
    if pid == 0:
        try:
            _worker(job, out_fd, workdir, drop_to_nobody)
        except BaseException as e:
            _report(status_fd, setup_error=f"starting the code: {e}")
        os._exit(127)
    os.close(out_fd)

    def on_alarm(signum, frame):
        nonlocal timed_out
        timed_out = True
        for kill in (os.killpg, os.kill):
            try:
                kill(pid, signal.SIGKILL)
            except OSError:
                pass

    signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, job["timeout_s"])
    while True:  # as pid 1 or subreaper we also reap the code's orphans here
        try:
            done, status = os.waitpid(-1, 0)
        except ChildProcessError:
            status = None
            break
        if done == pid:
            break
    signal.setitimer(signal.ITIMER_REAL, 0)
    _kill_descendants(pid)  # in a pid namespace init's exit would do it too
    if status is not None and os.WIFSIGNALED(status):
        _report(status_fd, signal=os.WTERMSIG(status), timed_out=timed_out)
    elif status is not None:
        _report(status_fd, exit=os.WEXITSTATUS(status), timed_out=timed_out)


def main():
    job = marshal.loads(sys.stdin.buffer.read())  # marshal, not json: json imports re (~30 ms)
    status_fd = job["status_fd"]
    os.set_inheritable(status_fd, False)
    out_fd = os.dup(1)  # the output pipe, kept off our own stdout/stderr so only the code writes to it
    null = os.open("/dev/null", os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    try:
        if job["level"] == "namespaces":
            return _namespaces(job, out_fd, status_fd)
        _libc("prctl", PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        if job["euid"] == 0:
            os.chown(job["root"], NOBODY, NOBODY)
        with open(os.path.join(job["root"], "main.py"), "w") as f:
            f.write(job["code"])
        _supervise(job, out_fd, status_fd, workdir=job["root"], drop_to_nobody=job["euid"] == 0)
    except BaseException as e:
        _report(status_fd, setup_error=str(e))
    return 0


if __name__ == "__main__":
    sys.exit(main())
