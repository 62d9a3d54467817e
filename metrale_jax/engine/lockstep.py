"""Several hosts (`jax.distributed`): process 0 schedules, every process runs the same steps.

Under JAX's multi-controller model every process must launch the same computations, in the same
order, on the same (replicated) host inputs. Process 0 runs the scheduler, the tokenizer and the
HTTP server; before each device operation it sends the operation and its host inputs to the
other processes (`Lockstep.send`: a pickled message broadcast with
`multihost_utils.broadcast_one_to_all`, whose sizes are padded to powers of two so that only a
few broadcast shapes ever compile), and they replay it on their devices (`follow`). The
operations are the step (`"step"`: bucket, packed metadata, structured-output bitmask), the swap
copies of preemption (`"swap_out"` / `"swap_in"`, keyed by sequence id: each process keeps its own
saved copy), the prefix cache's SSM slot copies (`"ssm_copy"`), and `"stop"`.

Launch: the same command on every host, after `jax.distributed.initialize(...)` (JAX reads its
cluster from Slurm / Open MPI, or takes `coordinator_address`, `num_processes`, `process_id`),
with `tensor_parallel_size` = the number of devices of all hosts.
"""

from __future__ import annotations

import pickle

import jax
import numpy as np

_HEADER = 2  # i32[2]: message bytes, 0 = none


def _bytes_bucket(n: int) -> int:
    return max(1024, 1 << (n - 1).bit_length())


class Lockstep:
    """Broadcast of device operations from process 0 to the others."""

    def __init__(self):
        self.leader = jax.process_index() == 0

    def _broadcast(self, x: np.ndarray) -> np.ndarray:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.broadcast_one_to_all(x, is_source=self.leader))

    def send(self, op: str, *args) -> None:
        """Process 0: announce `op(*args)` (host values: ints, numpy arrays, tuples) to the others."""
        assert self.leader, "only process 0 sends"
        raw = pickle.dumps((op, args), protocol=pickle.HIGHEST_PROTOCOL)
        self._broadcast(np.asarray([len(raw), 1], np.int32))
        buf = np.zeros(_bytes_bucket(len(raw)), np.uint8)
        buf[: len(raw)] = np.frombuffer(raw, np.uint8)
        self._broadcast(buf)

    def recv(self) -> tuple[str, tuple]:
        """Other processes: the next operation process 0 sent."""
        n = int(self._broadcast(np.zeros(_HEADER, np.int32))[0])
        raw = self._broadcast(np.zeros(_bytes_bucket(n), np.uint8))[:n].tobytes()
        return pickle.loads(raw)  # noqa: S301 - from our own process 0


def follow(engine) -> None:
    """Replay process 0's device operations on this process's devices until it sends "stop"."""
    lock, saved = engine.lockstep, {}
    while True:
        op, args = lock.recv()
        if op == "stop":
            return
        if op == "step":
            bucket, ibuf, fbuf, bitmask = args
            dev = engine.compiler.put(ibuf, fbuf)
            mask = None if bitmask is None else engine.compiler.put(bitmask)
            engine.state, _, engine._next_tokens = engine.compiler.run(bucket, engine.params, engine.state, dev,
                                                                       engine._next_tokens, mask)
        elif op == "swap_out":
            key, blocks, slot = args
            saved[key] = engine.compiler.swap_out(engine.state, blocks, slot)
        elif op == "swap_in":
            key, blocks, slot = args
            engine.state = engine.compiler.swap_in(engine.state, saved.pop(key), blocks, slot)
        elif op == "ssm_copy":  # prefix caching's SSM snapshots and restores
            engine.state = engine.compiler.copy_ssm_slots(engine.state, args[0])
        elif op == "drop":
            saved.pop(args[0], None)
        else:
            raise RuntimeError(f"unknown lockstep operation {op!r}")
