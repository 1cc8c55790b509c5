"""perf_analyzer (tritonclient 2.50 wheel) drives the ensemble in streaming mode with the committed input data."""

import csv

from maskedit import perf_analyzer


def test_perf_analyzer_streaming_run(server, tmp_path):
    report = tmp_path / "edit.csv"
    proc = perf_analyzer.run(server.grpc_url, report, concurrency="1:2", request_count=12)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = list(csv.DictReader(report.open()))
    assert rows and float(rows[0]["Inferences/Second"]) > 0
    assert "Detected decoupled model" in proc.stdout
