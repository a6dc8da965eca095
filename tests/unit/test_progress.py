"""Progress of long waits: plain lines off a terminal, a rich bar on one (alone, or in the live view)."""

import io

from fleetrl import progress


def test_off_a_terminal_a_wait_reports_a_line_every_report_s(monkeypatch):
    lines = []
    clock = iter([0.0, 5.0, 16.0, 32.0])  # the start, then each update
    monkeypatch.setattr(progress.time, "monotonic", lambda: next(clock))
    progress.set_interactive(False)
    try:
        with progress.progress_bar("2 vLLM worker(s)", 2, log=lines.append) as bar:
            for detail in ("vllm-0 not healthy", "vllm-0 not healthy", "vllm-1 not healthy"):
                bar.update(1, detail)
    finally:
        progress.set_interactive(None)
    assert lines == ["fleetrl: waiting for 2 vLLM worker(s): vllm-0 not healthy (16 s)",
                     "fleetrl: waiting for 2 vLLM worker(s): vllm-1 not healthy (32 s)"]


def test_on_a_terminal_a_wait_is_a_bar_in_the_shared_progress_and_leaves_it_when_done():
    from rich.console import Console
    from rich.progress import Progress

    shared = Progress(*progress.columns(), console=Console(file=io.StringIO(), force_terminal=True, width=120))
    lines = []
    progress.set_interactive(True)
    progress.share_with(shared)
    try:
        with progress.progress_bar("2 vLLM worker(s)", 2, log=lines.append, label="starting 2 vLLM worker(s)") as bar:
            bar.update(1, "vllm-1 not healthy")
            (task,) = shared.tasks
            assert (task.description, task.completed, task.total, task.fields["detail"]) == (
                "starting 2 vLLM worker(s)", 1, 2, "vllm-1 not healthy")
        assert shared.tasks == [] and lines == []  # the bar went; no plain line instead
    finally:
        progress.share_with(None)
        progress.set_interactive(None)
