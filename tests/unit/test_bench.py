"""`fleetrl bench` runs the benchmark scripts as processes and gathers the ratios they record
(benchmarks/bench_report.py); here the scripts are small stand-ins, the real ones start fleets."""

import json
import re
import textwrap

from fleetrl.app import bench
from fleetrl.cli import main

REAL_BENCHMARKS = bench.BENCHMARKS_DIR


def write_script(directory, name, body):
    (directory / name).write_text(textwrap.dedent(f"""\
        import sys
        sys.path.insert(0, {str(REAL_BENCHMARKS)!r})
        from bench_report import record
        """) + textwrap.dedent(body))


def test_bench_runs_each_suite_prints_the_ratio_table_and_writes_the_json(tmp_path, monkeypatch, capfd):
    scripts = tmp_path / "benchmarks"
    scripts.mkdir()
    write_script(scripts, "bench_fleet.py", """
        print("measuring", sys.argv[1:])
        record("broadcast publish / bare gloo broadcast", 1.25, "2 workers")
        record("fence, 2 workers / 1 worker", 1.5)
        """)
    write_script(scripts, "bench_dynamo.py", """
        record("broadcast publish time, Dynamo / native", 1.1)
        sys.exit(3)
        """)
    write_script(scripts, "bench_rl.py", """
        if "--publish" in sys.argv:  # the publish suite: its flag, then --quick's
            assert sys.argv[1:] == ["--publish", "--steps", "4", "--max-tokens", "128"], sys.argv
            record("step time, rolling / fenced publishes (2 workers, k = 1)", 0.8)
        else:
            record("step time, k = 1 / k = 0", 0.9)
        """)
    write_script(scripts, "bench_trainer.py", 'record("trainer step, fleetrl / bare transformers (tokens/s)", 1.02)\n')
    write_script(scripts, "bench_cpu_lora.py", 'record("cpu lora expand at 2048 tokens, vLLM / fleetrl", 54.4)\n')
    write_script(scripts, "bench_engine_start.py", 'record("engine start, engine core forked / worker process", 0.5)\n')
    monkeypatch.setattr(bench, "BENCHMARKS_DIR", scripts)
    write_script(scripts, "bench_trl.py", 'raise SystemExit("never run: TRL is missing")\n')
    monkeypatch.setattr(bench, "installed", lambda module: False)  # TRL: the `bench` extra is not installed
    out = tmp_path / "bench.json"

    assert main(["bench", "--suite", "all", "--quick", "--out", str(out)]) == 1  # dynamo failed
    printed = capfd.readouterr().out
    assert "measuring ['--reps', '1', '--max-tokens', '16']" in printed  # --quick reaches the script
    assert "[2/8] dynamo: FAILED" in printed
    assert "[8/8] trl: skipped: it needs trl (pip install -e '.[bench]')" in printed
    table = printed[printed.index("suite  "):]
    assert re.search(r"\nfleet +broadcast publish / bare gloo broadcast +1\.25 +2 workers\n", table)
    assert re.search(r"\ndynamo +\(failed\)", table) and re.search(r"\nrl +step time, k = 1 / k = 0 +0\.90", table)
    assert re.search(r"\npublish +step time, rolling / fenced publishes \(2 workers, k = 1\) +0\.80", table)
    assert re.search(r"\ntrl +\(skipped\) +- +needs trl", table)
    report = json.loads(out.read_text())
    assert report["quick"] is True and list(report["suites"]) == ["fleet", "dynamo", "rl", "publish", "trainer", "cpu-lora",
                                                         "engine-start", "trl"]
    assert report["suites"]["trl"] == {"skipped": "needs trl (pip install -e '.[bench]')", "figures": []}
    assert report["suites"]["fleet"]["figures"][1] == {"figure": "fence, 2 workers / 1 worker", "ratio": 1.5,
                                                        "detail": ""}
    assert report["suites"]["dynamo"]["returncode"] == 3
    assert report["suites"]["fleet"]["command"] == ["python", "benchmarks/bench_fleet.py", "--reps", "1",
                                                    "--max-tokens", "16"]
    assert report["suites"]["publish"]["command"] == ["python", "benchmarks/bench_rl.py", "--publish", "--steps", "4",
                                                      "--max-tokens", "128"]

    assert main(["bench", "--suite", "rl", "--out", str(out)]) == 0
    assert list(json.loads(out.read_text())["suites"]) == ["rl"]


def test_bench_outside_a_checkout_says_where_it_looked(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench, "BENCHMARKS_DIR", tmp_path / "nowhere")
    assert main(["bench", "--suite", "fleet"]) == 1
    assert capsys.readouterr().err.strip() == (
        f"fleetrl: error: fleetrl bench runs the scripts of a source checkout's benchmarks/; "
        f"bench_fleet.py not found in {tmp_path / 'nowhere'}")
