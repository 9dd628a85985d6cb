"""hpcdl bench startup: real jobs of 1 and 3 ranks (mpiexec), started, checkpointed and restarted, and the counts
that must not grow with the number of ranks read back from its report."""

from __future__ import annotations

from conftest import hpcdl

from hpcdl.bench.reports import StartupReport


def test_bench_startup_counts_what_grows_with_the_ranks(mpiexec, tmp_path):
    out = tmp_path / "startup.json"
    done = hpcdl("bench", "startup", "--ranks", "1,3", "--store-clients", 64, "--store-seconds", 0.5, "--json", out,
                 timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = StartupReport.from_json(str(out))
    rows = {(r.ranks, r.leg): r for r in report.rows}
    assert set(rows) == {(1, "start"), (1, "restart"), (3, "start"), (3, "restart")}
    for n in (1, 3):
        start, restart = rows[n, "start"], rows[n, "restart"]
        # the checkpoint is read from the run folder once, by rank 0, whatever the number of ranks
        assert 0 < restart.checkpoint_bytes <= restart.run_folder_bytes <= 1.1 * restart.checkpoint_bytes
        assert start.run_folder_bytes == 0
        assert start.store_connections == 2 * n  # the rendezvous' and the heartbeat's, nothing else
        assert restart.store_requests_after_startup == 0  # after start-up only the heartbeat talks to rank 0
        assert start.files_per_rank["python"] > 300  # counted from the process's start: torch's own imports
        assert all(start.phases_s[p] > 0 for p in ("interpreter and imports", "model", "first step"))
    beats = [r.heartbeat_per_rank_per_s for r in report.rows if r.heartbeat_per_rank_per_s is not None]
    assert beats and all(0.3 < b < 0.55 for b in beats), beats  # one request every 2 s, a starved thread fewer
    assert report.fit("store connections per rank").slope == 0
    assert report.fit("restart run-folder bytes / checkpoint").slope < 0.01
    assert report.store.clients == 64 and report.store.requests_per_s > 100
    assert "rank 0's store:" in done.stdout and "rendezvous requests per rank:" in done.stdout
