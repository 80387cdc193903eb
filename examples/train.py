"""torchrun --nproc-per-node 2 examples/train.py

The main job: a Llama-style byte-level language model trained with ``fully_shard`` on real text
(by default the Python standard library's own sources: nothing to download; examples/textdata.py),
the way people run training: a progress display, validation loss and bits per byte every
``--eval-every`` steps, sharded checkpoints (``torch.distributed.checkpoint``) every
``--ckpt-every`` steps and on exit (Ctrl-C, SIGTERM from the launcher), ``--resume`` continuing
bit for bit, and at the end a summary table, a loss-curve PNG and a few generated samples, all in
``--out`` (default ``runs/main``).

CPU/gloo by default (the ``cpu`` preset finishes in a few minutes on 2 cores); on GPUs the same
command uses NCCL, bf16 compute and the ``gpu`` preset. ``--mesh hsdp --replicas R`` shards within
groups of ``world / R`` ranks and replicates across the ``R`` groups (one per node: docs/multinode.md).
``--ft``: this torchrun is one replica group of a fault-tolerant job (torchft; the others keep
training while a group is lost and replaced: docs/fault_tolerance.md, examples/ftmode.py).

    torchrun --nproc-per-node 2 examples/train.py                       # train (runs/main)
    torchrun --nproc-per-node 2 examples/train.py --resume              # continue from runs/main/ckpt
    torchrun --nproc-per-node 2 examples/train.py --data my_texts/ --steps 2000

Options (``--help`` for all): --steps --batch (global sequences) --seq-len --dim --layers --heads
--lr --eval-every --eval-batches --ckpt-every --out --ckpt --resume --data --max-bytes --preset
{auto,cpu,gpu} --device {auto,cpu,cuda} --bf16 --mesh {fsdp,hsdp} --replicas --log-every --samples
--deterministic --ft --compile; fault drills: --kill-at-step --kill-in-save --kill-rank --min-step-seconds
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import checkpointing  # noqa: E402
import faults  # noqa: E402
import ftmode  # noqa: E402
import textdata  # noqa: E402
from llama_model import Llama, LlamaConfig, loss_fn  # noqa: E402
from teardown import shutdown  # noqa: E402

from fully_shard import MixedPrecisionPolicy, fully_shard  # noqa: E402

PRESETS = {  # the defaults of each preset; an option given on the command line wins
    "cpu": dict(steps=600, batch=16, seq_len=128, dim=128, layers=4, heads=4, lr=3e-3, eval_every=100, ckpt_every=200),
    "gpu": dict(steps=1000, batch=64, seq_len=512, dim=768, layers=12, heads=12, lr=1e-3, eval_every=100,
                ckpt_every=500),
}
PROMPTS = ["def ", "import ", "class Parser"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="examples/train.py", description=__doc__.splitlines()[2])
    p.add_argument("--preset", choices=["auto", "cpu", "gpu"], default="auto",
                   help="defaults for the sizes below: cpu (a few minutes on 2 cores), gpu; auto: by device")
    for name in ("steps", "batch", "seq_len", "dim", "layers", "heads", "eval_every", "ckpt_every"):
        p.add_argument("--" + name.replace("_", "-"), type=int, default=None)
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--eval-batches", type=int, default=8, help="validation batches per evaluation")
    p.add_argument("--data", default=None, help="a text file or a directory of them (default: the stdlib's sources)")
    p.add_argument("--max-bytes", type=int, default=None, help="read only the first files, up to this many bytes")
    p.add_argument("--out", default="runs/main", help="where the curve, summary, samples and checkpoints go")
    p.add_argument("--ckpt", default=None, help="checkpoint directory (default: OUT/ckpt)")
    p.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--bf16", action="store_true", help="bf16 compute, fp32 master weights and reduction (GPU default)")
    p.add_argument("--mesh", choices=["fsdp", "hsdp"], default="fsdp")
    p.add_argument("--replicas", type=int, default=2, help="--mesh hsdp: replica groups (e.g. the node count)")
    p.add_argument("--log-every", type=int, default=20, help="plain progress lines (when stdout is not a terminal)")
    p.add_argument("--samples", type=int, default=200, help="bytes generated per prompt at the end (0: none)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop-after", type=int, default=None,
                   help="stop (with a checkpoint) after this many steps of this run, as if interrupted")
    p.add_argument("--fp64", action="store_true", help="train in float64 (tests compare runs across world sizes)")
    p.add_argument("--deterministic", action="store_true",
                   help="deterministic kernels only (torch.use_deterministic_algorithms): on a GPU, what makes "
                        "a resumed run bit-identical to an uninterrupted one")
    p.add_argument("--kill-at-step", type=int, default=None,
                   help="fault drill: --kill-rank dies (SIGKILL) in this step's backward, first attempt only")
    p.add_argument("--kill-in-save", type=int, default=None,
                   help="fault drill: --kill-rank dies while the checkpoint of this step is written")
    p.add_argument("--kill-rank", type=int, default=1)
    p.add_argument("--ft", action="store_true",
                   help="fault-tolerant replica groups with torchft: this torchrun is one group (env TORCHFT_LIGHTHOUSE, "
                        "REPLICA_GROUP_ID, NUM_REPLICA_GROUPS; docs/fault_tolerance.md)")
    p.add_argument("--ft-start-groups", type=int, default=None,
                   help="--ft: a fresh job's first step waits until this many replica groups are in the quorum "
                        "(default: all NUM_REPLICA_GROUPS); groups that join later copy the state")
    p.add_argument("--compile", action="store_true",
                   help="the training step's forward and backward compiled whole (torch.compile, fullgraph: the "
                        "collectives in the graph, docs/compile.md); evaluation and sampling stay eager")
    p.add_argument("--min-step-seconds", type=float, default=0.0,
                   help="fault drill: each step lasts at least this long (so that a drill's kill lands mid-run)")
    args = p.parse_args(argv)
    args.ckpt = args.ckpt or os.path.join(args.out, "ckpt")
    return args


def init_process_group(backend: str) -> None:
    """``dist.init_process_group(backend)``, with the store's keys kept apart per torchrun attempt.
    After ``torchrun --max-restarts`` relaunches the workers, they meet in the same rendezvous
    store as the attempt before (the agent's, without a per-attempt prefix): the process group's
    keys from the dead attempt are still there, and a rank could read a dead peer's address
    (seen: gloo's "connectFullMesh failed ... Connection refused", or a hang)."""
    store, rank, world = next(dist.rendezvous("env://"))
    store = dist.PrefixStore(f"attempt_{faults.restart_count()}", store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world)


def setup(args: argparse.Namespace) -> torch.device:
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if args.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS reads it at its first use
        torch.use_deterministic_algorithms(True)  # warn_only=True would leave flash attention nondeterministic
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        init_process_group("nccl")
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        init_process_group("gloo")
        device = torch.device("cpu")
    preset = PRESETS[("gpu" if use_cuda else "cpu") if args.preset == "auto" else args.preset]
    for key, value in preset.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.bf16 = args.bf16 or use_cuda
    return device


def build(args: argparse.Namespace, device: torch.device):
    world = dist.get_world_size()
    if args.mesh == "hsdp":
        if world % args.replicas or world == args.replicas:
            raise SystemExit(f"--mesh hsdp: --replicas {args.replicas} must divide the world size {world} "
                             "into groups of at least 2 ranks.")
        mesh = init_device_mesh(device.type, (args.replicas, world // args.replicas),
                                mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh(device.type, (world,))
    cfg = LlamaConfig(vocab_size=256, dim=args.dim, n_layers=args.layers, n_heads=args.heads,
                      hidden_dim=int(args.dim * 8 / 3), max_seq_len=args.seq_len)
    torch.manual_seed(args.seed)  # every rank builds the same model, then keeps its shard
    with torch.device(device):
        model = Llama(cfg).to(torch.float64 if args.fp64 else torch.float32)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if args.bf16 else MixedPrecisionPolicy()
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    return model, optimizer


def lr_at(step: int, args: argparse.Namespace) -> float:
    """Linear warm-up over the first 5% of steps, then cosine down to a tenth."""
    warm = max(1, args.steps // 20)
    if step < warm:
        return args.lr * (step + 1) / warm
    t = (step - warm) / max(1, args.steps - warm)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))


def global_mean(value: torch.Tensor) -> float:
    v = value.detach().double().reshape(1).clone()
    dist.all_reduce(v)
    return v.item() / dist.get_world_size()


def state_mib(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> float:
    """This rank's bytes of parameters, gradients and optimizer state (its shards), in MiB."""
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
    tensors = [local(p) for p in model.parameters()] + [local(p.grad) for p in model.parameters() if p.grad is not None]
    tensors += [local(v) for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    return sum(t.numel() * t.element_size() for t in tensors) / 2**20


PEAK_BF16 = [("H100 PCIe", 756e12), ("H100", 989e12), ("H200", 989e12), ("A100", 312e12)]  # dense, spec sheets


def mfu(args, model: torch.nn.Module, tokens_per_s_per_rank: float, device: torch.device) -> float | None:
    """Model FLOPs utilisation: the model's FLOPs per token (6 per matmul weight, PaLM's 12 L d T for
    attention) times tokens/s per rank, over the device's dense bf16 peak (None off a known GPU)."""
    if device.type != "cuda" or not args.bf16:
        return None
    name = torch.cuda.get_device_name(device)
    peak = next((value for key, value in PEAK_BF16 if key in name), None)
    if peak is None:
        return None
    matmul = sum(p.numel() for p in model.parameters() if p.dim() == 2)  # the tied embedding once: the output
    per_token = 6 * matmul + 12 * args.layers * args.dim * args.seq_len
    return per_token * tokens_per_s_per_rank / peak


def memory_line(model, optimizer, device: torch.device) -> str:
    """What each rank holds, labelled: on an accelerator the allocator's peak, on CPU the shards."""
    if device.type == "cuda":
        value, label = torch.cuda.max_memory_allocated(device) / 2**20, "peak allocated MiB/rank"
    else:
        value, label = state_mib(model, optimizer), "params+grads+optim MiB/rank"
    t = torch.tensor([value], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return f"{label} {t.item():.1f}"


@torch.no_grad()
def evaluate(model, val: textdata.Batches, n_batches: int, device: torch.device) -> float:
    rank, world = dist.get_rank(), dist.get_world_size()
    total, count = torch.zeros(2, dtype=torch.float64, device=device), 0
    for indices in textdata.validation_indices(val, n_batches):
        x, y = val.sequences_at(indices.chunk(world)[rank]) if len(indices) >= world else val.sequences_at(indices)
        loss = loss_fn(model(x.to(device)), y.to(device))
        total += torch.tensor([loss.item() * y.numel(), y.numel()], dtype=torch.float64, device=device)
        count += 1
    dist.all_reduce(total)
    return (total[0] / total[1]).item()


@torch.no_grad()
def generate(model, prompt: str, n: int, seq_len: int, device: torch.device, seed: int) -> str:
    """Sample ``n`` bytes after ``prompt`` (temperature 0.8). Every rank runs it in step (the
    forward's all-gathers need them all) with the same generator, so all draw the same bytes."""
    gen = torch.Generator().manual_seed(seed)
    tokens = list(prompt.encode())
    for _ in range(n):
        x = torch.tensor([tokens[-seq_len:]], device=device)
        probs = torch.softmax(model(x)[0, -1].float().cpu() / 0.8, dim=-1)
        tokens.append(int(torch.multinomial(probs, 1, generator=gen)))
    return bytes(tokens).decode("utf-8", errors="replace")


class Progress:
    """Rank 0's display: a tqdm bar on a terminal; plain lines every ``every`` steps otherwise (CI,
    torchrun logs), or when tqdm is not installed."""

    def __init__(self, start: int, total: int, every: int, enabled: bool) -> None:
        self.bar, self.every, self.enabled, self.t0, self.start = None, every, enabled, time.perf_counter(), start
        if enabled and sys.stdout.isatty():
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, initial=start, unit="step", dynamic_ncols=True)
            except ImportError:
                pass

    def update(self, step: int, total: int, fields: dict[str, str]) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix_str("  ".join(f"{k} {v}" for k, v in fields.items()))
        elif (step + 1) % self.every == 0 or step + 1 == total:
            done = step + 1 - self.start
            eta = (time.perf_counter() - self.t0) / done * (total - step - 1)
            print(f"step {step + 1:5d}/{total}  " + "  ".join(f"{k} {v}" for k, v in fields.items())
                  + f"  eta {eta:5.0f}s", flush=True)

    def write(self, line: str) -> None:
        if self.enabled:
            (self.bar.write if self.bar is not None else print)(line)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class StopRequest:
    """SIGTERM / SIGINT (Ctrl-C, or torchrun stopping the job) ask for a checkpoint and a clean
    exit after the current step; the ranks agree on it (one rank may get the signal later)."""

    def __init__(self) -> None:
        self.asked = False
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.asked = True

    def agreed(self, device: torch.device) -> bool:
        flag = torch.tensor([1.0 if self.asked else 0.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


def save_outputs(args, curve: list[dict], evals: list[dict], summary: dict, samples: dict[str, str]) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = [("steps", summary["steps"]), ("tokens seen", f"{summary['tokens']:,}"),
            ("parameters", f"{summary['params'] / 1e6:.2f}M"), ("world", summary["world"]),
            ("wall time (this run)", f"{summary['seconds']:.0f} s"), ("device", summary["device"]),
            ("tokens/s (whole run: evaluations and checkpoints included)", f"{summary['tokens_per_s']:,.0f}"),
            ("tokens/s (median training step)", f"{summary['step_tokens_per_s']:,.0f}"),
            *([("MFU (median step, of the bf16 dense peak)", f"{summary['mfu']:.1%}")] if summary["mfu"] else []),
            ("final train loss", f"{summary['train_loss']:.4f}"),
            ("validation loss", f"{summary['val_loss']:.4f}"), ("validation bits/byte", f"{summary['val_bpb']:.3f}"),
            ("unigram baseline bits/byte", f"{summary['unigram_bpb']:.3f}"), ("memory", summary["memory"])]
    table = "| | |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in rows)
    (out / "summary.md").write_text(table + "\n")
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    (out / "samples.txt").write_text("".join(f"--- {p!r}\n{s}\n" for p, s in samples.items()))
    print(table)
    for prompt, text in samples.items():
        print(f"--- sample after {prompt!r}:\n{text}")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(no loss-curve PNG: pip install matplotlib)")
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([c["tokens"] for c in curve], [textdata.bits_per_byte(c["loss"]) for c in curve], lw=0.8, label="train")
    ax.plot([e["tokens"] for e in evals], [e["bpb"] for e in evals], "o-", label="validation")
    ax.axhline(summary["unigram_bpb"], ls="--", c="gray", label="unigram (byte frequency) baseline")
    ax.set_xlabel("tokens (bytes) seen")
    ax.set_ylabel("bits per byte")
    ax.set_title(f"{summary['params'] / 1e6:.2f}M-parameter byte-level Llama, fully_shard, world {summary['world']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "loss.png", dpi=110)
    print(f"loss curve: {out / 'loss.png'}")


def write_metrics(args, curve: list[dict], evals: list[dict]) -> None:
    """``OUT/metrics.json``: every step's loss and every evaluation so far (rank 0)."""
    if dist.get_rank() == 0 and curve:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "metrics.json").write_text(json.dumps({"curve": curve, "evals": evals}))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = setup(args)
    rank, world = dist.get_rank(), dist.get_world_size()
    groups = int(os.environ.get("NUM_REPLICA_GROUPS", 1)) if args.ft else 1
    if args.batch % (world * groups):
        raise SystemExit(f"--batch {args.batch} must be divisible by the world size {world}"
                         + (f" times the {groups} replica groups" if args.ft else ""))
    corpus = textdata.load_corpus(args.data, args.max_bytes)
    train = textdata.Batches(corpus.train, args.seq_len, args.batch, args.seed)
    val = textdata.Batches(corpus.val, args.seq_len, args.batch, args.seed)
    model, optimizer = build(args, device)
    params = sum(p.numel() for p in model.parameters())
    ft = ftmode.ReplicaGroups(model, optimizer, device, rank, world, start_groups=args.ft_start_groups) if args.ft else None
    slot, slots = (ft.group * world + rank, ft.groups * world) if ft else (rank, world)  # this rank's part of a batch
    start, curve, evals, stop = 0, [], [], StopRequest()
    fault = faults.Faults(args.kill_at_step, args.kill_in_save, args.kill_rank, rank)
    restarted = faults.restart_count() > 0  # torchrun --max-restarts relaunched us: continue if we can
    path = checkpointing.latest(args.ckpt) if args.resume or restarted else None
    if args.resume or (restarted and path is not None):
        if path is None:  # said once, and every rank leaves cleanly
            if rank == 0:
                print(f"--resume: no checkpoint at {args.ckpt} (none complete). Fix: train without --resume "
                      "first, or pass --ckpt (or --out) where one was saved.", file=sys.stderr, flush=True)
            dist.destroy_process_group()
            sys.exit(2)
        meta = checkpointing.load(path, model, optimizer)
        start, curve, evals = meta["step"], meta["curve"], meta["evals"]
        if ft is not None:
            ft.resume_at(start)
        if rank == 0:
            print(f"resumed from {path} at t={time.time():.3f}"
                  + (f" (restart {faults.restart_count()} by torchrun)" if restarted else ""), flush=True)
    elif restarted and rank == 0:
        print(f"restart {faults.restart_count()} by torchrun: no complete checkpoint in {args.ckpt} yet, starting "
              "from step 0", flush=True)
    if rank == 0:
        print(textdata.describe(corpus))
        print(f"model: {params / 1e6:.2f}M parameters ({args.layers} blocks, dim {args.dim}), world {world} "
              f"({args.mesh}) on {device.type}{', bf16 compute' if args.bf16 else ''}"
              + (f", replica group {ft.group} of {ft.groups} (torchft)" if ft else "") + "; global batch "
              f"{args.batch} x {args.seq_len} bytes; steps {start}..{args.steps}"
              + (f" (resumed from {path})" if start else ""), flush=True)
    unigram = corpus.unigram_bits_per_byte()
    progress = Progress(start, args.steps, args.log_every, rank == 0)
    tokens_per_step, t0, step, memory = args.batch * args.seq_len, time.perf_counter(), start, ""
    step_seconds: list[float] = []
    seen_groups = ""

    def checkpoint(at: int) -> None:
        path = checkpointing.save(args.ckpt, at, model, optimizer, {"curve": curve, "evals": evals},
                                  after_write=fault.in_save(at))
        progress.write(f"checkpoint: {path}")

    def forward_loss(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return loss_fn(model(x), y)

    if args.compile:  # the same model, eager between compiled steps (evaluation, sampling, checkpoints)
        fault.arm_compiled(model, ft.across_groups if ft is not None else None)
        forward_loss = torch.compile(forward_loss, fullgraph=True)

    step = start
    while step < args.steps:
        tic = time.perf_counter()
        if ft is not None:  # the quorum; a group behind the others first copies a live one's state
            step = ft.begin_step()
            if step >= args.steps:
                break
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args)
        x, y = train.rank_batch(step, slot, slots)
        fault.arm_backward(model, step, compiled=args.compile)
        loss = forward_loss(x.to(device), y.to(device))
        loss.backward()
        if ft is not None and not ft.end_step(step):  # not every group's step was good: computed again
            progress.write(f"step {step + 1}: not committed by every replica group; computed again")
            continue
        if ft is None:
            optimizer.step()
            optimizer.zero_grad()
        value = global_mean(loss)  # waits for the step: the time below is the step's
        time.sleep(max(0.0, args.min_step_seconds - (time.perf_counter() - tic)))
        step_seconds.append(time.perf_counter() - tic)
        curve.append({"step": step + 1, "tokens": (step + 1) * tokens_per_step, "loss": value})
        if step == start or (step + 1) % args.log_every == 0:
            memory = memory_line(model, optimizer, device)
        speed = tokens_per_step / step_seconds[-1]
        fields = {"loss": f"{value:.4f}", "tok/s": f"{speed:,.0f}", "mem": memory}
        if ft is not None:  # replica groups in this step (torchft's quorum, less a group copying state)
            fields["groups"] = str(ft.manager.num_participants())
            if fields["groups"] != seen_groups:
                progress.write(f"step {step + 1}: {fields['groups']} replica group(s) in the quorum (was "
                               f"{seen_groups or '-'}) at t={time.time():.3f}")
                seen_groups = fields["groups"]
        progress.update(step, args.steps, fields)
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            v = evaluate(model, val, args.eval_batches, device)
            evals.append({"step": step + 1, "tokens": (step + 1) * tokens_per_step, "loss": v,
                          "bpb": textdata.bits_per_byte(v)})
            progress.write(f"step {step + 1}: validation loss {v:.4f}, {textdata.bits_per_byte(v):.3f} bits/byte "
                           f"(unigram baseline {unigram:.3f})")
        stopping = stop.agreed(device) or (args.stop_after is not None and step + 1 - start >= args.stop_after)
        if (step + 1) % args.ckpt_every == 0 or step + 1 == args.steps or stopping:
            checkpoint(step + 1)
        if stopping:
            progress.close()
            write_metrics(args, curve, evals)
            if rank == 0:
                print(f"stopped after step {step + 1} ({'a signal' if stop.asked else '--stop-after'}); "
                      "resume with --resume", flush=True)
            if ft is not None:
                ft.shutdown()
            shutdown()
            return
        step += 1
    progress.close()
    seconds = time.perf_counter() - t0
    write_metrics(args, curve, evals)
    samples = {p: generate(model, p, args.samples, args.seq_len, device, args.seed) for p in PROMPTS} if args.samples else {}
    if rank == 0 and evals:
        done = args.steps - start
        summary = {"steps": args.steps, "tokens": args.steps * tokens_per_step, "params": params, "world": world,
                   "seconds": seconds, "tokens_per_s": done * tokens_per_step / max(seconds, 1e-9),
                   "step_tokens_per_s": tokens_per_step / sorted(step_seconds)[len(step_seconds) // 2],
                   "train_loss": curve[-1]["loss"], "val_loss": evals[-1]["loss"], "val_bpb": evals[-1]["bpb"],
                   "unigram_bpb": unigram, "memory": memory,
                   "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
        summary["mfu"] = mfu(args, model, summary["step_tokens_per_s"] / world, device)
        save_outputs(args, curve, evals, summary, samples)
    if ft is not None:
        ft.shutdown()
    shutdown()


if __name__ == "__main__":
    main()
