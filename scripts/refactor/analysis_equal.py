"""Record (``record OUT.json``) or compare (``compare OUT.json``) the outputs of the
analysis layer's long functions over a grid: report.gpt_phases, gpt_step_prediction,
predict_step_memory; plan.plan_model, plan.plan; memory.state_bytes; `zerojax plan`'s
CLI text. Exact equality of every number and text (repr of the result objects).

Record on the commit before a refactor, compare after it, from the repository root:

    PYTHONPATH=$PWD .venv/bin/python scripts/refactor/analysis_equal.py record /tmp/a.json
    PYTHONPATH=$PWD .venv/bin/python scripts/refactor/analysis_equal.py compare /tmp/a.json

The grid's lambdas are called inside their loop iteration (B023 does not apply).
"""
# ruff: noqa: B023
import contextlib
import io
import itertools
import json
import sys

import jax
import jax.numpy as jnp
import optax

from zerojax.analysis import plan as P, report as R
from zerojax.analysis.memory import state_bytes
from zerojax.models.gpt import GPT, GPTConfig


def canon(obj):
    """A text of ``obj`` independent of dataclass field order: dataclasses and
    NamedTuples by sorted field names, everything else by repr (floats exactly)."""
    import dataclasses
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        items = sorted((f.name, canon(getattr(obj, f.name))) for f in dataclasses.fields(obj))
        return f"{type(obj).__name__}({', '.join(f'{k}={v}' for k, v in items)})"
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        items = sorted((k, canon(getattr(obj, k))) for k in obj._fields)
        return f"{type(obj).__name__}({', '.join(f'{k}={v}' for k, v in items)})"
    if isinstance(obj, (list, tuple)):
        return f"{type(obj).__name__}[{', '.join(canon(v) for v in obj)}]"
    if isinstance(obj, dict):
        return "{" + ", ".join(f"{canon(k)}: {canon(v)}" for k, v in obj.items()) + "}"
    return repr(obj)


def cases():
    out = {}

    def put(key, fn):
        try:
            out[key] = canon(fn())
        except Exception as e:  # the error text is a result too
            out[key] = f"ERROR {type(e).__name__}: {e}"

    # predict_step_memory: a grid of its own arguments
    for stage, remat, prefetch, acc, scanned, mixed in itertools.product(
            (0, 1, 2, 3), (True, False), (True, False), (1, 4), (True, False), (0, 2)):
        put(f"psm s{stage} r{remat} p{prefetch} a{acc} sc{scanned} m{mixed}",
            lambda: R.predict_step_memory(
                10_000_000, 8, stage, layer_params=500_000, scanned=scanned, hidden=256,
                batch=4, seq=128, layers=8, vocab=1000, heads=8, remat=remat,
                prefetch=prefetch, accum_steps=acc, mixed_stack=mixed, largest_leaf=300_000,
                converted=1000, batch_bytes=4096))
    put("psm states/acts", lambda: R.predict_step_memory(
        10_000_000, 4, 3, layer_params=500_000, scanned=True, hidden=256, batch=4, seq=128,
        layers=8, vocab=1000, heads=8, states=123456789, activations=98765,
        intermediate_bytes=2, collective_bytes=77777))

    configs = {
        "gpt": GPTConfig(vocab=512, seq=128, layers=4, hidden=128, heads=4),
        "gpt-bf16-xla": GPTConfig(vocab=512, seq=256, layers=3, hidden=64, heads=4,
                                  dtype=jnp.bfloat16, attention="xla"),
        "gpt-noscan": GPTConfig(vocab=512, seq=128, layers=3, hidden=64, heads=4,
                                scan=False),
        "gpt-vt": GPTConfig(vocab=512, seq=128, layers=2, hidden=64, heads=4, vocab_tiles=4),
        "gpt-blockwise": GPTConfig(vocab=512, seq=256, layers=2, hidden=64, heads=4,
                                   attention="blockwise", attn_block=64),
        "llama-dc": P.PRESETS["llama3-8b"].config(512, jnp.bfloat16, "xla"),
        "llama-dc-small": R.DecoderConfig(vocab=256, seq=128, layers=2, hidden=64, heads=4,
                                          kv_heads=2, mlp_hidden=160, gated=True,
                                          tied=False, positions=0, norm="rmsnorm",
                                          bias=False),
    }
    for (name, cfg), mp, policy, sp, tiles, plat in itertools.product(
            configs.items(), (1, 2), (None, "full", "partitioned", "partitioned_host",
                                      "dots", "qkv_proj", "none"),
            (1, 2), (None, 2), ("gpu", "cpu")):
        put(f"phases {name} mp{mp} {policy} sp{sp} t{tiles} {plat}",
            lambda: R.gpt_phases(cfg, 2, mp=mp, remat_policy=policy, seq_parallel=sp,
                                 mlp_tiles=tiles, platform=plat))
    adam = optax.adam(1e-3)
    for (name, cfg), stage, opts in itertools.product(
            configs.items(), (0, 1, 2, 3),
            ({}, {"offload_optimizer": True}, {"remat_policy": "dots"},
             {"remat_policy": "partitioned", "mp": 2}, {"seq_parallel": 2, "mlp_tiles": 2},
             {"param_dtype": jnp.bfloat16}, {"accum_steps": 2},
             {"offload_optimizer": True, "offload_params": True, "dp": 1},
             {"offload_optimizer": "nvme"}, {"prefetch": False}, {"replicas": 2, "hpz": True},
             {"platform": "cpu"}, {"dp": 1, "offload_optimizer": True},
             {"replicas": 2, "hpz": True})):
        o = dict(opts)
        dp = o.pop("dp", 4)
        if "offload_params" in o and stage != 3:
            continue
        put(f"step {name} s{stage} dp{dp} {sorted(opts.items(), key=str)}",
            lambda: R.gpt_step_prediction(cfg, dp, stage, 8, tx=adam, **o))

    params = jax.eval_shape(GPT(configs["gpt"]).init, jax.random.PRNGKey(0),
                            jnp.zeros((1, 8), jnp.int32))
    for stage, opts in itertools.product(
            (0, 1, 2, 3), ({}, {"param_dtype": jnp.bfloat16}, {"offload_optimizer": True},
                           {"offload_optimizer": "nvme"}, {"mp": 2}, {"replicas": 2, "hpz": True},
                           {"min_shard_size": 10_000}, {"reduce_dtype": jnp.bfloat16},
                           {"loss_scale": "dynamic", "param_dtype": jnp.float16},
                           {"offload_optimizer": True, "offload_params": True})):
        for txname, tx in (("adam", adam), ("sgd", optax.sgd(0.1))):
            put(f"state {stage} {txname} {sorted(opts.items(), key=str)}",
                lambda: state_bytes(params, 4, stage, tx=tx, **opts))

    # plan(): the paper's formula and the flax-model form
    for stage_set, dp, mp, bucket in itertools.product(((0, 1, 2, 3), (1, 3)), (1, 8, 64),
                                                       (1, 2), (None, 1000)):
        put(f"plan psi {stage_set} dp{dp} mp{mp} b{bucket}",
            lambda: P.plan(7_500_000_000, dp=dp, budget_bytes=32 * 10**9, mp=mp,
                           stages=stage_set, bucket_size=bucket))
    put("plan nopsi", lambda: P.plan(dp=8, budget_bytes=32 * 10**9))
    put("plan buffers", lambda: P.plan(10**9, dp=8, budget_bytes=32 * 10**9,
                                       buffer_bytes=5 * 10**8, activation_bytes=10**9,
                                       reserve_bytes=10**8, optimizer_bytes=4))
    put("plan bad buffers", lambda: P.plan(10**9, dp=8, budget_bytes=32 * 10**9,
                                           buffer_bytes=-1))
    put("plan no room", lambda: P.plan(10**9, dp=8, budget_bytes=10**6,
                                       activation_bytes=10**7))
    put("plan flax", lambda: P.plan(model=GPT(configs["gpt"]), batch=jnp.zeros((8, 128), jnp.int32),
                                    dp=8, budget_bytes=10**9))
    put("plan bad", lambda: P.plan(1, dp=0, budget_bytes=1))
    put("plan both", lambda: P.plan(1, model="llama2-7b", dp=8, budget_bytes=1))

    # plan_model: presets x option sets (every row is a stage x offload set)
    GB = 10**9
    for preset, devices, extra in itertools.product(
            ("gpt2-124m", "gpt3-6.7b", "llama2-7b", "llama3-8b", "llama2-70b"), (1, 8, 64),
            ({}, {"attention": "xla"}, {"seq_parallel": 2}, {"seq_parallel": 4, "tiled_mlp": True},
             {"remat_policy": "partitioned", "mp": 2}, {"remat_policy": "dots"},
             {"remat_policy": "partitioned_host"}, {"attention": "blockwise"},
             {"seq_parallel": 2, "attention": "blockwise"}, {"offload_optimizer": True},
             {"bucket_size": 10**7, "accum_steps": 2}, {"devices_per_node": 8},
             {"disk_bytes": 2 * 10**12, "host_memory_bytes": 10**11})):
        if devices == 1 and extra.get("seq_parallel"):
            continue
        put(f"plan_model {preset} d{devices} {sorted(extra.items(), key=str)}",
            lambda: P.plan_model(preset, devices=devices, budget_bytes=60 * GB,
                                 seq=1024 if preset.startswith("gpt2") else 2048,
                                 batch=2, **extra))
    put("plan_model largest", lambda: P.plan_model(None, devices=8, budget_bytes=60 * GB,
                                                   seq=2048, batch=1, largest=True))
    put("plan_model largest llama", lambda: P.plan_model("llama2-7b", devices=8,
                                                         budget_bytes=60 * GB, seq=2048,
                                                         batch=1, largest=True))
    put("plan_model largest mp", lambda: P.plan_model(None, devices=8, budget_bytes=60 * GB,
                                                      seq=2048, batch=1, largest=True, mp=2))
    put("plan_model largest bad vocab", lambda: P.plan_model(
        None, devices=8, budget_bytes=60 * GB, seq=2048, batch=1, largest=True, mp=2,
        vocab=50305))
    put("plan_model nodes", lambda: P.plan_model("llama2-7b", devices=12, budget_bytes=GB,
                                                 seq=2048, batch=1, devices_per_node=8))
    put("plan_model bad disk", lambda: P.plan_model("llama2-7b", devices=8, budget_bytes=GB,
                                                    seq=2048, batch=1, disk_bytes=0))
    put("plan() model", lambda: P.plan(model="llama3-8b", dp=8, budget_bytes=60 * GB, seq=4096,
                                       batch=1))
    put("plan_model bad sp", lambda: P.plan_model("llama2-7b", devices=8, budget_bytes=GB,
                                                  seq=2048, batch=1, seq_parallel=3))

    # the CLI's text
    from zerojax.cli import main
    for argv in (["--model", "llama2-7b", "--devices", "8"],
                 ["--model", "gpt2-1.5b", "--devices", "64", "--seq", "1024"],
                 ["--model", "llama3-8b", "--devices", "8", "--seq-parallel", "4",
                  "--seq", "32768"],
                 ["--model", "llama3-8b", "--devices", "8", "--largest-seq"],
                 ["--largest", "--devices", "8"],
                 ["--params", "7.5B", "--devices", "64"],
                 ["--layers", "8", "--hidden", "512", "--heads", "8", "--devices", "4",
                  "--remat-policy", "partitioned", "--mp", "2"]):
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
            try:
                main(["plan", "--memory", "80GB", *argv])
            except SystemExit as e:
                buf.write(f"exit {e.code}")
        out["cli " + " ".join(argv)] = buf.getvalue()
    return out


if __name__ == "__main__":
    mode, path = sys.argv[1], sys.argv[2]
    got = cases()
    if mode == "record":
        json.dump(got, open(path, "w"), indent=0)
        errs = sum(v.startswith("ERROR") for v in got.values())
        print(f"recorded {len(got)} cases ({errs} errors as results) to {path}")
    else:
        want = json.load(open(path))
        diff = [k for k in want if want[k] != got.get(k)]
        print(f"compared {len(want)} cases: {len(want) - len(diff)} equal, {len(diff)} differ")
        for k in diff[:20]:
            print("DIFF", k, "\n  was", want[k][:600], "\n  now", str(got.get(k))[:600])
        sys.exit(1 if diff or set(got) != set(want) else 0)
