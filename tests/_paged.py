"""Hand-built step metadata for model-level paged tests (the engine has its own builder)."""

import numpy as np

from metrale_jax.metadata import AttnMetadata, BatchedAttnMetadata


class Layout:
    """Block tables for a few sequences, drawn from a permuted pool (non-contiguous)."""

    def __init__(self, num_seqs, num_blocks=64, block_size=4, max_blocks=16, seed=0):
        perm = np.random.default_rng(seed).permutation(num_blocks)
        assert num_seqs * max_blocks <= num_blocks
        self.bs, self.max_blocks = block_size, max_blocks
        self.tables = [perm[i * max_blocks:(i + 1) * max_blocks].astype(np.int32) for i in range(num_seqs)]

    def slots(self, seq, start, n):
        pos = np.arange(start, start + n)
        return self.tables[seq][pos // self.bs] * self.bs + pos % self.bs

    def prefill(self, chunks, t_bucket, b_bucket, ssm_slots=None):
        """chunks: [(seq, start, n)] -> BatchedAttnMetadata padded to the buckets.

        ssm_slots: the SSM pool row of each seq (default: the seq index)."""
        pos, slots, cu, kv, ss = [], [], [0], [], []
        bt = np.zeros((b_bucket, self.max_blocks), np.int32)
        for j, (s, start, n) in enumerate(chunks):
            pos += list(range(start, start + n))
            slots += list(self.slots(s, start, n))
            cu.append(cu[-1] + n)
            kv.append(start + n)
            bt[j] = self.tables[s]
            ss.append(s if ssm_slots is None else ssm_slots[s])
        t_pad, b_pad = t_bucket - len(pos), b_bucket - len(chunks)
        pos = np.array(pos + [0] * t_pad, np.int32)
        slots = np.array(slots + [-1] * t_pad, np.int32)
        cu = np.array(cu + [cu[-1]] * b_pad, np.int32)
        kv = np.array(kv + [0] * b_pad, np.int32)
        ss = np.array(ss + [-1] * b_pad, np.int32)
        neg = -np.ones(b_bucket, np.int32)
        return BatchedAttnMetadata(pos, pos, pos, slots, bt, cu, kv, ss, neg, neg,
                                   num_tokens=t_bucket, num_streams=b_bucket, max_blocks_per_seq=self.max_blocks)

    def decode(self, rows, n_bucket, ssm_slots=None):
        """rows: [(seq, position)] -> AttnMetadata padded to n_bucket rows."""
        pos = np.zeros(n_bucket, np.int32)
        slots = -np.ones(n_bucket, np.int32)
        lens = np.zeros(n_bucket, np.int32)
        ss = -np.ones(n_bucket, np.int32)
        bt = np.zeros((n_bucket, self.max_blocks), np.int32)
        for j, (s, p) in enumerate(rows):
            pos[j], slots[j], lens[j], bt[j] = p, self.slots(s, p, 1)[0], p + 1, self.tables[s]
            ss[j] = s if ssm_slots is None else ssm_slots[s]
        neg = -np.ones(n_bucket, np.int32)
        return AttnMetadata(pos, pos, pos, slots, lens, bt, ss, neg, neg, num_seqs=n_bucket,
                            max_blocks_per_seq=self.max_blocks)
