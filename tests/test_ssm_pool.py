"""The generic SSM state pool, driven by a toy recurrent layer (a diagonal linear recurrence plus a
width-3 causal conv state), checked against a plain per-sequence numpy loop: batched steps over
slots in arbitrary order with padding rows, snapshot to host, restore into another slot."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from metrale_jax.cache.allocator import SlotAllocator
from metrale_jax.cache.ssm import (
    SSMArraySpec,
    init_ssm_pool,
    pool_max_slots,
    read_slots,
    reset_slots,
    restore,
    snapshot,
    ssm_bytes_per_slot,
    write_slots,
)

D, W = 5, 3  # state width, conv width
SPEC = {
    "layer0": {"h": SSMArraySpec((D,), "float32"), "conv": SSMArraySpec((W - 1, D), "float32")},
    "layer2": {"h": SSMArraySpec((D,), "float32"), "conv": SSMArraySpec((W - 1, D), "float32")},
}
RNG = np.random.default_rng(0)
A = {name: RNG.uniform(0.5, 0.95, D).astype(np.float32) for name in SPEC}
CW = {name: RNG.standard_normal((W, D)).astype(np.float32) for name in SPEC}


def _toy_layer_ref(name, x, h, conv):
    """One token: x f32[D]; conv holds the previous W-1 inputs. Returns (y, h, conv)."""
    window = np.concatenate([conv, x[None]], 0)  # [W, D]
    u = (window * CW[name]).sum(0)
    h = A[name] * h + u
    return h * 2.0, h, window[1:]


@jax.jit
def _step(pool, slots, x):
    """Every layer of the toy model over one token per row. slots i32[N], x f32[N, D]."""
    new = {}
    for name in SPEC:
        st = read_slots(pool[name], slots)
        window = jnp.concatenate([st["conv"], x[:, None]], 1)  # [N, W, D]
        u = (window * CW[name]).sum(1)
        h = A[name] * st["h"] + u
        new[name] = write_slots(pool[name], slots, {"h": h, "conv": window[:, 1:]})
        x = h * 2.0
    return new, x


def test_bytes_and_init():
    assert ssm_bytes_per_slot(SPEC) == 2 * (D + (W - 1) * D) * 4
    pool = init_ssm_pool(SPEC, 7)
    assert pool_max_slots(pool) == 7 and pool["layer2"]["conv"].shape == (7, W - 1, D)


def test_toy_recurrence_batched_over_slots_matches_loop():
    max_slots = 6
    pool = init_ssm_pool(SPEC, max_slots)
    alloc = SlotAllocator(max_slots)
    lengths = [7, 1, 12, 4, 9]
    seqs = [RNG.standard_normal((n, D)).astype(np.float32) for n in lengths]
    slot_of = {i: alloc.allocate() for i in range(len(seqs))}
    # reference: each sequence alone
    ref_out = []
    for s in seqs:
        st = {name: (np.zeros(D, np.float32), np.zeros((W - 1, D), np.float32)) for name in SPEC}
        outs = []
        for x in s:
            for name in SPEC:
                x, h, c = _toy_layer_ref(name, x, *st[name])
                st[name] = (h, c)
            outs.append(x)
        ref_out.append(np.stack(outs))
    # batched: at each step the live sequences in a shuffled order, padded to 8 rows with slot -1
    got = [[] for _ in seqs]
    pos = [0] * len(seqs)
    snap_taken = False
    rng = np.random.default_rng(1)
    while any(p < n for p, n in zip(pos, lengths)):
        live = [i for i in range(len(seqs)) if pos[i] < lengths[i]]
        rng.shuffle(live)
        live = live[: rng.integers(1, len(live) + 1)]
        slots = np.full(8, -1, np.int32)
        x = rng.standard_normal((8, D)).astype(np.float32)  # pad rows carry garbage
        for r, i in enumerate(live):
            slots[r] = slot_of[i]
            x[r] = seqs[i][pos[i]]
        before = jax.device_get(pool)
        pool, y = _step(pool, jnp.asarray(slots), jnp.asarray(x))
        after = jax.device_get(pool)
        # rows of sequences not in this step are untouched (pad -1 wrote nothing)
        touched = {slot_of[i] for i in live}
        for name in SPEC:
            for arr in ("h", "conv"):
                for s in range(max_slots):
                    if s not in touched:
                        np.testing.assert_array_equal(after[name][arr][s], before[name][arr][s])
        for r, i in enumerate(live):
            got[i].append(np.asarray(y[r]))
            pos[i] += 1
        # halfway through sequence 2: swap it out to host, free its slot, restore into a new slot
        if not snap_taken and pos[2] == 5:
            snap = snapshot(pool, slot_of[2])
            assert isinstance(snap["layer0"]["h"], np.ndarray)
            old = slot_of[2]
            pool = reset_slots(pool, jnp.asarray([old, -1], jnp.int32))
            alloc.free(old)
            blocker = alloc.allocate()  # someone else takes the old slot
            assert blocker == old
            slot_of[2] = alloc.allocate()
            assert slot_of[2] != old
            pool = restore(pool, slot_of[2], snap)
            snap_taken = True
    assert snap_taken
    for i in range(len(seqs)):
        np.testing.assert_allclose(np.stack(got[i]), ref_out[i], rtol=1e-5, atol=1e-5)


def test_pad_slot_reads_zeros():
    pool = init_ssm_pool(SPEC, 3)
    pool = {n: {k: a + 1.0 for k, a in arrs.items()} for n, arrs in pool.items()}
    st = read_slots(pool["layer0"], jnp.asarray([1, -1, 2], jnp.int32))
    np.testing.assert_array_equal(np.asarray(st["h"][1]), 0)
    np.testing.assert_array_equal(np.asarray(st["h"][0]), 1)
