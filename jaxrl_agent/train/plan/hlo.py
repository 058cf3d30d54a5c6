"""Reading a compiled program's HLO text: its collectives (static counts and result bytes,
``count_collectives``), how often each computation runs (``executions``: while loops' trip
counts applied) and the collective bytes it executes per run by the mesh axes they span
(``executed_collectives``). Pure text parsing; no JAX."""

from __future__ import annotations

import math
import re


COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")


_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
                "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8,
                "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1, "s4": 1, "u4": 1}


_OP = re.compile(r"=\s*(.*?)\s(" + "|".join(COLLECTIVES) + r")(-start)?\(")


_SHAPE = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]")


def _shape_bytes(text: str) -> list[int]:
    out = []
    for dtype, dims in _SHAPE.findall(text):
        if dtype not in _DTYPE_BYTES:
            continue
        out.append(_DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d))
    return out


_FUSED_RS = re.compile(r"=\s*(.*?)\sfusion\(.*calls=%?(all-reduce-scatter[\w.-]*)")


def count_collectives(hlo_text: str) -> dict:
    """``{op: {"count": n, "bytes": b, "max_bytes": m}}`` for every collective in the compiled
    HLO text: static op counts (an op in a loop body counts once), ``bytes`` the sum of the
    per-device result buffers (for an async ``*-start`` op the largest buffer of its tuple: the
    result), ``max_bytes`` the largest single one. The TPU compiler emits a reduce-scatter as a
    fusion calling an ``all-reduce-scatter`` computation (an all-reduce and a slice inside):
    that fusion counts as one reduce-scatter of its result, and the all-reduce inside it is
    not counted again."""
    out = {op: {"count": 0, "bytes": 0, "max_bytes": 0} for op in COLLECTIVES}

    def add(op, b):
        e = out[op]
        e["count"] += 1
        e["bytes"] += b
        e["max_bytes"] = max(e["max_bytes"], b)

    computation = ""
    for line in hlo_text.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{"):
            computation = line.split()[0].lstrip("%")  # a computation's header line
            continue
        if computation.startswith("all-reduce-scatter"):
            continue
        f = _FUSED_RS.search(line)
        if f:
            add("reduce-scatter", sum(_shape_bytes(f.group(1))))
            continue
        m = _OP.search(line)
        if m:
            sizes = _shape_bytes(m.group(1))
            add(m.group(2), max(sizes, default=0) if m.group(3) else sum(sizes))
    return out


_CALLS = re.compile(r"\b(body|condition|calls|to_apply|true_computation|false_computation)"
                    r"=%?([\w.-]+)")


_BRANCHES = re.compile(r"\b(?:branch_computations|called_computations)=\{([^}]*)\}")


_CONST = re.compile(r"%?([\w.-]+) = [su]\d+\[\]\S* constant\((\d+)\)")


_LT = re.compile(r"(?:compare|fusion)\(%?([\w.-]+), %?([\w.-]+)\)")


_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


_GROUPS_IOTA = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")


_GROUPS = re.compile(r"replica_groups=\{\{([\d,]+)\}")


_GROUPS_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\(\[([\d,]+)\]"
                          r"(?:T\(([\d,]+)\))?\))? \{([^}]*)\}")


#: one executed collective op of a line: ``= <result shape> <op>(`` or ``<op>-start(``
_EXECUTED = {op: re.compile(r"=\s*(.*?)\s" + op + r"(-start)?\(")
             for op in ("all-gather", "all-reduce")}


def _computations(hlo_text: str) -> tuple[dict, str]:
    """``({name: [instruction lines]}, entry name)`` of an HLO module's text."""
    comps, name, entry = {}, None, ""
    for line in hlo_text.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{"):
            words = line.split()
            is_entry = words[0] == "ENTRY"
            name = words[1 if is_entry else 0].lstrip("%")
            entry = name if is_entry else entry
            comps[name] = []
        elif name is not None and line.startswith(" "):
            comps[name].append(line)
    return comps, entry


def _trip_count(lines: list, comps: dict) -> int | None:
    """A while loop's trip count read from its condition: ``i < N`` with ``N`` a constant (the
    counter starting at 0, as XLA writes scans and fori loops), the compare written out or in
    a fusion (the CPU compiler wraps it); None otherwise."""
    consts = {m.group(1): int(m.group(2)) for m in map(_CONST.search, lines) if m}
    for line in lines:
        m = _LT.search(line)
        if not m or m.group(2) not in consts:
            continue
        callee = re.search(r"calls=%?([\w.-]+)", line)
        body = " ".join(comps.get(callee.group(1), [])) if callee else line
        if "direction=LT" in body:
            return consts[m.group(2)]
    return None


def executions(hlo_text: str) -> tuple[dict, int]:
    """``({computation: times it runs per execution of the module}, loops of unknown trip
    count)``: the entry runs once, a while loop's body and condition run its trip count
    (``_trip_count``; 1 when unknown) times per run of the caller, every other called
    computation (fusions, calls, both branches of a conditional: an upper bound) once."""
    comps, entry = _computations(hlo_text)
    calls = {}
    unknown = 0
    for name, lines in comps.items():
        out = []
        for line in lines:
            trips = 1
            if " while(" in line:
                cond = re.search(r"condition=%?([\w.-]+)", line)
                known = _TRIPS.search(line)
                n = (int(known.group(1)) if known else
                     _trip_count(comps.get(cond.group(1), []), comps) if cond else None)
                unknown += n is None
                trips = 1 if n is None else n
            for kind, callee in _CALLS.findall(line):
                out.append((callee, trips if kind in ("body", "condition") else 1))
            for group in _BRANCHES.findall(line):
                out += [(c.strip().lstrip("%"), 1) for c in group.split(",") if c.strip()]
        calls[name] = out
    times: dict = {}

    def visit(name, n):
        times[name] = times.get(name, 0) + n
        for callee, k in calls.get(name, ()):
            if callee in comps:
                visit(callee, n * k)

    if entry:
        visit(entry, 1)
    return times, unknown


def _group_axes(line: str, mesh_shape: dict) -> str:
    """The mesh axes a collective's first replica group spans (``"fsdp"``, ``"tensor"``,
    ``"fsdp+tensor"``...; ``"?"`` when the groups cannot be read). Device ids are positions in
    the mesh's device order (``mesh.devices.flat``), axes in ``mesh_shape``'s order."""
    import numpy as np
    names, dims = list(mesh_shape), [int(v) for v in mesh_shape.values()]
    m, mm = _GROUPS_IOTA.search(line), _GROUPS_MESH.search(line)
    if mm:  # mesh['axis_0'=a,...], device_ids=([dims]T(perm)) {'axis_k', ...}: the group
        # spans the listed axes of that (internal) mesh, the others fixed at 0
        names_ = re.findall(r"'(\w+)'=(\d+)", mm.group(1))
        sizes = [int(v) for _, v in names_]
        ids = np.arange(math.prod(sizes))
        if mm.group(2):
            ids = ids.reshape([int(x) for x in mm.group(2).split(",")])
            if mm.group(3):
                ids = ids.transpose([int(x) for x in mm.group(3).split(",")])
        ids = ids.reshape(sizes)
        spans = set(re.findall(r"'(\w+)'", mm.group(4)))
        first = ids[tuple(slice(None) if n in spans else 0 for n, _ in names_)].reshape(-1)
    elif m:
        g, s = int(m.group(1)), int(m.group(2))
        shape = [int(x) for x in m.group(3).split(",")]
        ids = np.arange(math.prod(shape)).reshape(shape)
        if m.group(4):
            ids = ids.transpose([int(x) for x in m.group(4).split(",")])
        first = ids.reshape(g, s)[0]
    else:
        m = _GROUPS.search(line)
        if not m:
            return "?"
        first = np.array([int(x) for x in m.group(1).split(",")])
    if first.max() >= math.prod(dims):
        return "?"
    coords = np.array(np.unravel_index(first, dims))
    spans = [n for n, c in zip(names, coords) if len(set(c.tolist())) > 1]
    return "+".join(spans) or "none"


def executed_collectives(hlo_text: str, mesh_shape: dict, op: str = "all-gather") -> dict:
    """The bytes of ``op`` (``all-gather`` or ``all-reduce``) executed per run of the compiled
    program, by the mesh axes they span: ``{"fsdp": bytes, "tensor": bytes, ...}`` (per-device
    result bytes of each op times the number of times its computation runs, ``executions``),
    plus ``"unknown loops"``: while loops whose trip count could not be read (counted once).
    An op in a loop over tiles or chunks counts once per iteration: this is where a gradient
    reduced in every tile instead of once shows (``trainer.mlp_chunk``). The all-reduce inside
    the TPU compiler's ``all-reduce-scatter`` computations is a reduce-scatter
    (``count_collectives``) and is not counted.

    The TPU compiler splits an asynchronous all-gather over several fused computations (its
    start, its continuation, its end), each holding a copy of the op with the same
    ``channel_id``: one channel counts once."""
    pattern = _EXECUTED[op]
    times, unknown = executions(hlo_text)
    comps, _ = _computations(hlo_text)
    seen: dict = {}
    out: dict = {}
    for name, lines in comps.items():
        n = times.get(name, 0)
        if not n or name.startswith("all-reduce-scatter"):
            continue
        for line in lines:
            m = pattern.search(line)
            if not m:
                continue
            sizes = _shape_bytes(m.group(1))
            b = max(sizes, default=0) if m.group(2) else sum(sizes)
            axes = _group_axes(line, mesh_shape)
            channel = re.search(r"channel_id=(\d+)", line)
            key = ("channel", channel.group(1)) if channel else ("op", name, line)
            seen[key] = max(seen.get(key, (axes, 0)), (axes, b * n), key=lambda e: e[1])
    for axes, b in seen.values():
        out[axes] = out.get(axes, 0) + b
    out["unknown loops"] = unknown
    return out


#: an instruction: its name, shape (a tuple's too: the opcode is the first word after a space
#: that opens a parenthesis), opcode and the rest of the line
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.-]+)\s*=\s*(.*?)\s([a-z][\w-]*)\((.*)$")
_ALTERNATE = re.compile(r"S\(1\)\}$")
#: fusions that copy (part of) a buffer: their root
_COPIES = ("dynamic-slice", "slice", "copy", "bitcast", "transpose")


def on_chip_copy_bytes(hlo_text: str) -> int:
    """Bytes that XLA's cost analysis counts for copies the compiler placed in the chip's
    alternate memory (memory space 1, ``S(1)`` in a layout: on TPU the on-chip VMEM): every
    synchronous ``copy`` of the entry computation, or fusion whose root only moves data
    (``dynamic-slice``, ``slice``, ``copy``, ``bitcast``, ``transpose``), with its result in
    memory space 1, counted as its write and one read of it per use. The copy's source was
    read from HBM by that instruction (which stays counted), so none of these bytes move
    through HBM: the decode roofline leaves them out.

    The TPU compiler copies a layer's slice of a KV cache into VMEM ahead of the attention
    that reads it; the cost analysis then counts the slice three times (read from HBM,
    written to VMEM, read from VMEM) where HBM serves it once.

    Not counted here: asynchronous copies (``copy-start`` / ``slice-start``: XLA's cost
    analysis does not count them; the reads of the prefetched weights stay counted, as the
    HBM reads they stand for), results of computations in VMEM (a dot's: small, and not a
    copy of anything in HBM), in-place updates and tuples. Pure text; 0 for a program
    without memory spaces (CPU)."""
    comps, entry = _computations(hlo_text)
    lines = comps.get(entry, [])
    roots = {}
    for name, body in comps.items():
        root = next((ln for ln in body if ln.lstrip().startswith("ROOT")), "")
        m = _INSTR.match(root)
        roots[name] = m.group(3) if m else ""
    placed = {}
    for line in lines:
        m = _INSTR.match(line)
        if not m or m.group(3) not in ("fusion", "copy"):
            continue
        name, shape = m.group(1), m.group(2)
        if shape.startswith("(") or not _ALTERNATE.search(shape):
            continue
        callee = re.search(r"calls=%?([\w.-]+)", line)
        if m.group(3) == "fusion" and (not callee or roots.get(callee.group(1)) not in _COPIES):
            continue
        placed[name] = sum(_shape_bytes(shape))
    if not placed:
        return 0
    uses = dict.fromkeys(placed, 0)
    for line in lines:
        m = _INSTR.match(line)
        if not m:
            continue
        for arg in re.findall(r"%([\w.-]+)", m.group(4).split("calls=")[0]):
            if arg in uses:
                uses[arg] += 1
    return sum(b * (1 + uses[n]) for n, b in placed.items())
