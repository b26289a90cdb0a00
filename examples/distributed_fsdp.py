"""Plan a GPT for FSDP2 on 2 ranks, shard the result the usual way, train one step per rank.

    python examples/distributed_fsdp.py          # CPU, gloo, 2 processes

Planning runs once, before the ranks start: ``example_inputs`` are one rank's batch and the
budget is per rank. Every rank re-applies the saved plan (no profiling), shards it with
``fully_shard`` on each unit and then on the model, and trains.
"""

import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.fsdp import fully_shard

import autockpt
from autockpt.api import Planner
from autockpt_zoo.toy import gpt

WORLD_SIZE = 2


def train(rank: int, plan_path: str, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE)
    model, _ = gpt(layers=4, dim=128, seq_len=64, dropout=0.0, seed=0)  # same weights everywhere
    _, batch = gpt(layers=4, dim=128, seq_len=64, dropout=0.0, seed=1 + rank)  # own batch
    model = autockpt.apply(model, autockpt.Plan.load(plan_path))
    for name in model.plan.fsdp_units:
        fully_shard(model.get_submodule(name))
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(3):
        logits, loss = model(*batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        print(f"rank {rank} step {step} loss {loss.item():.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    model, batch = gpt(layers=4, dim=128, seq_len=64, dropout=0.0, seed=0)
    planner = Planner(model, batch, world_size=WORLD_SIZE, sharding="fsdp")
    print(
        f"per rank: leanest plan {planner.minimum_peak_bytes / 2**20:.2f} MiB, "
        f"no checkpointing {planner.no_checkpoint_peak_bytes / 2**20:.2f} MiB"
    )
    budget = (planner.minimum_peak_bytes + planner.no_checkpoint_peak_bytes) / 2
    planned = planner.optimize(budget_gb=budget / 2**30)
    print(planned.plan.summary())
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "plan.json")
        planned.plan.save(path)
        mp.spawn(train, args=(path, 29555), nprocs=WORLD_SIZE)
