"""Checkpoints: an orbax ``CheckpointManager`` behind a small, trainer-shaped API.

``Checkpointer(directory, every=N, keep=K)`` saves the train state (any pytree of arrays) plus a JSON
``meta`` dict every ``N`` steps (and whenever ``force=True``, e.g. at exit) and keeps the last ``K``
complete checkpoints. ``restore(target)`` returns ``(state, meta)`` with ``target``'s tree structure,
dtypes and shardings. ``read_meta(directory)`` / ``latest_step(directory)`` are for tools that only need
the meta (an eval command rebuilding the model from the saved config) and create no manager.

On-disk layout (one directory per step, orbax's standard names)::

    <directory>/<step>/commit_success.txt      written by orbax just before the step is committed
    <directory>/<step>/state/...               orbax StandardSave (OCDBT/tensorstore) of the leaves
    <directory>/<step>/meta/metadata           orbax JsonSave of ``meta``

What guarantees that a checkpoint interrupted mid-write is never taken as valid
--------------------------------------------------------------------------------
* orbax (0.12.8, local/POSIX filesystems: ``AtomicRenameTemporaryPath``) writes a step into
  ``<directory>/<step>.orbax-checkpoint-tmp``; only when every item has been written and finalized does
  it write ``commit_success.txt`` into that directory and then ``rename`` it to ``<directory>/<step>``.
  A POSIX rename is atomic, so ``<directory>/<step>`` either does not exist or is complete. (On GCS orbax
  uses ``CommitFileTemporaryPath`` instead: it writes in place and ``commit_success.txt`` is the last
  file written.)
* This module lists steps itself (``_complete_steps``) and only counts a directory whose name is a plain
  integer *and* that contains ``commit_success.txt``. That holds under both orbax atomicity modes, so a
  killed save is invisible whatever it left behind: a ``*.orbax-checkpoint-tmp`` directory (rename mode)
  or a step directory without the marker (commit-file mode). ``restore(step=None)`` therefore falls back
  to the previous complete step. The manager itself is given the same rule (``step_name_format`` whose
  validation class is ``CommitFileTemporaryPath``, i.e. "finalized = has the marker"; writing still uses
  the tmp-dir + rename), so orbax's own step list - used for ``max_to_keep`` and "step exists" - agrees
  with ours.
* Leftovers do not break later saves: the manager is created with ``cleanup_tmp_directories=True``
  (orbax deletes ``*.orbax-checkpoint-tmp`` directories when the trainer's ``Checkpointer`` starts), and
  orbax also removes a stale tmp directory of the step it is about to write.
* Saves are synchronous (``enable_async_checkpointing=False`` plus ``wait_until_finished()``):
  ``save`` returns only after the rename, so "save returned True" means "durable on disk".
  ``tests/test_checkpoint.py`` checks this by SIGKILLing a real save in a subprocess right before the
  commit (all array data already written) and then resuming.

How the state is stored (and why the trainer can pass its state as-is)
----------------------------------------------------------------------
The state is not handed to orbax as its own Python object tree. It is flattened with
``jax.tree_util.tree_flatten_with_path`` and saved as a *nested dict of plain strings* built from the key
paths (``DictKey`` -> the key, ``SequenceKey`` -> the index, ``GetAttrKey`` -> the attribute name), e.g.
``{"opt_state": {"0": {"mu": {"kernel": {"value": ...}}}}, "step": ...}``. On restore the saved leaves
are read into that same nested-dict layout (with abstract targets carrying the target's shapes, dtypes and
shardings) and put back into the caller's structure with ``jax.tree.unflatten(treedef_of_target, ...)``.
So any pytree node type round-trips - dicts, tuples, namedtuples, optax's empty states (they have no
leaves, they come back from the target's treedef), flax struct dataclasses, ``nnx.State`` - and the files
do not depend on Python classes (readable without flax/optax). The price: renaming a field changes the
saved key, which is reported as a mismatch (see below) rather than silently mis-assigned.

Quirks the trainer must know
----------------------------
* **PRNG keys**: typed keys (``jax.random.key(...)``, dtype ``key<fry>``) cannot be saved; ``save``
  raises ``TypeError`` naming the leaf. Store ``jax.random.key_data(key)`` (uint32) in the state and
  rebuild with ``jax.random.wrap_key_data`` after restore. Raw ``PRNGKey`` uint32 arrays are fine.
* **Shardings**: each restored leaf gets the sharding of its target leaf (``jax.Array`` -> its
  ``.sharding``; ``jax.ShapeDtypeStruct(..., sharding=...)`` -> that sharding), so a state saved on one
  mesh can be restored onto another (orbax reads only the needed slices). A ``ShapeDtypeStruct`` without
  sharding is placed on ``jax.devices()[0]`` (jax's default placement). A NumPy target leaf comes back as
  a NumPy array. Build targets with ``jax.eval_shape`` + shardings to avoid allocating the state twice.
* **dtypes**: the result has the target's dtypes; if a target dtype differs from the saved one orbax
  casts (e.g. restoring float32 params as bfloat16 for eval). Same dtypes => bit-identical arrays.
* **Mismatches**: missing / unexpected leaves or different shapes raise ``ValueError`` listing the
  differing key paths (``restore`` compares against orbax's saved tree metadata before reading any data).
* **Checkpoints from before the layer scan**: a target leaf stacked over the decoder layers
  (``.../layers/<rest>``, ``[num_layers, ...]``) that the checkpoint holds one leaf per layer
  (``.../layers/0/<rest>``, ...; written before the layers were stacked) is read layer by layer and
  stacked, parameters and optimizer moments alike, so old runs resume and evaluate unchanged.
* **meta** goes through JSON: it is normalised at save time (``json.loads(json.dumps(meta))``) so what
  ``restore`` returns equals what was saved up to JSON's rules - tuples become lists, dict keys become
  strings. NumPy / 0-d jax scalars are converted to Python numbers; anything else non-JSON raises
  ``TypeError`` before anything is written. Python ``random.getstate()`` (tuples) comes back as lists:
  convert back with ``tuple`` when restoring it.
* **Steps**: saving a step that already exists (complete) is skipped and returns False. Steps need not
  be multiples of ``every`` when ``force=True``. ``keep`` counts complete checkpoints; orbax deletes the
  oldest ones after each save.
* **Multi-process**: ``CheckpointManager`` must be created and called on every process of the job;
  tools (eval) should use ``read_meta`` / ``latest_step`` (no manager; safe while training writes).
* **Logging**: orbax logs a lot at INFO through absl. A filter on the ``absl`` logger drops orbax's
  records below WARNING; nothing else (root logger, other absl users) is touched.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint.checkpoint_manager import StepAlreadyExistsError

__all__ = ["Checkpointer", "latest_step", "read_meta", "COMMIT_MARKER"]

# orbax writes this file into a step directory right before committing it (both atomicity modes).
COMMIT_MARKER = "commit_success.txt"
_STATE = "state"
_META = "meta"


# ------------------------------------------------------------------------------------------ logging
class _QuietOrbax(logging.Filter):
    """Drops orbax's absl records below WARNING; leaves every other record alone."""

    def filter(self, record: logging.LogRecord) -> bool:
        path = (record.pathname or "").replace("\\", "/")
        if "/orbax/" in path and "is read only" in str(record.msg):
            return False  # what read_only=True asked for (evaluation), not a problem
        if record.levelno >= logging.WARNING:
            return True
        return "/orbax/" not in path


def _quiet_orbax_logging() -> None:
    logger = logging.getLogger("absl")
    if not any(type(f).__name__ == "_QuietOrbax" for f in logger.filters):  # survives reloads
        logger.addFilter(_QuietOrbax())


_quiet_orbax_logging()


# ------------------------------------------------------------------------------------------ paths
def _abs_dir(directory: str | os.PathLike) -> Path:
    return Path(os.path.abspath(os.fspath(Path(directory).expanduser())))


def _complete_steps(directory: Path) -> list[int]:
    """Sorted steps with a committed checkpoint: integer-named dir containing the commit marker."""
    if not directory.is_dir():
        return []
    steps = []
    for entry in directory.iterdir():
        name = entry.name
        if name.isdigit() and entry.is_dir() and (entry / COMMIT_MARKER).is_file():
            steps.append(int(name))
    return sorted(steps)


def latest_step(directory: str | os.PathLike) -> int | None:
    """Newest complete checkpoint step in ``directory``, or None (also when it does not exist)."""
    steps = _complete_steps(_abs_dir(directory))
    return steps[-1] if steps else None


def _resolve_step(directory: Path, step: int | None) -> int:
    steps = _complete_steps(directory)
    if step is None:
        if not steps:
            raise FileNotFoundError(f"no complete checkpoint in {directory}")
        return steps[-1]
    step = int(step)
    if step not in steps:
        raise FileNotFoundError(
            f"no complete checkpoint for step {step} in {directory} (complete steps: {steps or 'none'})")
    return step


def read_meta(directory: str | os.PathLike, step: int | None = None) -> dict:
    """The ``meta`` dict of ``step`` (None = latest complete) without touching the state arrays."""
    directory = _abs_dir(directory)
    step = _resolve_step(directory, step)
    with ocp.Checkpointer(ocp.JsonCheckpointHandler()) as ckptr:
        return ckptr.restore(directory / str(step) / _META, args=ocp.args.JsonRestore())


# ------------------------------------------------------------------------------------------ trees
def _key_str(k: Any) -> str:
    if isinstance(k, jax.tree_util.DictKey):
        return str(k.key)
    if isinstance(k, jax.tree_util.SequenceKey):
        return str(k.idx)
    if isinstance(k, jax.tree_util.GetAttrKey):
        return str(k.name)
    if isinstance(k, jax.tree_util.FlattenedIndexKey):
        return str(k.key)
    return str(k)


def _flat(tree: Any) -> tuple[list[tuple[str, ...]], list[Any], Any]:
    """(key paths as string tuples, leaves, treedef)."""
    with_path, treedef = jax.tree_util.tree_flatten_with_path(tree)
    # a state that is a single bare leaf is stored under the key "_" (orbax wants a tree at the top)
    keys = [tuple(_key_str(k) for k in path) or ("_",) for path, _ in with_path]
    return keys, [leaf for _, leaf in with_path], treedef


def _show(key: tuple[str, ...]) -> str:
    return "/".join(key) if key else "<root>"


def _nest(keys: list[tuple[str, ...]], leaves: list[Any]) -> Any:
    """Nested dict {k0: {k1: leaf}} from string key paths."""
    root: dict = {}
    for key, leaf in zip(keys, leaves):
        node = root
        for part in key[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ValueError(f"state key path {_show(key)!r} collides with a leaf at {part!r}")
            node = child
        if key[-1] in node:
            raise ValueError(
                f"two state leaves map to the same checkpoint key {_show(key)!r} (their key paths are "
                "equal as strings); rename one of them")
        node[key[-1]] = leaf
    return root


def _unnest(nested: Any, keys: list[tuple[str, ...]]) -> list[Any]:
    out = []
    for key in keys:
        node = nested
        for part in key:
            node = node[part]
        out.append(node)
    return out


def _saved_leaves(tree: Any, prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
    """Flattens orbax's saved tree metadata (nested dicts/lists) to {key path: leaf metadata}."""
    out: dict[tuple[str, ...], Any] = {}
    if isinstance(tree, dict):
        for k, v in tree.items():
            out.update(_saved_leaves(v, prefix + (str(k),)))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            out.update(_saved_leaves(v, prefix + (str(i),)))
    elif tree is not None:
        out[prefix] = tree
    return out


def _is_prng_key(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def _abstract_leaf(leaf: Any) -> Any:
    """What orbax should restore this target leaf as (shape, dtype, sharding / numpy)."""
    if isinstance(leaf, jax.Array):
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=leaf.sharding)
    if isinstance(leaf, jax.ShapeDtypeStruct):
        sharding = leaf.sharding
        if sharding is None:
            sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)
    if isinstance(leaf, (np.ndarray, np.generic)):
        return np.asarray(leaf)
    if isinstance(leaf, (bool, int, float, complex)):
        return np.asarray(leaf)
    raise TypeError(f"unsupported restore target leaf of type {type(leaf).__name__}")


def _per_layer_keys(saved: dict, keys: list, abstract: list) -> dict:
    """Target leaves stacked along the decoder layers (``.../layers/<rest>``, ``[L, ...]``) that
    the checkpoint holds one per layer (``.../layers/<i>/<rest>``, as checkpoints written before
    the layers were stacked for the layer scan do): ``{target index: [per-layer keys]}``."""
    out = {}
    for i, (key, leaf) in enumerate(zip(keys, abstract)):
        if key in saved or "layers" not in key or not np.ndim(leaf):
            continue
        j = key.index("layers")
        per = [key[:j + 1] + (str(n),) + key[j + 1:] for n in range(np.shape(leaf)[0])]
        if all(p in saved for p in per):
            out[i] = per
    return out


def _layer_slice(leaf: Any) -> Any:
    """The abstract leaf of one layer of a stacked target leaf (its first axis dropped)."""
    if isinstance(leaf, np.ndarray):
        return np.asarray(leaf[0])
    sharding = leaf.sharding
    if isinstance(sharding, jax.sharding.NamedSharding):
        spec = tuple(sharding.spec) + (None,) * (len(leaf.shape) - len(sharding.spec))
        sharding = jax.sharding.NamedSharding(sharding.mesh,
                                              jax.sharding.PartitionSpec(*spec[1:]))
    return jax.ShapeDtypeStruct(leaf.shape[1:], leaf.dtype, sharding=sharding)


def _stack_like(parts: list, leaf: Any) -> Any:
    """The per-layer arrays ``parts`` stacked into the target leaf's shape and placement."""
    if isinstance(leaf, np.ndarray):
        return np.stack([np.asarray(p) for p in parts])
    return jax.device_put(jnp.stack(parts), leaf.sharding)


# ------------------------------------------------------------------------------------------ meta
def _json_default(obj: Any) -> Any:
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, (np.ndarray, jax.Array)) and obj.ndim == 0 and not _is_prng_key(obj):
        return np.asarray(obj).item()
    raise TypeError(f"meta value of type {type(obj).__name__} is not JSON-serialisable: {obj!r}")


def _normalise_meta(meta: dict) -> dict:
    if not isinstance(meta, dict):
        raise TypeError(f"meta must be a dict, got {type(meta).__name__}")
    try:
        text = json.dumps(meta, default=_json_default)
    except (TypeError, ValueError) as e:
        raise TypeError(f"checkpoint meta is not JSON-serialisable: {e}") from None
    return json.loads(text)


# ------------------------------------------------------------------------------------------ manager
class Checkpointer:
    """Orbax-backed: every `every` steps and at exit, keeps the last `keep`."""

    def __init__(self, directory: str | os.PathLike, *, every: int, keep: int,
                 read_only: bool = False):
        """``read_only``: for readers (evaluation) of a directory a live run may be writing:
        nothing is created or cleaned up (orbax would delete the run's in-flight save) and
        ``save`` refuses."""
        every, keep = int(every), int(keep)
        if keep < 1:
            raise ValueError(f"keep must be >= 1 (number of checkpoints to keep), got {keep}")
        self.directory = _abs_dir(directory)
        self.every = every
        self.keep = keep
        self.read_only = bool(read_only)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=None if read_only else keep,
            create=not read_only,
            read_only=read_only,
            enable_async_checkpointing=False,
            cleanup_tmp_directories=not read_only,
            save_interval_steps=0 if read_only else 1,  # the decision is ours (should_save / force)
            # orbax lists a step only if its directory holds the commit marker (the check it uses for
            # GCS); writing still goes through the default tmp-dir + atomic rename on local disks. This
            # keeps orbax's step list (max_to_keep, "step exists") equal to `_complete_steps`.
            step_name_format=ocp.step.standard_name_format(
                temporary_path_cls=ocp.path.atomicity.CommitFileTemporaryPath),
        )
        self._manager = ocp.CheckpointManager(self.directory, options=options)
        self._closed = False

    # -------------------------------------------------------------------- queries
    def should_save(self, step: int) -> bool:
        return self.every > 0 and int(step) % self.every == 0

    def all_steps(self) -> list[int]:
        return _complete_steps(self.directory)

    def latest_step(self) -> int | None:
        steps = self.all_steps()
        return steps[-1] if steps else None

    # -------------------------------------------------------------------- save
    def reload(self) -> None:
        """Re-reads the step list from disk (after step directories were moved aside)."""
        self._check_open()
        self._manager.reload()

    def save(self, step: int, state: Any, meta: dict, *, force: bool = False) -> bool:
        self._check_open()
        if self.read_only:
            raise RuntimeError(f"Checkpointer for {self.directory} is read-only")
        step = int(step)
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        if not (force or self.should_save(step)):
            return False
        if step in self.all_steps():
            return False
        keys, leaves, _ = _flat(state)
        if not leaves:
            raise ValueError("state has no array leaves; nothing to checkpoint")
        for key, leaf in zip(keys, leaves):
            if _is_prng_key(leaf):
                raise TypeError(
                    f"state leaf {_show(key)!r} is a typed PRNG key ({leaf.dtype}); store "
                    "jax.random.key_data(key) instead and rebuild it with jax.random.wrap_key_data")
        nested = _nest(keys, leaves)
        meta = _normalise_meta(meta)
        try:
            saved = self._manager.save(
                step,
                args=ocp.args.Composite(**{_STATE: ocp.args.StandardSave(nested),
                                           _META: ocp.args.JsonSave(meta)}),
                force=True,
            )
        except StepAlreadyExistsError:
            # orbax's own record says so (e.g. a racing writer); treat like an existing step
            return False
        self._manager.wait_until_finished()
        return bool(saved)

    # -------------------------------------------------------------------- restore
    def restore(self, target: Any, step: int | None = None) -> tuple[Any, dict]:
        self._check_open()
        step = _resolve_step(self.directory, step)
        keys, leaves, treedef = _flat(target)
        for key, leaf in zip(keys, leaves):
            if _is_prng_key(leaf):
                raise TypeError(
                    f"target leaf {_show(key)!r} is a typed PRNG key; checkpoints hold key_data "
                    "(uint32): use jax.random.key_data in the target, wrap_key_data after restore")
        abstract = [_abstract_leaf(leaf) for leaf in leaves]
        saved = self._saved_leaves(step)
        per_layer = _per_layer_keys(saved, keys, abstract)
        read_keys, read_abstract = [], []
        for i, (key, leaf) in enumerate(zip(keys, abstract)):
            if i in per_layer:
                read_keys += per_layer[i]
                read_abstract += [_layer_slice(leaf)] * len(per_layer[i])
            else:
                read_keys.append(key)
                read_abstract.append(leaf)
        self._check_compatible(step, read_keys, read_abstract, saved)
        nested_target = _nest(read_keys, read_abstract)
        restored = self._manager.restore(
            step,
            args=ocp.args.Composite(**{_STATE: ocp.args.StandardRestore(nested_target),
                                       _META: ocp.args.JsonRestore()}),
        )
        new_leaves = []
        for i, (key, leaf) in enumerate(zip(keys, abstract)):
            if i in per_layer:  # a checkpoint from before the decoder layers were stacked
                parts = _unnest(restored[_STATE], per_layer[i])
                new_leaves.append(_stack_like(parts, leaf))
            else:
                new_leaves += _unnest(restored[_STATE], [key])
        state = jax.tree_util.tree_unflatten(treedef, new_leaves)
        return state, restored[_META]

    def _saved_leaves(self, step: int) -> dict:
        meta = ocp.StandardCheckpointHandler().metadata(self.directory / str(step) / _STATE)
        return _saved_leaves(getattr(meta, "tree", meta))

    def _check_compatible(self, step: int, keys: list[tuple[str, ...]], abstract: list[Any],
                          saved: dict) -> None:
        path = self.directory / str(step) / _STATE
        wanted = dict(zip(keys, abstract))
        missing = [k for k in keys if k not in saved]
        unexpected = [k for k in saved if k not in wanted]
        shapes = [
            (k, tuple(saved[k].shape), tuple(np.shape(wanted[k])))
            for k in keys
            if k in saved and getattr(saved[k], "shape", None) is not None
            and tuple(saved[k].shape) != tuple(np.shape(wanted[k]))
        ]
        if not (missing or unexpected or shapes):
            return

        def listing(items: list[str]) -> str:
            head = ", ".join(items[:10])
            return head + (f", ... ({len(items) - 10} more)" if len(items) > 10 else "")

        parts = []
        if missing:
            parts.append(f"in target but not in checkpoint: {listing([_show(k) for k in missing])}")
        if unexpected:
            parts.append(f"in checkpoint but not in target: {listing([_show(k) for k in unexpected])}")
        if shapes:
            parts.append("shape differs (checkpoint vs target): "
                         + listing([f"{_show(k)} {s} vs {t}" for k, s, t in shapes]))
        raise ValueError(
            f"checkpoint {path.parent} does not match the restore target "
            f"({len(saved)} saved leaves, {len(keys)} target leaves): " + "; ".join(parts))

    # -------------------------------------------------------------------- lifecycle
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"Checkpointer for {self.directory} is closed")

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._manager.wait_until_finished()
            self._manager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Checkpointer({str(self.directory)!r}, every={self.every}, keep={self.keep})"

