"""Supervisor of one run of the local process driver; a standalone program (stdlib only).

    python -I _process_wrapper.py RUN_DIR [--user UID:GID] -- COMMAND [ARGS...]

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
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import subprocess
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
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def exited(pid: int) -> bool:
    """True once the child has exited, without reaping it: while it is an unreaped zombie its
    pid cannot be reused, so killing its process group cannot hit an unrelated group."""
    return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None


def main(argv: list[str]) -> int:
    user: dict[str, object] = {}
    if len(argv) > 3 and argv[2] == "--user":
        uid, _, gid = argv[3].partition(":")
        user = {"user": int(uid), "group": int(gid), "extra_groups": []}
        argv = [argv[0], argv[1], *argv[4:]]
    if len(argv) < 4 or argv[2] != "--":
        print(__doc__, file=sys.stderr)
        return 2
    run_dir, command = argv[1], argv[3:]
    stdout_log = open(os.path.join(run_dir, "stdout.log"), "ab", buffering=0)  # noqa: SIM115
    output_log = open(os.path.join(run_dir, "output.log"), "ab", buffering=0)  # noqa: SIM115
    exit_path = os.path.join(run_dir, "exit.json")

    try:
        child = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            **user,
        )
    except OSError as exc:
        output_log.write(f"cannot start {command[0]!r}: {exc}\n".encode())
        # The shell's codes: 127 not found, 126 found but not executable.
        code = 127 if isinstance(exc, FileNotFoundError) else 126
        write_json_atomic(exit_path, {"exit_code": code, "finished_at": time.time()})
        return 0

    stat = proc_stat(child.pid)
    write_json_atomic(
        os.path.join(run_dir, "child.json"),
        {"pid": child.pid, "start_ticks": stat[1] if stat else None, "started_at": time.time()},
    )

    def forward(signum: int, _frame: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signum)

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, forward)

    selector = selectors.DefaultSelector()
    selector.register(child.stdout, selectors.EVENT_READ, data=True)
    selector.register(child.stderr, selectors.EVENT_READ, data=False)
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
        if exited_at is None and exited(child.pid):
            exited_at = time.time()
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)
        if exited_at is not None and time.time() - exited_at > DRAIN_AFTER_EXIT_S:
            break

    returncode = child.wait()
    code = returncode if returncode >= 0 else 128 - returncode
    write_json_atomic(exit_path, {"exit_code": code, "finished_at": time.time()})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
