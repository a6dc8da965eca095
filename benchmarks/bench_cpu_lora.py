"""vLLM's CPU LoRA ops against fleetrl's per-adapter products (engine/cpu_lora.py), side by side.

    .venv/bin/python benchmarks/bench_cpu_lora.py [--reps 5] [--tokens 32 512 2048] [--rank 16]
        [--threads 2]

Each figure is one call of an op in a LoRA-wrapped layer of the embedded model (hidden 576,
MLP 1536), at a batch of `--tokens` tokens that all name one adapter (a fleetrl run): the
shrink of the input to the rank (x A^T) and the expand of the rank to the layer's output
(B), as vLLM's CPU punica wrapper calls them. vLLM's op and fleetrl's run alternately `--reps`
times on the same tensors after one warm-up each; the ratio is their median times (vLLM's /
fleetrl's), and the largest difference between their outputs is printed beside it.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from vllm.lora.ops.torch_ops import lora_ops as vllm_ops

from bench_report import record
from fleetrl.engine.cpu_lora import _replacements

HIDDEN, MLP = 576, 1536
SLOTS = 2  # vLLM stacks max_loras + 1 slots


def timed(op, reps: int) -> list[float]:
    op()  # warm-up
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        op()
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--tokens", type=int, nargs="+", default=[32, 512, 2048])
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ours = _replacements({name: getattr(vllm_ops, name) for name in ("bgmv_shrink", "bgmv_expand")})
    print(f"{'op':<28} {'tokens':>6} {'vLLM ms':>9} {'fleetrl ms':>10} {'ratio':>7} {'max |diff|':>10}")
    for tokens in args.tokens:
        indices = torch.zeros(tokens, dtype=torch.long)
        cases = {
            f"shrink {HIDDEN} -> {args.rank}": ("bgmv_shrink", torch.randn(tokens, HIDDEN),
                                                 torch.randn(SLOTS, 1, args.rank, HIDDEN), (tokens, args.rank), 1.0),
            f"expand {args.rank} -> {MLP}": ("bgmv_expand", torch.randn(tokens, args.rank),
                                              torch.randn(SLOTS, 1, MLP, args.rank), (tokens, MLP), True),
        }
        for label, (name, inputs, weights, shape, last) in cases.items():
            theirs, mine = torch.zeros(shape), torch.zeros(shape)
            vllm_op, our_op = getattr(vllm_ops, name), ours[name]
            vllm_times, our_times = [], []
            for _ in range(args.reps):  # alternately: the machine's noise falls on both
                vllm_times += timed(lambda: vllm_op(inputs, weights, theirs.zero_(), indices, last), 1)
                our_times += timed(lambda: our_op(inputs, weights, mine.zero_(), indices, last), 1)
            ratio = statistics.median(vllm_times) / statistics.median(our_times)
            diff = (theirs - mine).abs().max().item()
            print(f"{label:<28} {tokens:>6} {statistics.median(vllm_times) * 1e3:>9.2f} "
                  f"{statistics.median(our_times) * 1e3:>10.3f} {ratio:>7.1f} {diff:>10.1e}")
            record(f"cpu lora {label} at {tokens} tokens, vLLM / fleetrl", ratio)


if __name__ == "__main__":
    main()
