"""Which CPUs each process of a run gets: CPU lists ("0", "2-3", "0,2") and the plan that
`run.core_plan` applies (to the launched workers by default, to the trainer ranks too with
"auto").

On a CPU machine the inference workers and the trainer ranks compete for the same cores: left
to itself, a vLLM server binds its OpenMP threads to the first cores it sees (two workers
on one core, beside an idle one), and torch's threads spread over all of them. The plan gives
the launched workers and the ranks cores of their own where there are enough, and spreads
them round-robin where there are not; a launched worker's share is its server's CPU affinity
(`VllmConfig.engine_cpus`). A leaf module: it knows nothing of the processes.
"""

from __future__ import annotations

from dataclasses import dataclass


def parse_cpus(spec: str) -> list[int]:
    """"0", "2-3", "0,2-3" -> the CPU numbers, sorted; ValueError for anything else."""
    cpus: set[int] = set()
    for part in spec.split(","):
        first, dash, last = part.strip().partition("-")
        if not first.isdigit() or (dash and not last.isdigit()):
            raise ValueError(f"{spec!r} is not a CPU list (like \"0\", \"2-3\" or \"0,2-3\")")
        low, high = int(first), int(last) if dash else int(first)
        if high < low:
            raise ValueError(f"{spec!r}: the range {part.strip()} runs backwards")
        cpus.update(range(low, high + 1))
    return sorted(cpus)


def format_cpus(cpus: list[int]) -> str:
    """The shortest CPU list for `cpus`: [0, 1, 2, 5] -> "0-2,5"."""
    runs: list[list[int]] = []
    for cpu in sorted(cpus):
        if runs and cpu == runs[-1][-1] + 1:
            runs[-1].append(cpu)
        else:
            runs.append([cpu])
    return ",".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)


@dataclass(frozen=True)
class CorePlan:
    workers: list[str]  # per launched worker, its CPU list
    ranks: list[str]  # per trainer rank, its CPU list


def plan_cores(cpus: list[int], workers: int, ranks: int) -> CorePlan:
    """Split `cpus` between `workers` launched inference workers and `ranks` trainer ranks.

    With at least one CPU each, they get disjoint shares: the inference side about its part of
    the processes (at least one CPU per worker, leaving one per rank), each side cut into
    contiguous runs. With fewer, every process still gets one CPU, dealt round-robin (workers
    first), so no two workers share one while another CPU idles."""
    n = len(cpus)
    if workers + ranks <= n:
        inference = min(n - ranks, max(workers, round(n * workers / (workers + ranks)))) if workers else 0
        return CorePlan(_cut(cpus[:inference], workers), _cut(cpus[inference:], ranks))
    deal = [cpus[i % n] for i in range(workers + ranks)]
    return CorePlan([str(c) for c in deal[:workers]], [str(c) for c in deal[workers:]])


def _cut(cpus: list[int], parts: int) -> list[str]:
    """`cpus` in `parts` contiguous runs, as even as they go (the first runs one longer)."""
    size, extra = divmod(len(cpus), parts) if parts else (0, 0)
    out, start = [], 0
    for i in range(parts):
        end = start + size + (1 if i < extra else 0)
        out.append(format_cpus(cpus[start:end]))
        start = end
    return out
