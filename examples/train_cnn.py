"""Data-parallel training of a small CNN on scikit-learn's 8x8 digits, with a choice of DDP comm hook.

Run (4 ranks; any launcher that starts MPI ranks works):

    ddlrun -n 4 -- python examples/train_cnn.py --hook int8
    mpiexec -n 4 python examples/train_cnn.py --hook onebit --epochs 25
    ddlrun -n 4 --topology 2x2 -- python examples/train_cnn.py --hook auto --compression int8   # per level
    DDL_COMPRESSION=auto ddlrun -n 4 --topology 2x2 -- python examples/train_cnn.py --hook none  # no hook

What it does: every rank builds the same CNN (fixed seed), wraps it in
``DistributedDataParallel`` on the "ddl" backend when ``ddl_triton.torch`` registers it (else
on gloo, with MASTER_ADDR/PORT chosen by rank 0 and sent over mpi4py; ``--backend`` forces
one), and registers the hook named by ``--hook`` from ``ddl_triton.torch.hooks`` (``none``
keeps DDP's own allreduce, on the process group). The digits (1797 images) are split 75/25
into train/test with a fixed seed; each step every rank takes its own slice of a global batch
(the ranks' gradients differ), DDP averages the gradients through the hook, and plain SGD
updates every replica identically.

Rank 0 shows a progress bar with the loss and samples/s of the global batch (``--log-steps``
prints a line per step instead, with the bytes this rank sent and received, measured as the
change of ``state.comm.transport_bytes`` over all transports; ``--quiet`` shows neither); at the
end the test accuracy, whether the replicas are bitwise identical, and one machine-readable line:

    RESULT hook=int8 backend=ddl ranks=4 accuracy=0.9667 loss=0.0867 bytes_per_step=212160 received_per_step=212160 ...

``bytes_per_step`` / ``received_per_step`` are means over steps and ranks. The shm transport
counts a slot published to k readers as k sends, so for the fp32 allreduce (two_shot) "sent"
exceeds what crosses; "received" is the fair comparison. With ``--hook none`` on gloo both
are 0: DDP's gloo traffic does not pass through the ddl_triton communicator.

Momentum: ``--momentum 0.9`` trains the lossless and 8/16-bit runs faster, but the 1-bit hook's
error feedback then lags and oscillates (measured: test accuracy ~0.6-0.8 against 0.98); 1-bit
Adam avoids that by compressing the optimizer's momentum, which a gradient hook cannot see.
Hence plain SGD by default.
"""
from __future__ import annotations

import argparse
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

HOOKS = ("none", "allreduce", "fp16", "bf16", "int8", "onebit", "auto")


def load_data(seed: int = 0, test_size: float = 0.25, mpi_comm=None):
    """(x_train, y_train, x_test, y_test): digits as [N, 1, 8, 8] fp32, a stratified split.

    Pixels (0..16) are standardized with the training set's mean and standard deviation.

    With ``mpi_comm`` only its rank 0 imports scikit-learn (seconds of CPU per process) and
    broadcasts the arrays. Example: x_train.shape == (1347, 1, 8, 8), x_test.shape == (450, 1, 8, 8),
    labels int64 0..9.
    """
    arrays = None
    if mpi_comm is None or mpi_comm.Get_rank() == 0:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split

        digits = load_digits()
        arrays = train_test_split(digits.data, digits.target, test_size=test_size, random_state=seed,
                                  stratify=digits.target)
    if mpi_comm is not None:
        arrays = _bcast_split(mpi_comm, arrays)
    x_train, x_test, y_train, y_test = (torch.tensor(a) for a in arrays)
    x_train, x_test = x_train.to(torch.float32).reshape(-1, 1, 8, 8), x_test.to(torch.float32).reshape(-1, 1, 8, 8)
    mean, std = x_train.mean(), x_train.std()
    return (x_train - mean) / std, y_train.to(torch.int64), (x_test - mean) / std, y_test.to(torch.int64)


def _bcast_split(mpi_comm, arrays):
    """Rank 0's (x_train, x_test, y_train, y_test) on every rank, as raw buffers (MPI's ``Bcast``:
    nothing is pickled): first the row counts and the row width, then each array."""
    import numpy as np

    head = np.zeros(3, dtype=np.int64)
    if mpi_comm.Get_rank() == 0:
        arrays = [np.ascontiguousarray(a, dtype=np.float64 if i < 2 else np.int64) for i, a in enumerate(arrays)]
        head[:] = (arrays[0].shape[0], arrays[1].shape[0], arrays[0].shape[1])
    mpi_comm.Bcast(head, root=0)
    n_train, n_test, width = (int(v) for v in head)
    if mpi_comm.Get_rank() != 0:
        arrays = [np.empty((n_train, width)), np.empty((n_test, width)), np.empty(n_train, dtype=np.int64),
                  np.empty(n_test, dtype=np.int64)]
    for a in arrays:
        mpi_comm.Bcast(a, root=0)
    return arrays


def _bcast_text(mpi_comm, text: str | None) -> str:
    """Rank 0's short ``text`` on every rank, as bytes (nothing pickled)."""
    import numpy as np

    buf = np.zeros(256, dtype=np.uint8)
    if mpi_comm.Get_rank() == 0:
        raw = text.encode()[:256]
        buf[:len(raw)] = np.frombuffer(raw, dtype=np.uint8)
    mpi_comm.Bcast(buf, root=0)
    return bytes(buf).rstrip(b"\0").decode()


def build_model(seed: int = 0) -> nn.Module:
    """The CNN: two 3x3 convolutions (16, 32 channels), a 2x2 max-pool, 512 -> 256 -> 10. 138_698 parameters.

    He-initialized (zero biases): with torch's default init this net sits on a loss plateau for
    30-40 SGD steps before it drops, and when it drops is chaotic. The same seed gives the same
    weights on every rank.
    """
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 4 * 4, 256), nn.ReLU(), nn.Linear(256, 10))
    for m in model.modules():
        if isinstance(m, (nn.Conv2d, nn.Linear)):
            nn.init.kaiming_normal_(m.weight, nonlinearity="relu")
            nn.init.zeros_(m.bias)
    return model


def ddl_backend_available() -> bool:
    """True when ``ddl_triton.torch`` imports and registers the "ddl" torch.distributed backend."""
    try:
        import ddl_triton.torch  # noqa: F401 - registers the backend as a side effect
    except Exception:  # noqa: BLE001 - any failure means: use gloo
        return False
    return "ddl" in getattr(dist.Backend, "backend_list", [])


def init_process_group(backend: str = "auto") -> str:
    """Start torch.distributed over the MPI ranks; returns the backend used ("ddl" or "gloo").

    "ddl" takes its ranks and rendezvous from MPI. For gloo, rank 0 picks a free TCP port and its
    address (127.0.0.1 when all ranks share its host) and sends them over mpi4py, so no
    MASTER_ADDR/MASTER_PORT needs setting by hand (values already set are kept).
    """
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    if backend == "auto":
        backend = "ddl" if ddl_backend_available() else "gloo"
    elif backend == "ddl" and not ddl_backend_available():
        raise SystemExit("train_cnn.py: --backend ddl, but ddl_triton.torch does not register a 'ddl' backend")
    if dist.is_initialized():
        return backend
    if backend == "ddl":
        dist.init_process_group("ddl")
        return backend
    import numpy as np

    host = socket.gethostname()
    elsewhere = np.array([int(_bcast_text(world, host) != host)], dtype=np.int64)  # not on rank 0's host
    world.Allreduce(MPI.IN_PLACE, elsewhere, op=MPI.MAX)
    addr_port = None
    if world.rank == 0:
        with socket.socket() as s:
            s.bind(("", 0))
            addr_port = f"{host if elsewhere[0] else '127.0.0.1'} {s.getsockname()[1]}"
    addr, port = _bcast_text(world, addr_port).split()
    os.environ["MASTER_ADDR"] = os.environ.get("MASTER_ADDR") or addr
    os.environ["MASTER_PORT"] = os.environ.get("MASTER_PORT") or str(port)
    dist.init_process_group(backend, rank=world.rank, world_size=world.size)
    return backend


def make_hook(name: str, comm, error_feedback: bool = True, compression: str = "auto"):
    """(hook function or None, HookState) for a ``--hook`` name; ``compression``: what the
    per-level hook ("auto") sends between hosts (HookState.compression)."""
    from ddl_triton.torch import hooks

    table = {"none": None, "allreduce": hooks.allreduce_hook, "fp16": hooks.fp16_compress_hook,
             "bf16": hooks.bf16_compress_hook, "int8": hooks.int8_compress_hook,
             "onebit": hooks.onebit_compress_hook, "auto": hooks.auto_compress_hook}
    if name not in table:
        raise ValueError(f"unknown hook {name!r}; valid: {', '.join(HOOKS)}")
    return table[name], hooks.HookState(comm, error_feedback=error_feedback, compression=compression)


def batches(n_train: int, global_batch: int, epochs: int, seed: int):
    """Yield (epoch, indices of one global batch): a fresh permutation per epoch, the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    for epoch in range(epochs):
        perm = torch.randperm(n_train, generator=g)
        for start in range(0, n_train - global_batch + 1, global_batch):
            yield epoch, perm[start: start + global_batch]


def train(model: nn.Module, data, *, rank: int, size: int, epochs: int, batch_size: int, lr: float,
          momentum: float = 0.0, seed: int = 0, state=None, on_step=None, max_steps: int | None = None):
    """Train ``model`` (a DDP module) in place; returns the list of per-step losses (global means
    when ``state`` is given, else this rank's), stopping after ``max_steps`` steps if given.

    Rank r takes rows [r*batch_size, (r+1)*batch_size) of each global batch of size*batch_size.
    ``on_step(step, epoch, loss, seconds, bytes_sent, bytes_received)`` is called on every rank after
    each step (bytes measured through ``state``, 0 without one).
    """
    x_train, y_train = data[0], data[1]
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    losses = []
    comm = state.comm if state is not None else None
    for step, (epoch, idx) in enumerate(batches(len(y_train), size * batch_size, epochs, seed + 1)):
        if max_steps is not None and step >= max_steps:
            break
        mine = idx[rank * batch_size: (rank + 1) * batch_size]
        moved0 = (state.sent_bytes(), state.received_bytes()) if state is not None else (0, 0)
        t0 = time.perf_counter()
        loss = F.cross_entropy(model(x_train[mine]), y_train[mine])
        opt.zero_grad(set_to_none=False)
        loss.backward()  # DDP reduces the gradients (through the hook) before this returns
        opt.step()
        dt = time.perf_counter() - t0
        sent, received = ((state.sent_bytes() - moved0[0], state.received_bytes() - moved0[1]) if state is not None
                          else (0, 0))
        mean_loss = loss.detach().reshape(1).clone()
        if comm is not None:
            comm.allreduce(mean_loss, op="avg")  # after the byte count: not part of a training step
        losses.append(mean_loss.item())
        if on_step is not None:
            on_step(step, epoch, losses[-1], dt, sent, received)
    return losses


@torch.no_grad()
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    pred = model(x).argmax(dim=1)
    model.train()
    return (pred == y).float().mean().item()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hook", choices=HOOKS, default="allreduce")
    p.add_argument("--backend", choices=("auto", "ddl", "gloo"), default="auto")
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--batch-size", type=int, default=32, help="samples per rank per step")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--momentum", type=float, default=0.0,
                   help="SGD momentum; with the 1-bit hook it makes training unstable (see the module doc)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bucket-cap-mb", type=float, default=25.0,
                   help="DDP's gradient bucket size; smaller buckets start allreducing earlier in backward")
    p.add_argument("--no-error-feedback", action="store_true", help="int8/onebit without error feedback")
    p.add_argument("--compression", choices=("auto", "int8", "onebit", "none"), default="auto",
                   help="--hook auto: what goes between hosts (fp32 over shm inside a host); auto: where it pays")
    p.add_argument("--log-steps", action="store_true", help="a line per step (loss, samples/s, bytes) instead of a bar")
    p.add_argument("--quiet", action="store_true", help="neither a progress bar nor per-step lines")
    args = p.parse_args(argv)

    torch.set_num_threads(1)  # several ranks share a few cores
    import ddl_triton as ddl
    from mpi4py import MPI

    backend = init_process_group(args.backend)
    comm = ddl.init()
    rank, size = comm.rank, comm.size
    data = load_data(args.seed, mpi_comm=MPI.COMM_WORLD)
    model = DDP(build_model(args.seed), bucket_cap_mb=args.bucket_cap_mb)
    hook, state = make_hook(args.hook, comm, error_feedback=not args.no_error_feedback, compression=args.compression)
    if hook is not None:
        model.register_comm_hook(state, hook)
    global_batch = size * args.batch_size
    if rank == 0:
        n_params = sum(p.numel() for p in model.parameters())
        print(f"# train_cnn: {size} ranks, backend {backend}, hook {args.hook}, {n_params} parameters, "
              f"{len(data[1])} train / {len(data[3])} test digits, global batch {global_batch}", flush=True)

    step_sent, step_received, step_rates = [], [], []
    bar = None
    if rank == 0 and not (args.quiet or args.log_steps):
        from tqdm import tqdm
        # delay: the header above goes through the launcher's stdout relay; let it arrive first
        # (a run shorter than the delay shows no bar, only its summary).
        bar = tqdm(total=args.epochs * (len(data[1]) // global_batch), unit="step", mininterval=0.25, delay=0.3,
                   dynamic_ncols=True, desc="training")

    def on_step(step, epoch, loss, seconds, sent, received):
        step_sent.append(sent)
        step_received.append(received)
        step_rates.append(global_batch / seconds)
        if bar is not None:
            bar.set_postfix_str(f"epoch {epoch}  loss {loss:.4f}  {global_batch / seconds:.0f} samples/s", refresh=False)
            bar.update()
        elif rank == 0 and args.log_steps:
            print(f"step {step:4d}  epoch {epoch}  loss {loss:.4f}  {global_batch / seconds:9.0f} samples/s  "
                  f"sent {sent} B  received {received} B", flush=True)

    t0 = time.perf_counter()
    losses = train(model, data, rank=rank, size=size, epochs=args.epochs, batch_size=args.batch_size, lr=args.lr,
                   momentum=args.momentum, seed=args.seed, state=state, on_step=on_step)
    elapsed = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    acc = accuracy(model.module, data[2], data[3])

    flat = torch.cat([q.detach().reshape(-1) for q in model.module.parameters()])
    every = torch.empty(size, flat.numel(), dtype=flat.dtype)
    MPI.COMM_WORLD.Allgather(flat.numpy(), every.numpy())  # raw buffers: nothing pickled
    same = all(torch.equal(flat, other) for other in every)

    def mean(xs) -> float:  # over steps, then over ranks
        total = torch.tensor([sum(xs) / max(1, len(xs))], dtype=torch.float64)
        MPI.COMM_WORLD.Allreduce(MPI.IN_PLACE, total.numpy(), op=MPI.SUM)
        return total.item() / size
    mean_sent, mean_received = mean(step_sent), mean(step_received)
    rate = sorted(step_rates)[len(step_rates) // 2] if step_rates else 0.0
    per_level = ""
    if args.hook == "auto":  # what the bucket got between hosts, and why
        per_level = state.explain(4 * sum(q.numel() for q in model.parameters()))
    elif getattr(model.process_group, "compression", None) is not None:  # DDL_COMPRESSION on the "ddl" backend
        per_level = "; ".join(model.process_group.compression.explain(b) for b in model.process_group.compression.decisions)
    if rank == 0:
        if per_level:
            print(f"# per-level compression: {per_level}")
        print(f"# {len(losses)} steps in {elapsed:.2f} s; median {rate:.0f} samples/s; test accuracy {acc:.4f}; "
              f"replicas bitwise identical: {'yes' if same else 'NO'}")
        hook_name = args.hook + (f"/{args.compression}" if args.hook == "auto" else "")
        print(f"RESULT hook={hook_name} backend={backend} ranks={size} accuracy={acc:.4f} loss={losses[-1]:.4f} "
              f"bytes_per_step={mean_sent:.0f} received_per_step={mean_received:.0f} samples_per_s={rate:.0f} "
              f"identical={int(same)}", flush=True)
    state.close()
    dist.destroy_process_group()
    ddl.finalize()
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
