"""Sandbox launcher and test harness; runs as ``python -I -S -B _sandbox_launcher.py``.

Standard library only, never imports ``prorl_async``: it runs in a fresh interpreter started
by :func:`prorl_async.rewards.sandbox.run_tests`, reads one JSON job from stdin, and writes
one JSON line per test case, then ``{"done": true}``, to stdout.

Process layout in ``root`` isolation (see ``sandbox.py`` for the reasoning)::

    grader (root) ── L: this script, root, new session ── C: pid 1 of a new pid namespace,
                                                              unprivileged uid, the harness
                                                              └─ T: one fork per test case,
                                                                 runs the untrusted program

L unshares mount, network, pid, IPC and UTS namespaces, forks C and waits for it. C mounts a
private /proc and fresh tmpfs over /tmp, /var/tmp, /dev/shm, /run/lock, re-exposes the Python
installation if it sits under a directory "others" cannot traverse (``/root`` here), applies
rlimits, drops to the job's uid, and runs the harness. Each test case runs in T, a fork of C;
expected outputs never enter the sandbox: T's output and return value go back to the grader,
which compares. After each case C sends SIGKILL to every process of the namespace that it may
signal (``kill(-1)``): everything but itself. When C (pid 1) exits, the kernel kills whatever
is left in the namespace.
"""

import builtins
import ctypes
import io
import json
import os
import resource
import select
import signal
import stat
import sys
import time
import traceback

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MS_NOATIME, MS_NODIRATIME, MS_RELATIME = 1024, 2048, 1 << 21
PR_SET_PDEATHSIG, PR_CAPBSET_DROP, PR_SET_SECUREBITS, PR_SET_NO_NEW_PRIVS = 1, 24, 28, 38
PR_SET_CHILD_SUBREAPER = 36
SECBITS_LOCKED_NOROOT = 0x2F  # NOROOT|NOROOT_LOCKED|NO_SETUID_FIXUP|NO_SETUID_FIXUP_LOCKED|KEEP_CAPS_LOCKED
STDERR_TAIL = 2048

libc = ctypes.CDLL(None, use_errno=True)


class SetupError(Exception):
    pass


def _check(ret, what):
    if ret != 0:
        err = ctypes.get_errno()
        raise SetupError(f"{what}: {os.strerror(err)} (errno {err})")


def _mount(source, target, fstype, flags, data=None):
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    _check(libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)),
           f"mount {fstype or source} on {target}")


def _emit(obj):
    data = (json.dumps(obj) + "\n").encode()
    while data:
        n = os.write(1, data)
        data = data[n:]


# ---------------------------------------------------------------------------------------------
# namespace and filesystem setup (runs as root of the new namespaces, in C)


def _others_can_traverse(path):
    st = os.stat(path)
    return bool(st.st_mode & stat.S_IXOTH)


def _expose(paths):
    """Make ``paths`` reachable by any uid when an ancestor is not traversable by "others".

    For each blocking ancestor A (e.g. /root, mode 0700): keep a handle on each path, mount an
    empty tmpfs over A (which also hides A's other contents), recreate the path inside it and
    bind-mount the original back, read-only.
    """
    blocked = {}
    for path in paths:
        path = os.path.realpath(path)
        if not os.path.isdir(path):
            continue
        parts = path.split("/")[1:]
        for k in range(1, len(parts) + 1):
            ancestor = "/" + "/".join(parts[:k])
            if ancestor == path:
                break
            if not _others_can_traverse(ancestor):
                blocked.setdefault(ancestor, []).append(path)
                break
    for ancestor, inner in blocked.items():
        fds = [(p, os.open(p, os.O_PATH | os.O_DIRECTORY)) for p in inner]
        _mount("tmpfs", ancestor, "tmpfs", MS_NOSUID | MS_NODEV, "mode=755,size=1m")
        for p, fd in fds:
            os.makedirs(p, exist_ok=True)
            _mount(f"/proc/self/fd/{fd}", p, None, MS_BIND | MS_REC)
            _mount(None, p, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
            os.close(fd)


_FLAG_NAMES = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC,
               "noatime": MS_NOATIME, "nodiratime": MS_NODIRATIME, "relatime": MS_RELATIME}


def _remount_all_readonly(skip):
    """Best effort: every mount except ``skip`` (and those under it) becomes read-only (userns)."""
    with open("/proc/self/mountinfo") as f:
        lines = f.read().splitlines()
    for line in lines:
        fields = line.split()
        mountpoint, opts = fields[4].replace("\\040", " "), fields[5].split(",")
        if any(mountpoint == s or mountpoint.startswith(s.rstrip("/") + "/") for s in skip):
            continue
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY
        for o in opts:
            flags |= _FLAG_NAMES.get(o, 0)
        try:
            _mount(None, mountpoint, None, flags)
        except SetupError:
            pass  # e.g. a mount hidden under another; reported by the isolation probe tests


def _drop_all_capabilities():
    _check(libc.prctl(PR_SET_SECUREBITS, SECBITS_LOCKED_NOROOT, 0, 0, 0), "securebits")
    for cap in range(64):
        if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            break  # past the last capability this kernel knows
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this thread
    data = (ctypes.c_uint32 * 6)()
    _check(libc.capset(header, data), "capset")


def setup_isolated(job):
    """Runs in C: mounts, limits, privilege drop. Returns the working directory."""
    limits = job["limits"]
    mode = job["isolation"]
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    if mode == "root":
        _expose(job["expose_paths"])
    tmpfs = []
    for d in ("/tmp", "/var/tmp", "/dev/shm", "/run/lock"):
        if os.path.isdir(d) and not os.path.islink(d):
            size = limits["tmpfs_mb"] if d == "/tmp" else 1
            _mount("tmpfs", d, "tmpfs", MS_NOSUID | MS_NODEV, f"mode=1777,size={size}m")
            tmpfs.append(d)
    workdir = "/tmp/work"
    os.mkdir(workdir, 0o700)
    if mode == "root":
        os.chown(workdir, job["uid"], job["uid"])
    else:
        _remount_all_readonly(skip=tmpfs + ["/proc"])
    _set_rlimits(limits, nproc=True)
    if mode == "root":
        uid = job["uid"]
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    else:
        _drop_all_capabilities()
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    os.chdir(workdir)
    return workdir


def _set_rlimits(limits, nproc):
    mem = int(limits["memory_mb"]) << 20
    cpu = int(limits["total_time_s"]) + 2
    resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits["tmpfs_mb"] << 20,) * 2)
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    stack = min(64 << 20, mem // 4)
    resource.setrlimit(resource.RLIMIT_STACK, (stack, stack))
    if nproc:
        n = int(limits["max_procs"])
        resource.setrlimit(resource.RLIMIT_NPROC, (n, n))


# ---------------------------------------------------------------------------------------------
# the harness (runs in C, unprivileged)


def _jsonable(value):
    if isinstance(value, (set, frozenset)):
        try:
            return sorted(_jsonable(v) for v in value)
        except TypeError:
            return [_jsonable(v) for v in value]
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return value


def _resolve_function(ns, fn_name):
    fn = ns.get(fn_name)
    if callable(fn) and not isinstance(fn, type):
        return fn
    solution = ns.get("Solution")
    if isinstance(solution, type) and hasattr(solution, fn_name):
        return getattr(solution(), fn_name)
    raise NameError(f"no function {fn_name!r} (nor Solution.{fn_name}) defined")


def _run_case_in_child(source, case, in_fd, out_w, err_w, res_w):
    """Runs in T. Never returns."""
    status = 1
    try:
        os.dup2(in_fd, 0)
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        os.dup2(res_w, 3)
        os.closerange(4, 1 << 16)
        sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding="utf-8", errors="replace")
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8", errors="replace")
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding="utf-8",
                                      errors="replace", line_buffering=True)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        kind = case["kind"]
        ns = {"__name__": "__main__" if kind == "stdio" else "solution", "__builtins__": builtins}
        try:
            exec(compile(source, "<solution>", "exec"), ns)
            payload = b""
            if kind == "call":
                result = _resolve_function(ns, case["fn_name"])(*case["args"])
                payload = json.dumps(_jsonable(result), default=repr).encode()
            elif kind == "exec":  # test code (asserts, check(candidate)) run in the program's namespace
                exec(compile(case["code"], "<test>", "exec"), ns)
                payload = b"true"  # reached only when the test code ran to its end
            while payload:
                payload = payload[os.write(3, payload):]
            status = 0
        except SystemExit as e:
            status = 0 if e.code in (None, 0) else (e.code if isinstance(e.code, int) else 1)
        except BaseException:
            traceback.print_exc()
            status = 1
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except BaseException:
            status = status or 1
    finally:
        os._exit(status & 0xFF)


def _children():
    me = str(os.getpid())
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[1] == me:
                        kids.append(int(entry))
            except (OSError, IndexError):
                pass
    return kids


def _kill_others(mode, child_pgid):
    """SIGKILL everything the test case left behind and reap it.

    Namespaced modes: ``kill(-1)`` from pid 1 reaches every other process of the namespace.
    ``none``: we are a child subreaper, so whatever T left behind (even after ``setsid``) is
    re-parented to us when its parent dies; kill our children until none are left. Reaping is
    non-blocking: a process re-parented to us after a scan is found by the next one.
    """
    if mode == "none":
        try:
            os.killpg(child_pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    deadline = time.monotonic() + 5.0
    while True:
        if mode == "none":
            for pid in _children():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        else:
            try:
                os.kill(-1, signal.SIGKILL)  # every process we may signal, except ourselves
            except ProcessLookupError:
                pass
        while True:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return  # no children left
            if pid == 0:
                break  # some are still dying
        if time.monotonic() > deadline:
            return
        time.sleep(0.002)


def run_case(job, case, budget_s, workdir):
    limits = job["limits"]
    cap = int(limits["max_output_bytes"])
    in_path = os.path.join(workdir, ".stdin")
    with open(in_path, "wb") as f:
        f.write(case.get("input", "").encode())
    in_fd = os.open(in_path, os.O_RDONLY)
    os.unlink(in_path)
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    res_r, res_w = os.pipe()
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:
        if job["isolation"] == "none":
            os.setpgid(0, 0)
        for fd in (out_r, err_r, res_r):
            os.close(fd)
        _run_case_in_child(job["source"], case, in_fd, out_w, err_w, res_w)
    if job["isolation"] == "none":
        try:
            os.setpgid(pid, pid)
        except OSError:
            pass
    for fd in (in_fd, out_w, err_w, res_w):
        os.close(fd)
    bufs = {out_r: bytearray(), err_r: bytearray(), res_r: bytearray()}
    open_fds = set(bufs)
    pidfd = os.pidfd_open(pid)
    status = exit_code = None
    deadline = start + budget_s
    exited = False
    err_total = 0
    while status is None and not (exited and not open_fds):
        left = deadline - time.monotonic()
        if left <= 0:
            status = "timeout"
            break
        # once T has exited, only drain what is already in the pipes (a background process
        # it left behind may hold them open; it is killed below)
        ready, _, _ = select.select(list(open_fds) + ([] if exited else [pidfd]), [], [],
                                    0 if exited else left)
        if not ready and exited:
            break
        for fd in ready:
            if fd == pidfd:
                exited = True
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                open_fds.discard(fd)
                continue
            buf = bufs[fd]
            buf += chunk
            if fd == err_r:
                err_total += len(chunk)
                if err_total > cap:
                    status = "output_limit"
            if fd == err_r and len(buf) > STDERR_TAIL:
                del buf[: len(buf) - STDERR_TAIL]
            elif len(buf) > cap:
                status = "output_limit"
    if status is None:
        _, wstatus = os.waitpid(pid, 0)
        exit_code = os.waitstatus_to_exitcode(wstatus)
    os.close(pidfd)
    elapsed = time.monotonic() - start
    _kill_others(job["isolation"], pid)
    for fd in (out_r, err_r, res_r):
        os.close(fd)
    if status is None:
        status = "ok" if exit_code == 0 else "error"
    result = {"status": status, "exit": exit_code, "time_s": round(elapsed, 4),
              "stdout": bytes(bufs[out_r][:cap]).decode("utf-8", "replace"),
              "stderr": bytes(bufs[err_r]).decode("utf-8", "replace")}
    if case["kind"] in ("call", "exec") and status == "ok":  # an exit before the end is no pass
        try:
            result["returned"] = json.loads(bytes(bufs[res_r]).decode("utf-8", "replace"))
        except ValueError:
            result["status"] = "error"
            result["stderr"] += "\n<harness: no return value>"
    return result


def harness(job, workdir):
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # pid 1 ignores what it has no handler for
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    for path in job.get("sys_path", []):
        if path not in sys.path:
            sys.path.append(path)
    sys.stdout.flush()
    _emit({"started": True})
    deadline = time.monotonic() + float(job["limits"]["total_time_s"])
    per_case = float(job["limits"]["time_limit_s"])
    for i, case in enumerate(job["cases"]):
        left = deadline - time.monotonic()
        if left <= 0.01:
            _emit({"i": i, "status": "skipped", "stdout": "", "stderr": "", "exit": None, "time_s": 0.0})
            continue
        result = run_case(job, case, min(per_case, left), workdir)
        result["i"] = i
        _emit(result)
    _emit({"done": True})


# ---------------------------------------------------------------------------------------------


def main():
    job = json.loads(sys.stdin.buffer.read())
    _check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "pdeathsig")
    if os.getppid() != job["parent_pid"]:
        os._exit(70)  # the grader died before we armed the death signal
    mode = job["isolation"]
    if mode == "none":
        workdir = job["workdir"]
        os.chdir(workdir)
        _check(libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0), "child_subreaper")
        _set_rlimits(job["limits"], nproc=False)
        harness(job, workdir)
        return
    try:
        flags = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS
        if mode == "userns":
            uid, gid = os.getuid(), os.getgid()
            _check(libc.unshare(flags | CLONE_NEWUSER), "unshare(user|mnt|net|pid|ipc|uts)")
            with open("/proc/self/setgroups", "w") as f:
                f.write("deny")
            with open("/proc/self/uid_map", "w") as f:
                f.write(f"0 {uid} 1")
            with open("/proc/self/gid_map", "w") as f:
                f.write(f"0 {gid} 1")
        else:
            _check(libc.unshare(flags), "unshare(mnt|net|pid|ipc|uts)")
    except (SetupError, OSError) as e:
        _emit({"setup_error": str(e)})
        os._exit(3)
    child = os.fork()
    if child:  # L: wait for C, forward its exit status
        while True:
            try:
                _, wstatus = os.waitpid(child, 0)
                break
            except InterruptedError:
                continue
        os._exit(os.waitstatus_to_exitcode(wstatus) & 0xFF)
    # C: pid 1 of the new pid namespace
    try:
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        workdir = setup_isolated(job)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # cleared by the uid change
    except (SetupError, OSError) as e:
        _emit({"setup_error": f"{type(e).__name__}: {e}"})
        os._exit(3)
    harness(job, workdir)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
