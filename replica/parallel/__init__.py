"""Tensor parallelism of one replica: `tp` ranks, each a process holding 1/tp of the base
model and of every adapter, and its own unified pool. Rank 0 is the engine: it schedules,
and sends each step to the other ranks; all ranks run the forward pass together.

- shard.py   how the base weights and adapters are cut (the weight loaders)
- comm.py    torch.distributed collectives with timeouts and byte counts; the forward ops
- worker.py  a rank other than 0 and the messages it answers
- handles.py rank 0's handle on a worker: a local process, or a Ray actor in the
             replica's placement group
- group.py   rank 0's side: starting the workers and sending them the steps
"""
