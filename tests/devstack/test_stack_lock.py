"""`dev.py up` runs one stack per data folder: a second start while the first runs (or is still
stopping) says so and starts nothing."""

import subprocess
import sys
import textwrap

from devstack import stack


def test_a_second_stack_is_refused_naming_the_first_and_starts_nothing(
    tmp_path, monkeypatch, capsys
):
    # Given a stack holding the lock, in another process
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys, time
            from pathlib import Path
            from devstack import stack
            held = stack._stack_lock(Path({str(tmp_path / "dev" / "stack.lock")!r}))
            assert held is not None  # kept: closing the file would release the lock
            print("held", flush=True)
            time.sleep(60)
        """)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        monkeypatch.setattr(stack, "VAR", tmp_path)
        started = []
        monkeypatch.setattr(stack, "ensure_services", lambda *a, **k: started.append(a))
        # When a second one starts, then it names the first and starts nothing
        assert stack.cmd_up(port=8000) == 1
        assert f"pid {holder.pid}" in capsys.readouterr().err
        assert started == []
    finally:
        holder.kill()
        holder.wait()
    # Once the first has ended, however it ended, the lock is free again
    lock = stack._stack_lock(tmp_path / "dev" / "stack.lock")
    assert lock is not None
    lock.close()
