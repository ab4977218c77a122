"""Supervisor of one run of the local process driver; a standalone program (stdlib only).

    python -I -S _process_wrapper.py RUN_DIR [--user UID:GID] -- COMMAND [ARGS...]

LocalProcessDriver starts it in a session of its own, so it outlives agent restarts. It plays the
part the container runtime plays for Docker:

- runs COMMAND in a new session (own process group: the driver signals that group, never us),
  as UID:GID with no supplementary groups when --user is given (we stay root to keep the run's
  records, which the command cannot then touch);
- records the command's pid and kernel start time in RUN_DIR/child.json, so a restarted agent can
  tell the command from a later process that reuses the pid;
- copies the command's stdout to stdout.log (what output_since reads) and stdout + stderr to
  output.log (what logs_tail reads);
- when the command exits, kills whatever is left of its process group, as a container's end
  would, and records the exit code (128 + signal when killed, Docker's convention) in exit.json.

The driver hands us the run's lock file already locked; we hold it (inherited fd) for as long as
we live, which is how the driver knows a supervisor is alive without trusting a pid.

Every rental start pays for this program's start, so it imports only what the interpreter has
already loaded or nearly (no `subprocess`, `json`, `contextlib`: each pulls in `re` and more);
with `-S` (no site-packages) its start costs about a third of `python -I` with those imports
(bench/launch.py prints both beside a bare `python -c pass`).
"""

from __future__ import annotations

import os
import selectors
import signal
import sys
import time

# Descendants that left the process group can keep our pipes open after the command exited;
# we stop copying their output after this long rather than hang.
DRAIN_AFTER_EXIT_S = 5.0


def proc_stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start time in clock ticks since boot) from /proc/PID/stat; None if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode("ascii", errors="replace")
    except OSError:
        return None
    # The command name (field 2) may contain spaces and parentheses: split after the last ")".
    fields = stat.rpartition(")")[2].split()
    return fields[0], int(fields[19])  # fields 3 and 22 of proc(5)


def write_json_atomic(path: str, data: dict) -> None:
    """`data` as JSON in one atomic, durable step (the driver's records)."""
    import json  # here, not at the top: the supervisor itself writes only flat records

    _write_atomic(path, json.dumps(data), durable=True)


def write_record(path: str, fields: dict[str, int | float | None], *, durable: bool) -> None:
    """A flat record of numbers as a JSON object, without the json module (see above)."""
    values = ", ".join(f'"{k}": {"null" if v is None else repr(v)}' for k, v in fields.items())
    _write_atomic(path, "{" + values + "}", durable=durable)


def _write_atomic(path: str, text: str, *, durable: bool) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
        if durable:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)


def exited(pid: int) -> bool:
    """True once the child has exited, without reaping it: while it is an unreaped zombie its
    pid cannot be reused, so killing its process group cannot hit an unrelated group."""
    return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None


def spawn(command: list[str], user: tuple[int, int] | None, stdout: int, stderr: int) -> int:
    """Start `command` in a session of its own (as `user`, with no supplementary groups, when
    given), stdin from /dev/null; its pid. OSError when it cannot be executed, as
    subprocess.Popen would raise (which costs this program's start the `subprocess` import)."""
    # The PATH search is done here, as subprocess does it: the child, once it is the run's
    # user, may not be able to import anything (os.execvp imports `warnings`).
    if os.sep in command[0]:
        candidates = [command[0]]
    else:
        candidates = [os.path.join(d, command[0]) for d in os.get_exec_path()]
    errors_r, errors_w = os.pipe()  # close-on-exec: EOF here means the exec succeeded
    pid = os.fork()
    if pid == 0:  # the child: nothing but system calls until exec
        try:
            os.setsid()
            if user is not None:
                os.setgroups([])
                os.setgid(user[1])
                os.setuid(user[0])
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            os.dup2(stdout, 1)
            os.dup2(stderr, 2)
            # Nothing else of ours reaches the command: the run's lock (inherited from the
            # driver) must be held by this supervisor alone.
            os.closerange(3, errors_w)
            os.closerange(errors_w + 1, os.sysconf("SC_OPEN_MAX"))
            for signum in (signal.SIGPIPE, signal.SIGXFSZ):  # Python ignores them; undo
                signal.signal(signum, signal.SIG_DFL)
            # As subprocess: the first error other than "not there", else "not found".
            errno = 0
            for path in candidates:
                try:
                    os.execv(path, command)  # noqa: S606 - the customer's argv, no shell
                except (FileNotFoundError, NotADirectoryError):
                    pass
                except OSError as exc:
                    errno = errno or exc.errno or 0
            os.write(errors_w, str(errno or 2).encode())
        except OSError as exc:
            os.write(errors_w, str(exc.errno).encode())
        finally:
            os._exit(255)
    os.close(errors_w)
    failure = os.read(errors_r, 32)
    os.close(errors_r)
    if failure:
        os.waitpid(pid, 0)
        errno = int(failure)
        raise (FileNotFoundError if errno == 2 else OSError)(errno, os.strerror(errno), command[0])
    return pid


def killpg(pid: int, signum: int) -> None:
    try:  # noqa: SIM105 - contextlib is one import this program does without
        os.killpg(pid, signum)
    except ProcessLookupError:
        pass


def main(argv: list[str]) -> int:
    user: tuple[int, int] | None = None
    if len(argv) > 3 and argv[2] == "--user":
        uid, _, gid = argv[3].partition(":")
        user = (int(uid), int(gid))
        argv = [argv[0], argv[1], *argv[4:]]
    if len(argv) < 4 or argv[2] != "--":
        print(__doc__, file=sys.stderr)
        return 2
    run_dir, command = argv[1], argv[3:]
    stdout_log = open(os.path.join(run_dir, "stdout.log"), "ab", buffering=0)  # noqa: SIM115
    output_log = open(os.path.join(run_dir, "output.log"), "ab", buffering=0)  # noqa: SIM115
    exit_path = os.path.join(run_dir, "exit.json")

    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    try:
        pid = spawn(command, user, out_w, err_w)
    except OSError as exc:
        output_log.write(f"cannot start {command[0]!r}: {exc}\n".encode())
        # The shell's codes: 127 not found, 126 found but not executable.
        code = 127 if isinstance(exc, FileNotFoundError) else 126
        write_record(exit_path, {"exit_code": code, "finished_at": time.time()}, durable=True)
        return 0
    os.close(out_w)
    os.close(err_w)

    stat = proc_stat(pid)
    # Not fsynced: after a crash of the host the command is gone whatever this file says.
    write_record(
        os.path.join(run_dir, "child.json"),
        {"pid": pid, "start_ticks": stat[1] if stat else None, "started_at": time.time()},
        durable=False,
    )

    def forward(signum: int, _frame: object) -> None:
        killpg(pid, signum)

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, forward)

    selector = selectors.DefaultSelector()
    selector.register(out_r, selectors.EVENT_READ, data=True)
    selector.register(err_r, selectors.EVENT_READ, data=False)
    open_streams = 2
    exited_at: float | None = None
    while open_streams:
        for key, _ in selector.select(timeout=0.2):
            chunk = os.read(key.fd, 65536)
            if not chunk:
                selector.unregister(key.fileobj)
                open_streams -= 1
                continue
            if key.data:
                stdout_log.write(chunk)
            output_log.write(chunk)
        if exited_at is None and exited(pid):
            exited_at = time.time()
            killpg(pid, signal.SIGKILL)
        if exited_at is not None and time.time() - exited_at > DRAIN_AFTER_EXIT_S:
            break

    returncode = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    code = returncode if returncode >= 0 else 128 - returncode
    write_record(exit_path, {"exit_code": code, "finished_at": time.time()}, durable=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
