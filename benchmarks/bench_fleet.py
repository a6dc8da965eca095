"""Native fleet benchmarks, measured side by side in one run and reported as ratios.

    .venv/bin/python benchmarks/bench_fleet.py [--reps 3] [--workers 2]

1. publish: one policy version to every worker by the broadcast transport, against a bare
   torch.distributed broadcast of the same bytes, in the same buckets, to the same number of
   receiver processes (the transport floor), and against the filesystem transport;
2. data plane: completion tokens/s at 16 and 64 concurrent requests through fleetrl, against
   a plain OpenAI client sending the same requests straight to the same vLLM servers;
3. fence overhead: pause + version check + resume with no transfer, for 1 and for all workers;
4. the agreement probe: a broadcast publish with the production probe (every worker scores it
   before it serves) against the same publish without, and the trainer's side of it (one
   forward of the probe);
5. LoRA (`--sections lora`, on workers of its own started with the adapter): a publish of a
   rank-16 adapter against a publish of the whole model to the same workers, and against a
   bare broadcast of the adapter's bytes. Run it with --workers 1 and --workers 2.

    .venv/bin/python benchmarks/bench_fleet.py --sections probe   # one section alone

Results go to docs/benchmarks.md with the command line that produced them.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import secrets
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from bench_report import record

from fleetrl.app.rl import apply_core_plan
from fleetrl.config import Config, InferenceConfig, ModelConfig, VllmConfig
from fleetrl.contract import WEIGHT_UPDATE_PHASES, WEIGHT_UPDATE_SERIAL_PHASES
from fleetrl.inference.fleet import AgreementProbe, Fleet
from fleetrl.inference.http import SERVED_MODEL_NAME
from fleetrl.inference.provider import WeightTransport
from fleetrl.inference.types import GenerateRequest, SamplingParams
from fleetrl.inference.vllm.provider import VllmProvider
from fleetrl.model import resolve_model
from fleetrl.trainer.model import agreement_probe, prompt_logprobs
from fleetrl.versions import new_run_id
from fleetrl.weights.broadcast import group as bgroup
from fleetrl.weights.factory import make_transport

BUCKET_BYTES = 64 << 20


def median_time(samples: list[float]) -> str:
    return f"{statistics.median(samples):.3f} s (n={len(samples)}, min {min(samples):.3f})"


# -- the transport floor: a bare broadcast of the same bytes to plain receiver processes ----

def _floor_receiver(host: str, port: int, rank: int, world: int, sizes: list[int], reps: int) -> None:
    store = bgroup.connect_store(host, port, world, 120)
    for rep in range(reps):
        g = bgroup.join(store, f"floor-{rep}", rank, world, "gloo", 120)
        for size in sizes:
            g.broadcast(torch.empty(size, dtype=torch.uint8))
        g.close()


def floor_broadcast(total_bytes: int, receivers: int, reps: int) -> list[float]:
    sizes = [BUCKET_BYTES] * (total_bytes // BUCKET_BYTES) + ([total_bytes % BUCKET_BYTES] if total_bytes % BUCKET_BYTES else [])
    world = receivers + 1
    store = bgroup.open_store("127.0.0.1", world, 120)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_floor_receiver, args=("127.0.0.1", store.port, r, world, sizes, reps))
             for r in range(1, world)]
    for p in procs:
        p.start()
    buffers = [torch.randint(0, 255, (size,), dtype=torch.uint8) for size in sizes]
    times = []
    for rep in range(reps):
        g = bgroup.join(store, f"floor-{rep}", 0, world, "gloo", 120)
        started = time.perf_counter()
        for buf in buffers:
            g.broadcast(buf)
        times.append(time.perf_counter() - started)
        g.close()
    for p in procs:
        p.join(60)
    return times


# -- publish ---------------------------------------------------------------------------------

async def interleaved_publishes(cases: dict[str, tuple[Fleet, WeightTransport, AgreementProbe | None]],
                                model: torch.nn.Module, reps: int,
                                phases: dict[str, list[dict[str, float]]] | None = None) -> dict[str, list[float]]:
    """Seconds per publish of `model`'s weights for each (fleet, transport, probe) case, the
    cases interleaved so drift in machine load hits all alike. Closes the transports. With
    `phases`, each publish's receiver profile (`receiver_phases`) is added to its case's list."""
    def weights():
        return ((n, p.detach()) for n, p in model.named_parameters())

    results: dict[str, list[float]] = {name: [] for name in cases}
    try:
        for _ in range(reps):
            for name, (fleet, transport, probe) in cases.items():
                report = await fleet.publish(fleet.version + 1, transport, weights, probe)
                assert not report.failed, report.failed
                results[name].append(report.seconds)
                if phases is not None:
                    phases.setdefault(name, []).append(await receiver_phases(fleet))
    finally:
        for transport in {id(t): t for _, t, _ in cases.values()}.values():
            await transport.close()
    return results


async def receiver_phases(fleet: Fleet) -> dict[str, float]:
    """Where the workers' ranks spent the last update (contract.WEIGHT_UPDATE_PHASES), in
    seconds: the slowest rank's figure per phase, as the publish waits for the slowest."""
    ranks = [rank for w in fleet.ready_workers() for rank in await fleet.provider.admin(w).weight_state()]
    return {phase: max(rank.phases.get(phase, 0.0) for rank in ranks) for phase in WEIGHT_UPDATE_PHASES}


def print_profile(label: str, seconds: list[float], phases: list[dict[str, float]]) -> None:
    """One publish's median total and, beside it, where the workers' receivers spent it; the
    rest is the sender's own (packing, HTTP round trips, the fence, the checksum check). Hash
    and load run beside the receive (contract.WEIGHT_UPDATE_PHASES): only the rank's own
    thread's phases are taken from the total."""
    total = statistics.median(seconds)
    parts = {phase: statistics.median(p[phase] for p in phases) for phase in WEIGHT_UPDATE_PHASES}
    rest = total - sum(parts[phase] for phase in WEIGHT_UPDATE_SERIAL_PHASES)
    print(f"  {label}: {total:.2f} s = " + ", ".join(f"{phase} {v:.2f}" for phase, v in parts.items())
          + f", sender and fence {rest:.2f}")


async def bench_publish(fleet: Fleet, model: torch.nn.Module, reps: int, storage: Path,
                        phases: dict[str, list[dict[str, float]]]) -> dict[str, list[float]]:
    return await interleaved_publishes(
        {kind: (fleet, make_transport(kind, host="127.0.0.1", bucket_bytes=BUCKET_BYTES, storage_dir=storage / kind), None)
         for kind in ("broadcast", "filesystem")}, model, reps, phases)


async def bench_probe(fleet: Fleet, model: torch.nn.Module, reps: int) -> None:
    """The production agreement probe's cost per publish, and the trainer's forward for it."""
    ids = agreement_probe(model)
    forward = []
    for _ in range(reps * 3):
        started = time.perf_counter()
        reference = prompt_logprobs(model, ids, torch.device("cpu"))
        forward.append(time.perf_counter() - started)
    transport = make_transport("broadcast", host="127.0.0.1", bucket_bytes=BUCKET_BYTES, storage_dir=None)
    publish = await interleaved_publishes(
        {"plain": (fleet, transport, None), "probed": (fleet, transport, AgreementProbe(ids, reference))}, model, reps)
    plain, probed = statistics.median(publish["plain"]), statistics.median(publish["probed"])
    print(f"\npublish by broadcast, no probe:         {median_time(publish['plain'])}")
    print(f"publish by broadcast, agreement probe:  {median_time(publish['probed'])}")
    print(f"  probe cost per publish: {probed - plain:+.3f} s, ratio probed / plain {probed / plain:.2f}")
    print(f"trainer forward of the {len(ids)}-token probe: {median_time(forward)}")
    record("publish with the agreement probe / without", probed / plain,
           f"{probed - plain:+.3f} s per publish, {len(fleet.workers)} workers")


async def bench_lora(model_dir: Path, model: torch.nn.Module, args, tmp: Path) -> None:
    """An adapter publish against a whole-model publish to the same LoRA workers (each update
    kind through a transport of its own target), in alternate blocks; and against the floor, a
    bare broadcast of the adapter's bytes."""
    from fleetrl.config import LoraConfig
    from fleetrl.trainer.lora import adapter_config, add_adapter, adapter_params

    lora = LoraConfig(rank=16, alpha=32)
    adapted = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    add_adapter(adapted, adapter_config(lora, model_dir))
    with torch.no_grad():  # a trained adapter's B is not zero: publish one that changes the model
        for name, param in adapted.named_parameters():
            if ".lora_B." in name:
                param.normal_(0, 1e-3)
    adapter = [(name, param.detach()) for name, param in adapter_params(adapted)]
    adapter_bytes = sum(t.numel() * t.element_size() for _, t in adapter)
    config = InferenceConfig(workers=args.workers, vllm=VllmConfig(max_model_len=512))
    provider = VllmProvider(config, model_dir, tmp / "lora-logs", secrets.token_urlsafe(16), secrets.token_urlsafe(16),
                            new_run_id(), adapter=lora.spec)
    fleet = Fleet(provider, discovery_interval_s=3600)
    await fleet.start()
    try:
        cases = {"adapter": (lambda: iter(adapter), "adapter"),
                 "model": (lambda: ((n, p.detach()) for n, p in model.named_parameters()), "model")}
        transports = {name: make_transport("broadcast", host="127.0.0.1", bucket_bytes=BUCKET_BYTES, storage_dir=None,
                                           target=target) for name, (_, target) in cases.items()}
        seconds: dict[str, list[float]] = {name: [] for name in cases}
        moved: dict[str, int] = {}
        try:
            # In blocks, alternately: a worker is in one broadcast group at a time, so the first
            # publish of a block forms its transport's group (a run keeps one), and is not counted.
            for _ in range(2):
                for name, (weights, _) in cases.items():
                    for rep in range(args.reps + 1):
                        report = await fleet.publish(fleet.version + 1, transports[name], weights)
                        assert not report.failed, report.failed
                        if rep:
                            seconds[name].append(report.seconds)
                        moved[name] = max(report.received_bytes.values())
        finally:
            for transport in transports.values():
                await transport.close()
    finally:
        await fleet.close()
    floor = await asyncio.to_thread(floor_broadcast, adapter_bytes, args.workers, args.reps)
    a, m, fl = (statistics.median(x) for x in (seconds["adapter"], seconds["model"], floor))
    print(f"\nLoRA workers ({args.workers}), rank 16 on every linear layer: the adapter is "
          f"{moved['adapter'] / 2**20:.1f} MiB received per worker, the model {moved['model'] / 2**20:.0f} MiB")
    print(f"publish of the adapter:     {median_time(seconds['adapter'])}")
    print(f"publish of the whole model: {median_time(seconds['model'])}")
    print(f"bare gloo broadcast of the adapter's bytes to {args.workers} receivers: {median_time(floor)}")
    print(f"  ratio adapter publish / whole-model publish: {a / m:.3f}")
    print(f"  ratio adapter publish / bare broadcast of its bytes: {a / fl:.2f}")
    record(f"LoRA adapter publish / whole-model publish, {args.workers} workers", a / m, f"{a:.2f} s vs {m:.2f} s")
    record(f"LoRA adapter publish / bare gloo broadcast of its bytes, {args.workers} workers", a / fl,
           f"{a:.2f} s vs {fl:.3f} s, {adapter_bytes / 2**20:.1f} MiB")


# -- data plane ------------------------------------------------------------------------------

async def tokens_per_s_fleet(fleet: Fleet, prompts: list[list[int]], concurrency: int, max_tokens: int) -> float:
    sampling = SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True)
    sem = asyncio.Semaphore(concurrency)

    async def one(prompt):
        async with sem:
            (out,) = await fleet.generate(GenerateRequest(prompt, sampling))
            return len(out.token_ids)

    started = time.perf_counter()
    tokens = sum(await asyncio.gather(*(one(p) for p in prompts)))
    return tokens / (time.perf_counter() - started)


async def tokens_per_s_openai(urls: list[str], token: str, prompts: list[list[int]], concurrency: int,
                              max_tokens: int) -> float:
    from openai import AsyncOpenAI

    clients = [AsyncOpenAI(base_url=f"{u}/v1", api_key=token, max_retries=0) for u in urls]
    sem = asyncio.Semaphore(concurrency)

    async def one(i, prompt):
        async with sem:
            out = await clients[i % len(clients)].completions.create(
                model=SERVED_MODEL_NAME, prompt=prompt, max_tokens=max_tokens, temperature=1.0,
                logprobs=0, extra_body={"ignore_eos": True, "return_token_ids": True})
            return out.usage.completion_tokens

    started = time.perf_counter()
    tokens = sum(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))
    elapsed = time.perf_counter() - started
    for c in clients:
        await c.close()
    return tokens / elapsed


# -- fence -----------------------------------------------------------------------------------

async def fence_once(fleet: Fleet, n: int) -> float:
    admins = [fleet.provider.admin(w) for w in fleet.ready_workers()[:n]]
    started = time.perf_counter()
    await asyncio.gather(*(a.pause("keep") for a in admins))
    versions = await asyncio.gather(*(a.version() for a in admins))
    assert set(versions) == {fleet.version}
    await asyncio.gather(*(a.resume() for a in admins))
    return time.perf_counter() - started


async def bench_fence_and_publish(fleet: Fleet, model: torch.nn.Module, total_bytes: int, args, storage: Path) -> None:
    fence = {n: [await fence_once(fleet, n) for _ in range(args.reps * 3)] for n in (1, args.workers)}
    print(f"fence, 1 worker:  {median_time(fence[1])}")
    print(f"fence, {args.workers} workers: {median_time(fence[args.workers])}")
    fence_ratio = statistics.median(fence[args.workers]) / statistics.median(fence[1])
    print(f"  ratio {args.workers} workers / 1 worker: {fence_ratio:.2f}")
    record(f"fence (no transfer), {args.workers} workers / 1 worker", fence_ratio)

    phases: dict[str, list[dict[str, float]]] = {}
    publish = await bench_publish(fleet, model, args.reps, storage, phases)
    floor = await asyncio.to_thread(floor_broadcast, total_bytes, args.workers, args.reps)
    b, f, fl = (statistics.median(x) for x in (publish["broadcast"], publish["filesystem"], floor))
    print(f"\npublish by broadcast:  {median_time(publish['broadcast'])}")
    print(f"publish by filesystem: {median_time(publish['filesystem'])}")
    print(f"bare gloo broadcast of the same bytes to {args.workers} receivers: {median_time(floor)}")
    print(f"  ratio broadcast publish / bare broadcast: {b / fl:.2f}")
    print(f"  ratio filesystem publish / broadcast publish: {f / b:.2f}")
    print("where a publish goes (median seconds; receiver phases of the slowest rank):")
    for kind in ("broadcast", "filesystem"):
        print_profile(kind, publish[kind], phases[kind])
    record("broadcast publish / bare gloo broadcast", b / fl, f"{args.workers} workers, {b:.2f} s vs {fl:.2f} s")
    record("filesystem publish / broadcast publish", f / b, f"{args.workers} workers")


async def bench_data_plane(fleet: Fleet, tokenizer, token: str, args) -> None:
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Tell me a story."}],
                                           add_generation_prompt=True, tokenize=True, return_dict=False)
    urls = [w.data_url for w in fleet.ready_workers()]
    print()
    for concurrency in (16, 64):
        prompts = [prompt] * (concurrency * 2)
        ours, theirs = [], []
        for _ in range(args.reps):  # alternate the two clients
            ours.append(await tokens_per_s_fleet(fleet, prompts, concurrency, args.max_tokens))
            theirs.append(await tokens_per_s_openai(urls, token, prompts, concurrency, args.max_tokens))
        o, t = statistics.median(ours), statistics.median(theirs)
        print(f"data plane at {concurrency} concurrent: fleetrl {o:.0f} tok/s, plain OpenAI client {t:.0f} tok/s, "
              f"ratio fleetrl / plain {o / t:.2f}")
        record(f"data plane tokens/s, fleetrl / plain client, {concurrency} concurrent", o / t,
               f"{o:.0f} vs {t:.0f} tok/s")


async def main(args) -> None:
    model_dir = resolve_model(ModelConfig())
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with tempfile.TemporaryDirectory() as tmp:
        if {"probe", "fence", "data"} & set(args.sections.split(",")):
            await bench_full_model_fleet(model_dir, tokenizer, model, args, Path(tmp))
        if "lora" in args.sections:
            await bench_lora(model_dir, model, args, Path(tmp))


async def bench_full_model_fleet(model_dir: Path, tokenizer, model: torch.nn.Module, args, tmp: Path) -> None:
    """Sections probe, fence and data, on one fleet of workers serving the whole model."""
    total_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    token = secrets.token_urlsafe(16)
    # --core-plan workers: the CPUs `fleetrl rl`'s default plan gives its workers (beside one
    # trainer rank); off: vLLM's own choice (every worker on the first CPUs).
    run_config = Config(inference=InferenceConfig(workers=args.workers, vllm=VllmConfig(max_model_len=512)))
    if args.core_plan == "workers":
        apply_core_plan(run_config, log=lambda line: None)
    config = run_config.inference
    bind = config.vllm.omp_threads_bind
    provider = VllmProvider(config, model_dir, tmp / "logs", token, secrets.token_urlsafe(16), new_run_id())
    fleet = Fleet(provider, discovery_interval_s=3600)
    await fleet.start()
    try:
        print(f"\n# fleetrl native benchmarks: {args.workers} vLLM CPU workers, SmolLM2-135M fp32 "
              f"({total_bytes / 2**20:.0f} MiB of weights), {args.reps} reps, core plan {args.core_plan}"
              + (f" (workers on CPUs {', '.join(bind)})" if bind else "") + "\n")

        if "probe" in args.sections:
            await bench_probe(fleet, model, args.reps)
        if "fence" in args.sections:
            await bench_fence_and_publish(fleet, model, total_bytes, args, tmp)
        if "data" in args.sections:
            await bench_data_plane(fleet, tokenizer, token, args)
    finally:
        await fleet.close()

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--core-plan", choices=["off", "workers"], default="off",
                        help="workers: each worker bound to CPUs of its own (inference.vllm.omp_threads_bind from "
                        "run.core_plan's plan); off: vLLM's own binding")
    parser.add_argument("--sections", default="probe,fence,data", help="comma-separated: probe (the agreement "
                        "probe), fence (fence and publish), data (the data plane), lora (adapter publishes, on "
                        "workers of their own); the default runs the first three")
    asyncio.run(main(parser.parse_args()))
