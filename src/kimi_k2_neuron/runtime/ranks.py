"""Placeholder: replaced by the launcher of the cli-ux branch."""
import os, socket
import torch.multiprocessing as mp


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _main(rank, target, nprocs, port, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(nprocs), RANK=str(rank),
                      LOCAL_RANK=str(rank))
    target(rank, *args)


def run_ranks(target, nprocs, args=()):
    mp.spawn(_main, args=(target, nprocs, _port(), args), nprocs=nprocs, join=True)
