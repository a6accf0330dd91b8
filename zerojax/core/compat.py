"""The one place zerojax reads what JAX and XLA print or store in a form that changed
between the versions zerojax supports (jax 0.10.2 through 0.12).

Everything that reads a jaxpr's equation parameters or a compiled program's HLO text
for a detail whose form moved goes through here. Each function tests for the form it
finds rather than for a version string, so a new JAX that keeps either form works.

- :data:`CALL_PRIMITIVES` / :data:`REMAT_PRIMITIVES`: the names a nested ``jit`` call
  and a ``jax.checkpoint`` have had as jaxpr primitives (``pjit`` became ``jit``;
  ``checkpoint`` is ``remat2``'s printed name in older jax).
- :func:`scan_counts`: a ``scan`` equation's const and carry operand counts.
  Up to jax 0.10 they are ``num_consts`` and ``num_carry``; from jax 0.11 the
  parameter ``ft_in`` is a flat tree of ``(consts, carry, xs)``.
- :func:`replica_groups` / :func:`replica_group_size`: the device groups of a
  collective, in every format XLA prints them:

  - explicit lists ``{{0,1},{2,3}}`` (``{}``: one group of every device);
  - iota lists ``[2,4]<=[8]`` and ``[2,4]<=[4,2]T(1,0)`` (jax 0.10's usual form);
  - mesh-based ``mesh['data'=4,'model'=2] {'data'}`` (jax 0.11+ with Shardy), optionally
    with ``device_ids=...`` (a list or an iota) and sub-axes ``{'data':(1)2}``.

- :func:`memory_kinds` / :func:`to_memory_space`: the memory kinds a device offers
  (``device.addressable_memories()``; ``device``, ``pinned_host`` and
  ``unpinned_host`` on CPU and GPU) and moving a value between them inside ``jit``
  (``jax.memory.Space``, jax 0.6+; before it, ``TransferToMemoryKind``);
  :func:`in_host_memory`: whether a traced value lives in host memory.

- :func:`psum_scatter`: ``jax.lax.psum_scatter`` inside a ``shard_map`` manual over
  ``data`` only, on a mesh whose other axes are Explicit (``jax.make_mesh``'s default):
  jax 0.12's reduce-scatter lowering types its reducer's scalar with the operand's
  sharding and fails there ("Length of sharding.spec (2) must be equal to aval's ndim
  (0)"; its all-reduce lowering resets it), so the collective runs with those axes
  Auto; :func:`needs_auto_scatter` says when. jax 0.12.1 lowers the plain collective
  (checked 2026-12-07); the shim stays for the 0.11-0.12.0 releases in the supported
  range, with the same bits on every version.

- :func:`restate_custom_call` / :func:`restate_contexts`: a recorded ``custom_jvp_call``
  / ``custom_vjp_call`` (``cond``, ``while``) bound again on another mesh. Its jaxpr's
  equations carry the abstract mesh they were traced under in their contexts, which
  JAX re-enters, and its rule's thunk traces on the avals it recorded; jax 0.12.1 made
  ``jax.nn.softmax`` a ``custom_jvp_call`` (``jax_softmax_custom_jvp`` default True), so
  Ulysses' attention manual over ``model`` failed ("context mesh (Auto, Auto, Manual)
  should match the aval mesh (Manual, Manual, Manual)"). Plain JAX: trace
  ``jax.nn.softmax`` under ``use_abstract_mesh`` of an Auto (8,) ``data`` mesh, bind its
  equations in a ``shard_map`` over ``data`` under ``eqn.ctx.manager`` and
  ``use_abstract_mesh(<the body's mesh>)``: jax 0.12.1's one ``custom_jvp_call`` raises
  it at ``reduce_max``; jax 0.10.2's plain equations run. Restated, the same rule and
  equations run.
- :func:`device_put`: ``jax.device_put`` of a ``jit`` output out of ``pinned_host``,
  which jax 0.12.1's CPU client refuses ("Unsupported layout used for PjRt CPU buffers:
  {2,1,0:S(5)}"; plain JAX: ``jax.device_put(jax.jit(f, out_shardings=<pinned_host
  sharding>)(), <device sharding>)``), made by a compiled identity there.

``tests/test_compat.py`` checks each against HLO text captured from jax 0.10.2 and
jax 0.12.1 (``tests/fixtures/hlo/``), so both forms are tested whichever JAX is installed.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

__all__ = ["CALL_PRIMITIVES", "REMAT_PRIMITIVES", "scan_counts", "replica_groups",
           "replica_groups_attr", "replica_group_size", "memory_kinds", "to_memory_space",
           "in_host_memory"]

# Jaxpr primitives that call a closed sub-jaxpr and are evaluated by inlining it: a
# nested jax.jit ("pjit" until jax 0.7, "jit" since), and the older call primitives.
CALL_PRIMITIVES = frozenset({"jit", "pjit", "closed_call", "core_call"})
# jax.checkpoint / flax nn.remat: "checkpoint" (its name in jaxprs) and "remat2".
REMAT_PRIMITIVES = frozenset({"checkpoint", "remat2"})


def scan_counts(params: Mapping[str, Any]) -> tuple[int, int]:
    """``(num_consts, num_carry)`` of a ``scan`` equation's ``params``.

    >>> nc, nk = scan_counts(eqn.params)
    >>> consts, carry, xs = eqn.invars[:nc], eqn.invars[nc:nc + nk], eqn.invars[nc + nk:]
    """
    if "num_consts" in params and "num_carry" in params:
        return int(params["num_consts"]), int(params["num_carry"])
    ft_in = params.get("ft_in")
    if ft_in is not None and hasattr(ft_in, "unpack"):
        consts, carry, _ = ft_in.unpack()
        return len(list(consts)), len(list(carry))
    raise KeyError(
        "A scan equation has neither num_consts/num_carry (jax <= 0.10) nor an ft_in flat "
        f"tree (jax 0.11+); its parameters are {sorted(params)}. This JAX's scan is not "
        "one zerojax knows: please report it with your jax version."
    )


# Each format once, with groups; _VALUE below matches any of them at a value's start.
_IOTA_TEXT = r"\[([\d,\s]+)\]<=\[([\d,\s]+)\](?:T\(([\d,\s]+)\))?"  # [2,4]<=[4,2]T(1,0)
_MESH_TEXT = (r"mesh\[([^\]]*)\]"                                   # mesh['data'=4,'model'=2]
              r"(?:\s*,\s*device_ids=\(((?:[^()]|\([^()]*\))*)\))?"    # , device_ids=(...)
              r"\s*\{([^}]*)\}")                                       # {'data'}, {'data':(1)2}
_MAXIMAL_TEXT = r"maximal_mesh\[device_id=(\d+)\]"
_EXPLICIT_TEXT = r"\{\s*(?:\{[\d,\s]*\}\s*,?\s*)*\}"                # {{0,1},{2,3}}, {}
_IOTA = re.compile("^" + _IOTA_TEXT)
_MESH = re.compile("^" + _MESH_TEXT)
_MAXIMAL = re.compile("^" + _MAXIMAL_TEXT)
_VALUE = re.compile("|".join(f"(?:{t})" for t in (_EXPLICIT_TEXT, _IOTA_TEXT, _MESH_TEXT,
                                                 _MAXIMAL_TEXT)))
_NAME = r"'?([^'=,\s\[\]{}():]+)'?"
_MESH_AXIS = re.compile(_NAME + r"\s*=\s*(\d+)")
_GROUP_AXIS = re.compile(_NAME + r"(?:\s*:\s*\((\d+)\)\s*(\d+))?")


def replica_groups_attr(attrs: str, key: str = "replica_groups") -> str:
    """The raw value of ``key=`` in an HLO instruction's attribute text, in any of the
    formats :func:`replica_groups` reads ("" when the attribute is absent). A mesh-based
    value may hold commas (``mesh[...], device_ids=(...) {...}``), so it is matched
    whole here rather than split at commas."""
    at = re.search(rf"(?:^|[\s,]){re.escape(key)}=", attrs)
    if at is None:
        return ""
    rest = attrs[at.end():]
    value = _VALUE.match(rest)
    if value is None:
        raise ValueError(
            f"Unknown {key} format {rest[:80]!r}: zerojax reads explicit lists "
            "({{0,1},{2,3}}), iota ([2,4]<=[8], [2,4]<=[4,2]T(1,0)) and mesh-based "
            "(mesh['data'=4,'model'=2] {'data'}) groups. Please report it with your jax version."
        )
    return value.group(0)


def _ints(text: str) -> list[int]:
    return [int(t) for t in re.findall(r"\d+", text)]


def _iota(match: re.Match) -> np.ndarray:
    """The array an iota tile assignment ``[shape]<=[dims]T(perm)`` describes."""
    shape, dims = _ints(match.group(1)), _ints(match.group(2))
    ids = np.arange(math.prod(dims)).reshape(dims)
    if match.group(3):
        ids = ids.transpose(_ints(match.group(3)))
    return ids.reshape(shape)


def replica_groups(text: str, num_devices: int) -> list[list[int]]:
    """The device groups of a collective's ``replica_groups=`` attribute value.

    ``num_devices`` is the module's device count (``num_partitions * replica_count``),
    used when the text names no groups (``{}`` or empty: every device in one group).
    Raises ``ValueError`` naming the text for a format it does not know.
    """
    text = text.strip()
    if text in ("", "{}"):
        return [list(range(num_devices))]
    if text.startswith("{"):
        groups = [_ints(g) for g in re.findall(r"\{([^{}]*)\}", text[1:-1])]
        return groups or [list(range(num_devices))]
    iota = _IOTA.match(text)
    if iota:
        ids = _iota(iota)
        return ids.reshape(-1, ids.shape[-1]).tolist()
    mesh = _MESH.match(text)
    if mesh:
        return _mesh_groups(text, mesh)
    maximal = _MAXIMAL.match(text)
    if maximal:
        return [[int(maximal.group(1))]]
    raise ValueError(
        f"Unknown replica_groups format {text[:80]!r}: zerojax reads explicit lists "
        "({{0,1},{2,3}}), iota ([2,4]<=[8], [2,4]<=[4,2]T(1,0)) and mesh-based "
        "(mesh['data'=4,'model'=2] {'data'}) groups. Please report it with your jax version."
    )


def _mesh_groups(text: str, mesh: re.Match) -> list[list[int]]:
    """Groups of a mesh-based list: the devices that differ only along the listed axes
    (or sub-axes), ordered as listed; XLA's ``MeshAxesReplicaGroupList``."""
    axes = [(name, int(size)) for name, size in _MESH_AXIS.findall(mesh.group(1))]
    if not axes:
        raise ValueError(f"No mesh axes in replica_groups {text[:80]!r}.")
    names = [name for name, _ in axes]
    sizes = dict(axes)
    refs = [(name, (int(pre), int(size)) if pre else None)
            for name, pre, size in _GROUP_AXIS.findall(mesh.group(3))]
    for name, _ in refs:
        if name not in sizes:
            raise ValueError(f"replica_groups {text[:80]!r} groups over {name!r}, which is "
                             f"not one of the mesh's axes {names}.")
    # Each mesh axis reshaped into the parts its references name; where each lands.
    dims: list[int] = []
    where: dict[int, int] = {}  # index in refs -> dimension of the reshaped mesh
    for name in names:
        mine = [i for i, (n, _) in enumerate(refs) if n == name]
        if not mine:
            dims.append(sizes[name])
        elif len(mine) == 1 and refs[mine[0]][1] is None:
            where[mine[0]] = len(dims)
            dims.append(sizes[name])
        else:
            covered = 1
            for i in sorted(mine, key=lambda i: refs[i][1][0]):
                pre, size = refs[i][1]
                if pre != covered:
                    dims.append(pre // covered)
                    covered = pre
                where[i] = len(dims)
                dims.append(size)
                covered *= size
            if covered != sizes[name]:
                dims.append(sizes[name] // covered)
    total = math.prod(sizes.values())
    if mesh.group(2) is None:
        ids = np.arange(total)
    else:
        iota = _IOTA.match(mesh.group(2).strip())
        ids = _iota(iota) if iota else np.array(_ints(mesh.group(2)))
    if ids.size != total:
        raise ValueError(f"replica_groups {text[:120]!r}: device_ids lists {ids.size} devices "
                         f"for a mesh of {total}.")
    grouped = [where[i] for i in range(len(refs))]
    order = [d for d in range(len(dims)) if d not in grouped] + grouped
    size = math.prod(dims[d] for d in grouped)
    return ids.reshape(dims).transpose(order).reshape(-1, size).tolist()


def replica_group_size(text: str, num_devices: int) -> int:
    """Devices per replica group (the largest, if they differ)."""
    return max(len(group) for group in replica_groups(text, num_devices))


def memory_kinds(device) -> frozenset[str]:
    """The memory kinds ``device`` can hold arrays in (``"device"``, ``"pinned_host"``,
    ``"unpinned_host"`` on the CPU and CUDA backends); empty where the runtime does not
    say."""
    try:
        return frozenset(m.kind for m in device.addressable_memories())
    except (AttributeError, NotImplementedError, RuntimeError):  # a runtime without them
        return frozenset()


def in_host_memory(x) -> bool:
    """Whether ``x`` (an array, or a tracer inside ``jit``) lives in host memory: its
    abstract value's memory space is ``Host`` (a ``pinned_host`` argument, or a
    value moved there), read from ``aval.memory_space`` (jax 0.10.2 and 0.12)."""
    aval = getattr(x, "aval", None)
    space = getattr(aval, "memory_space", None)
    return space is not None and getattr(space, "name", str(space)).lower().endswith("host")


def to_memory_space(x, host: bool):
    """``x`` moved to host memory (``pinned_host``) or to the device's own memory, its
    sharding kept: inside ``jit``, the placement XLA's host offloader turns into a
    transfer (a no-op when ``x`` is already there)."""
    space = getattr(jax, "memory", None)
    if space is not None and hasattr(space, "Space"):
        return jax.device_put(x, space.Space.Host if host else space.Space.Device)
    from jax._src.sharding_impls import TransferToMemoryKind  # jax < 0.6

    return jax.device_put(x, TransferToMemoryKind("pinned_host" if host else "device"))


def zeros_in_memory(shape, dtype, host: bool):
    """Inside ``jit``: zeros of ``shape`` to write pieces into (``dynamic_update_slice``),
    in host memory with ``host``. Made as ``jax.lax.scan`` makes its host-offloaded
    stacked outputs (``lax.empty2`` in host memory, broadcast; no placement
    annotation): XLA's host offloader turns that broadcast into a buffer allocated in
    host memory (the GPU notes of 2026-11-28: an ``AllocateBuffer`` in ``S(5)``), where
    ``device_put`` of device zeros would make the zeros on the device and copy them."""
    import jax.numpy as jnp

    space = getattr(getattr(jax, "memory", None), "Space", None)
    try:
        from jax._src.lax.lax import empty2
    except ImportError:  # pragma: no cover - a JAX without it: device zeros, moved
        empty2 = None
    if not host:
        return jnp.zeros(shape, dtype)
    if empty2 is None or space is None:
        return to_memory_space(jnp.zeros(shape, dtype), host=True)
    return jax.lax.broadcast(empty2(jnp.dtype(dtype), memory_space=space.Host), tuple(shape))


def _explicit_axes(x) -> tuple:
    """The Explicit (non-manual) axes of the mesh ``x``'s type is on, inside ``jit``."""
    typeof = getattr(jax, "typeof", None)
    if typeof is None:  # pragma: no cover - a JAX without typed shardings
        return ()
    sharding = getattr(typeof(x), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or mesh.empty:
        return ()
    explicit = jax.sharding.AxisType.Explicit
    return tuple(a for a, t in zip(mesh.axis_names, mesh.axis_types) if t == explicit)


def needs_auto_scatter(x) -> bool:
    """Whether a reduce-scatter of ``x`` runs with its mesh's Explicit axes made Auto
    (:func:`psum_scatter`)."""
    return bool(_explicit_axes(x))


def psum_scatter(x, axis_name, *, scatter_dimension: int = 0, tiled: bool = False):
    """``jax.lax.psum_scatter(x, axis_name, scatter_dimension=..., tiled=...)``, the
    same collective and bits; where ``x``'s mesh has Explicit axes beside the manual
    ones (a ``shard_map`` over ``data`` of ``jax.make_mesh((4, 2), ("data",
    "model"))``) it runs inside ``jax.sharding.auto_axes`` over those axes, its result
    typed as ``x`` is (the scattered dimension shorter, or gone when not ``tiled``):
    jax 0.12 fails to lower it there (this module's docstring); jax 0.10.2 lowers both."""
    def scatter(v):
        return jax.lax.psum_scatter(v, axis_name, scatter_dimension=scatter_dimension,
                                    tiled=tiled)

    axes = _explicit_axes(x)
    if not axes:
        return scatter(x)
    sharding = jax.typeof(x).sharding
    spec = list(sharding.spec) + [None] * (x.ndim - len(sharding.spec))
    if not tiled:
        del spec[scatter_dimension]
    out = sharding.update(spec=jax.sharding.PartitionSpec(*spec))
    return jax.sharding.auto_axes(scatter, axes=axes, out_sharding=out)(x)


# Primitives whose ``call_jaxpr`` JAX evaluates again, equation by equation, each under
# the context it was traced in (``eqn.ctx``), when they are bound under a trace
# (``custom_jvp_call``: ``jax.nn.relu``, and ``jax.nn.softmax`` from jax 0.12.1).
RETRACED_PRIMITIVES = frozenset({"custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr"})


def restate_contexts(jaxpr, mesh, restate_param=None):
    """``jaxpr`` (a ``Jaxpr`` or ``ClosedJaxpr``; sub-jaxprs in its equations' params
    too, ``shard_map`` bodies excepted) with each equation's context restated under the
    abstract ``mesh``: its own ``compute_on`` type, xla metadata and configs, but
    ``mesh`` as the context mesh. An equation's context records the abstract mesh it
    was traced under (``JaxprEqnContext``, jax 0.10.2 and 0.12.1 alike), and JAX enters
    it when it evaluates a ``custom_jvp_call``'s jaxpr again; a loss traced under one
    mesh and evaluated in a ``shard_map`` body (another mesh: its axes manual) then
    fails ("context mesh ... should match the aval mesh"). ``restate_param`` maps each
    other param value (a sharding recorded on the tracing mesh: the caller's rule)."""
    from jax._src import core as jcore

    # ClosedJaxpr is a Jaxpr with consts from jax 0.12 (no class of its own)
    kinds = tuple(t for t in (jcore.Jaxpr, getattr(jcore, "ClosedJaxpr", None)) if t)

    def literal(v):  # a typed literal (-inf: f32[]) names the mesh it was traced under
        sharding = getattr(getattr(v, "aval", None), "sharding", None)
        if (not isinstance(v, jcore.Literal) or getattr(sharding, "mesh", mesh) == mesh
                or not hasattr(sharding, "update")):
            return v
        # jax 0.12's value is typed (its aval's mesh too): a plain array of its dtype
        val = np.asarray(v.val, dtype=v.aval.dtype) if hasattr(v.val, "dtype") else v.val
        return jcore.Literal(val, v.aval.update(sharding=sharding.update(mesh=mesh)))

    def restate(value):
        if type(value) in (tuple, list):  # not a NamedTuple (GatherDimensionNumbers)
            return type(value)(restate(v) for v in value)
        if not isinstance(value, kinds):
            return value if restate_param is None else restate_param(value)
        inner = getattr(value, "jaxpr", value)
        eqns = []
        for eqn in inner.eqns:
            with eqn.ctx.manager, jax.sharding.use_abstract_mesh(mesh):
                ctx = jcore.JaxprEqnContext()
            params = (eqn.params if eqn.primitive.name == "shard_map"
                      else {k: restate(v) for k, v in eqn.params.items()})
            eqns.append(eqn.replace(ctx=ctx, params=params,
                                    invars=[literal(v) for v in eqn.invars]))
        new = inner.replace(eqns=eqns)
        return new if inner is value else value.replace(jaxpr=new, consts=value.consts)

    return restate(jaxpr)


def restate_custom_call(eqn, mesh, restate_param=None) -> dict:
    """The params of a recorded ``custom_jvp_call`` / ``custom_vjp_call`` equation
    (:data:`RETRACED_PRIMITIVES`) to bind it again under the abstract ``mesh`` (a
    ``shard_map`` body's, where the loss was traced under another): its ``call_jaxpr``
    restated (:func:`restate_contexts`), and its rule's thunk (``jvp_jaxpr_fun``,
    ``fwd_jaxpr_thunk``), which traces the rule on the avals it recorded, run under
    the equation's own context (the mesh those avals name), its jaxpr then restated;
    ``restate_param`` as :func:`restate_contexts`'s.
    The same rule and primal equations run."""
    from jax._src import linear_util as lu

    def wrap(thunk):
        def call(*zeros):
            with eqn.ctx.manager:
                jaxpr, *rest = thunk.call_wrapped(*zeros)
            return (restate_contexts(jaxpr, mesh, restate_param), *rest)

        return lu.wrap_init(call, debug_info=thunk.debug_info)

    params = dict(eqn.params)
    for key, value in params.items():
        if key == "call_jaxpr":
            params[key] = restate_contexts(value, mesh, restate_param)
        elif key in ("jvp_jaxpr_fun", "jvp_jaxpr_thunk", "fwd_jaxpr_thunk"):
            params[key] = wrap(value)
    return params


def device_put(x, sharding):
    """``jax.device_put(x, sharding)`` for one array, ``x`` possibly a ``jit`` output in
    another memory kind. jax 0.12.1's CPU client keeps the memory space in the layout
    of a buffer a compiled program wrote to ``pinned_host`` (``{2,1,0:S(5)}``) and
    refuses to copy it to another memory kind ("UNIMPLEMENTED: Unsupported layout used
    for PjRt CPU buffers"; a ``device_put`` to ``pinned_host`` and back works, as every
    move on jax 0.10.2 does); that copy is made by a compiled identity with
    ``out_shardings=sharding`` instead: the same bits."""
    try:
        return jax.device_put(x, sharding)
    except jax.errors.JaxRuntimeError as e:
        if "Unsupported layout" not in str(e):
            raise
    return _identity(sharding)(x)


_IDENTITIES: dict = {}


def _identity(sharding):
    fn = _IDENTITIES.get(sharding)
    if fn is None:
        fn = _IDENTITIES[sharding] = jax.jit(lambda a: a, out_shardings=sharding)
    return fn
