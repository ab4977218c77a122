"""The usage spool and run ledger: durable, ordered, crash-safe, seqs never reused."""

from __future__ import annotations

import json
import os
import stat

from nodeagent.spool import RunLedger, RunRecord, UsageSpool


def report(run_id: str = "run-1", confirmed_at: float = 110.0, final: bool = False) -> dict:
    return {
        "rental_id": "rental-1",
        "run_id": run_id,
        "gpu_count": 2,
        "started_at": 100.0,
        "confirmed_at": confirmed_at,
        "final": final,
    }


def test_append_assigns_consecutive_seqs_and_replays_oldest_first(tmp_path):
    spool = UsageSpool(str(tmp_path))
    first = spool.append([report(confirmed_at=101.0), report("run-2", 102.0)])
    second = spool.append([report(confirmed_at=103.0)])
    assert [r["seq"] for r in first + second] == [1, 2, 3]
    assert spool.pending(10) == [
        {"seq": 1, **report(confirmed_at=101.0)},
        {"seq": 2, **report("run-2", 102.0)},
        {"seq": 3, **report(confirmed_at=103.0)},
    ]
    # the cap takes the oldest
    assert [r["seq"] for r in spool.pending(2)] == [1, 2]


def test_appending_nothing_uses_no_seq(tmp_path):
    spool = UsageSpool(str(tmp_path))
    assert spool.append([]) == []
    assert spool.last_seq == 0


def test_ack_drops_acknowledged_reports_durably(tmp_path):
    spool = UsageSpool(str(tmp_path))
    spool.append([report(confirmed_at=float(t)) for t in range(101, 106)])
    # when the server acknowledges up to seq 3
    assert spool.ack(3) == 3
    # then 4 and 5 remain, also for a new instance reading the files
    assert [r["seq"] for r in spool.pending(10)] == [4, 5]
    assert [r["seq"] for r in UsageSpool(str(tmp_path)).pending(10)] == [4, 5]
    # and an ack that acknowledges nothing new changes nothing
    assert spool.ack(2) == 0
    assert len(spool) == 2


def test_seq_survives_restarts_even_with_an_empty_spool(tmp_path):
    spool = UsageSpool(str(tmp_path))
    spool.append([report(), report(), report()])
    spool.ack(3)
    assert len(spool) == 0
    # when the agent restarts
    again = UsageSpool(str(tmp_path))
    # then seqs continue after the last one handed out, never restarting at 1
    assert again.last_seq == 3
    assert again.append([report()])[0]["seq"] == 4


def test_seq_continues_after_the_spool_when_the_seq_file_is_lost(tmp_path):
    spool = UsageSpool(str(tmp_path))
    spool.append([report(), report()])
    os.remove(tmp_path / "last_seq")
    assert UsageSpool(str(tmp_path)).append([report()])[0]["seq"] == 3


def test_an_ack_beyond_our_seq_moves_the_counter_forward(tmp_path):
    # given a state dir restored from an old backup: the server has seen seq 50 already
    spool = UsageSpool(str(tmp_path))
    spool.append([report()])
    spool.ack(50)
    # then new reports are numbered after it (the server would ignore them as replays)
    assert spool.append([report()])[0]["seq"] == 51
    assert UsageSpool(str(tmp_path)).last_seq == 51


def test_a_torn_last_line_is_ignored_and_cleaned_up(tmp_path):
    spool = UsageSpool(str(tmp_path))
    spool.append([report(confirmed_at=101.0), report(confirmed_at=102.0)])
    # given a crash in the middle of appending seq 3
    with open(tmp_path / "usage.jsonl", "a") as f:
        f.write('{"seq": 3, "rental_id": "rental-1", "run_')
    # when the agent restarts
    again = UsageSpool(str(tmp_path))
    # then the complete reports replay, the torn one is gone
    assert [r["seq"] for r in again.pending(10)] == [1, 2]
    # and the next append starts on a clean line, after the seq reserved before the crash
    again.append([report(confirmed_at=104.0)])
    lines = (tmp_path / "usage.jsonl").read_text().splitlines()
    assert [json.loads(line)["seq"] for line in lines] == [1, 2, 3]


def test_a_torn_line_after_a_reserved_seq_does_not_reuse_it(tmp_path):
    spool = UsageSpool(str(tmp_path))
    spool.append([report()])
    # given the seq was reserved (persisted) but its line torn by a crash
    (tmp_path / "last_seq").write_text("2\n")
    with open(tmp_path / "usage.jsonl", "a") as f:
        f.write('{"seq": 2, "ren')
    again = UsageSpool(str(tmp_path))
    assert [r["seq"] for r in again.pending(10)] == [1]
    assert again.append([report()])[0]["seq"] == 3


def test_an_unreadable_line_in_the_middle_is_skipped(tmp_path):
    (tmp_path / "usage.jsonl").write_text(
        json.dumps({"seq": 1, **report()})
        + "\n"
        + "garbage\n"
        + json.dumps({"seq": 2, **report()})
        + "\n"
    )
    spool = UsageSpool(str(tmp_path))
    assert [r["seq"] for r in spool.pending(10)] == [1, 2]
    assert spool.last_seq == 2


def test_spool_files_are_private(tmp_path):
    spool = UsageSpool(str(tmp_path / "spool"))
    spool.append([report()])
    spool.ack(1)
    for name in ("usage.jsonl", "last_seq"):
        assert stat.S_IMODE(os.stat(tmp_path / "spool" / name).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(tmp_path / "spool").st_mode) == 0o700


def test_run_ledger_persists_on_flush_only(tmp_path):
    ledger = RunLedger(str(tmp_path))
    ledger.put("run-1", RunRecord(rental_id="rental-1", gpu_indices=(0, 1), stop_grace_s=30.0))
    assert RunLedger(str(tmp_path)).get("run-1") is None
    ledger.flush()
    ledger.update("run-1", cursor="120", skip=3, final_spooled=True)
    ledger.flush()
    assert RunLedger(str(tmp_path)).get("run-1") == RunRecord(
        rental_id="rental-1",
        gpu_indices=(0, 1),
        stop_grace_s=30.0,
        cursor="120",
        skip=3,
        final_spooled=True,
    )
    ledger.remove("run-1")
    ledger.flush()
    assert list(RunLedger(str(tmp_path))) == []


def test_damaged_run_ledger_starts_afresh(tmp_path):
    (tmp_path / "runs.json").write_text("{not json")
    assert list(RunLedger(str(tmp_path))) == []
