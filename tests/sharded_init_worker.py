"""The program each process runs in tests/test_sharded_init.py's two-process test
(``python -m zerojax.cli.launch --nproc 2 --devices-per-proc 4``): the tiny GPT born
sharded at stage 3 on data=4 x model=2 over both processes' devices. Each process
checks every shard it holds against the eager init (computed on its own first
device), reads the whole params back leaf by leaf on the host (``iter_full_params``:
leaves split over the other process are all-gathered), and hands the split params
back to ``init_state`` (arrays not fully addressable here), which must give the same
shards. Prints one ``ok`` line per process."""

import zerojax.distributed as zd

zd.initialize()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import zerojax  # noqa: E402
from zerojax.models import GPT, GPTConfig, gpt_params  # noqa: E402

assert jax.process_count() == 2 and len(jax.devices()) == 8
model = GPT(GPTConfig(vocab=64, seq=16, layers=2, hidden=32, heads=2))
tokens = jnp.zeros((1, 16), jnp.int32)
with jax.default_device(jax.local_devices()[0]):
    eager = jax.tree.map(np.asarray, gpt_params(model, 0))
opt = zerojax.zero(optax.adam(1e-3), zerojax.make_mesh(data=4, model=2), stage=3)
state = opt.init_sharded(lambda key: model.init(key, tokens)["params"], jax.random.key(0))
shards = 0
for x, want in zip(jax.tree.leaves(state.params), jax.tree.leaves(eager)):
    assert not x.is_fully_addressable, x.sharding  # a global array over both processes
    for sh in x.addressable_shards:
        got = np.asarray(sh.data)
        ref = want[tuple(slice(s.start or 0, min(s.stop or n, w))
                         for s, n, w in zip(sh.index, x.shape, want.shape))]
        np.testing.assert_array_equal(got[tuple(slice(0, r) for r in ref.shape)], ref)
        shards += 1
host = dict(opt.iter_full_params(state))
for got, want in zip(host.values(), jax.tree.leaves(eager)):
    np.testing.assert_array_equal(got, want)
again = opt.init_state(opt.full_params(state, "split"))
for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(state)):
    assert a.sharding == b.sharding
    for sa, sb in zip(a.addressable_shards, b.addressable_shards):
        np.testing.assert_array_equal(np.asarray(sa.data), np.asarray(sb.data))
print(f"ok process {jax.process_index()}: {shards} shards equal the eager init, "
      f"{len(host)} leaves on the host", flush=True)
