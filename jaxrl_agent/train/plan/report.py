"""The plan as text (``format_plan``): the step's memory per device beside its analytic
floor, the verdict against the chip's HBM, the collectives (static and executed per
micro-batch pass) and the JAX sampler's table."""

from __future__ import annotations

from jaxrl_agent.train.plan.run import Plan


def _count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.1f} M"


def _mib(b: int) -> str:
    return f"{b / 2 ** 20:,.1f}"


def format_plan(p: Plan, source: str = "") -> str:
    """The fit table printed by ``jaxrl-agent plan``."""
    m, b, s, mem = p.mesh, p.batch, p.step, p.memory
    hosts = f", {p.num_hosts} hosts" if p.num_hosts > 1 else ""
    lines = [
        f"plan{' ' + source if source else ''} on {p.topology}: {p.num_devices} x "
        f"{p.device_kind}{hosts}; mesh data={m['data']} fsdp={m['fsdp']} tensor={m['tensor']}",
        f"model: {p.model['family']}, {_count(p.model['params'])} parameters "
        f"({p.model['dtype']}), {p.model['layers']} layers, hidden {p.model['hidden']}, vocab "
        f"{p.model['vocab']}" + (", value head" if p.model["value_head"] else ""),
        f"step: {s['estimator']}, {s['layout']} rows, micro_batches={s['micro_batches']} "
        f"mini_batches={s['mini_batches']} ppo_epochs={s['ppo_epochs']} remat={s['remat']} "
        f"attention={s['attention']} logits_chunk={s['logits_chunk']}"
        + (f" mlp_chunk={s['mlp_chunk']}" if s.get("mlp_chunk") else "")
        + (", KL reference" if s["kl_reference"] else "")
        + (f", teacher {s['teacher']}" if s.get("teacher", "none") != "none" else ""),
        f"batch: {b['num_traj']} trajectories x {b['num_turns']} turns, {b['num_rows']} rows x "
        f"{b['row_len']} tokens (the largest the config packs: rows of "
        "rollout.max_context_tokens)",
        "",
        f"{'per device':<34}{'MiB':>12}",
        f"{'  parameters':<34}{_mib(p.params_bytes):>12}   (of {_mib(p.params_total_bytes)} "
        "in all)",
        f"{'  optimizer state':<34}{_mib(p.opt_bytes):>12}"
        + (f"   (LoRA rank {p.model['lora_rank']}: {100 * p.opt_bytes / (2 * p.params_bytes):.2f}%"
           " of a full fine-tune's Adam state, 2 x the parameters)"
           if p.model.get("lora_rank") else ""),
    ]
    if p.ref_bytes:
        lines.append(f"{'  start copy (KL ref., base teacher)':<34}{_mib(p.ref_bytes):>12}")
    if p.teacher_bytes:
        lines.append(f"{'  teacher parameters':<34}{_mib(p.teacher_bytes):>12}")
    lines += [
        f"{'  batch':<34}{_mib(p.batch_bytes):>12}",
        f"{'  arguments (compiled)':<34}{_mib(mem.argument_bytes):>12}",
        f"{'  outputs (new state, metrics)':<34}{_mib(mem.output_bytes):>12}",
        f"{'  temporaries (activations, grads)':<34}{_mib(mem.temp_bytes):>12}",
        f"{'  code':<34}{_mib(mem.code_bytes):>12}",
    ]
    if mem.alias_bytes:
        lines.append(f"{'  aliased (counted once)':<34}{'-' + _mib(mem.alias_bytes):>12}")
    hbm = f"   HBM {p.hbm_bytes / 2 ** 30:.0f} GiB per {p.chip} chip" if p.hbm_bytes else ""
    lines += [f"{'  total':<34}{_mib(p.total_bytes):>12}{hbm}"]
    if p.floor:
        lines += ["", f"{'analytic floor, per device':<34}{'MiB':>12}   (memory_floor: what the "
                  "step must hold at least)"]
        lines += [f"{'  ' + k:<34}{_mib(v):>12}" for k, v in p.floor.items() if k != "total"]
        lines.append(f"{'  floor':<34}{_mib(p.floor['total']):>12}   compiled total / floor = "
                     f"{p.floor_ratio:.2f}")
    lines += [f"compile time: {mem.compile_s:.1f} s", ""]
    lines += format_collectives(mem.collectives, "the compiled step")
    lines += format_gathers(p)
    if p.sampler is not None:
        lines += format_sampler(p) + [""]
    notes = list(p.notes)
    if p.num_devices > 1 and p.mesh["fsdp"] * p.mesh["tensor"] == 1:
        notes.append("pure data parallelism: every device holds the whole model and optimizer "
                     "state (mesh.fsdp / mesh.tensor would shard them)")
    lines += [f"note: {n}" for n in notes]
    lines += [f"verdict: {v}" for v in p.verdicts()]
    return "\n".join(lines)


def format_gathers(p: Plan) -> list[str]:
    """The all-gathers and all-reduces the step executes (``executed_collectives``) by mesh
    axis, per micro-batch pass, the gathers against the one-gather-per-layer-per-pass floor
    (empty without the figures)."""
    g = p.memory.gathers
    if not g or set(g) == {"unknown loops"}:
        return []
    s = p.step
    passes = s["micro_batches"] * s["mini_batches"] * s["ppo_epochs"]
    lines = [f"all-gathers executed in one step (loop trip counts applied), per micro-batch "
             f"pass ({passes} of them)",
             f"{'  over':<22}{'MiB / pass':>14}"]
    for axes, b in sorted((k, v) for k, v in g.items() if k != "unknown loops"):
        lines.append(f"{'  ' + axes:<22}{_mib(b / passes):>14}")
    ratio = p.gathers_per_micro_batch
    if ratio is not None:
        lines.append(f"  FSDP: {ratio:.2f} x the FSDP-split weights "
                     f"({_mib(p.weights_gathered_bytes)} MiB) per pass; one gather of each in "
                     "the forward and one in the backward pass is 2.00 (forward-only passes "
                     "add theirs; the embedding table is looked up in place, not gathered)")
    r = {k: v for k, v in p.memory.reduces.items() if k != "unknown loops"}
    if r:
        lines.append("all-reduces executed in one step, per micro-batch pass: " + ", ".join(
            f"over {axes} {_mib(b / passes)} MiB" for axes, b in sorted(r.items())))
    if g.get("unknown loops"):
        lines.append(f"  ({g['unknown loops']} loops of unknown trip count counted once)")
    return lines + [""]


def format_collectives(collectives: dict, what: str) -> list[str]:
    """A table of ``count_collectives``' result (empty when there are none)."""
    if not collectives:
        return []
    lines = [f"collectives in {what} (static count; bytes: per-device results)",
             f"{'  op':<22}{'count':>7}{'MiB':>12}{'largest MiB':>14}"]
    for op, v in collectives.items():
        lines.append(f"{'  ' + op:<22}{v['count']:>7}{_mib(v['bytes']):>12}"
                     f"{_mib(v['max_bytes']):>14}")
    return lines + [""]


def format_sampler(p: Plan) -> list[str]:
    """The sampler's lines of ``format_plan``: the call planned for and a two-column table
    (prefill, decode step) of its device's bytes, plus that device's peak with the train
    state."""
    s = p.sampler
    d = s.dims
    share = "one host's share of " if d["hosts"] > 1 else ""
    call = "the step's trajectories" if d["call"] == "train" else "trainer.eval_tasks"
    pre, dec = s.prefill, s.decode

    def row(label, a, b):
        return f"{'  ' + label:<34}{_mib(a):>12}{_mib(b):>12}"

    m = s.mesh
    if m["data"] * m["tensor"] == 1:
        where = (f"JAX sampler: compiled for ONE {s.device_kind} device (each host runs it on "
                 "one of its devices, with the whole model; sampler.data_parallel / "
                 "tensor_parallel split it over the host's devices)")
    else:
        where = (f"JAX sampler: compiled for {m['data'] * m['tensor']} {s.device_kind} "
                 f"devices of one host: prompts and KV cache rows over data={m['data']}, heads "
                 f"over tensor={m['tensor']}")
    lines = [
        where,
        f"sampler call: {d['prompts']} prompts ({share}{call}) in a batch of {d['batch']}, "
        f"padded to {d['prompt_len']} tokens, {d['new_tokens']} new tokens, KV cache of "
        f"{d['cache_len']} slots",
        "",
        f"{'sampler, per device':<34}{'prefill MiB':>12}{'decode MiB':>12}",
        row("parameters", s.params_bytes, s.params_bytes),
        row("KV cache", s.kv_cache_bytes, s.kv_cache_bytes),
        row("arguments (compiled)", pre.argument_bytes, dec.argument_bytes),
        row("outputs", pre.output_bytes, dec.output_bytes),
        row("temporaries", pre.temp_bytes, dec.temp_bytes),
        row("code", pre.code_bytes, dec.code_bytes),
    ]
    if pre.alias_bytes or dec.alias_bytes:
        lines.append(row("aliased (counted once)", -pre.alias_bytes, -dec.alias_bytes))
    lines += [
        row("total", pre.total_bytes, dec.total_bytes),
        f"{'  compile time (s)':<34}{pre.compile_s:>12.1f}{dec.compile_s:>12.1f}",
    ]
    if s.kept_bytes:
        lines.append(f"{'  + kept caches (reuse_calls)':<34}{_mib(s.kept_bytes):>12}"
                     f"{_mib(s.kept_bytes):>12}")
    lines += [
        f"{'  device peak with the train state':<34}{_mib(p.sampler_device_bytes):>12}   "
        f"(max of sampler + train state {_mib(p.state_bytes)}, train step"
        + (", the sampler's weights freed during it)" if p.sampler_released else
           " + sampler weights: async rollouts keep them)"),
    ]
    lines += format_call_size(s) + format_decode_step(s)
    if m["data"] * m["tensor"] > 1:
        lines += [""] + format_collectives(dec.collectives, "the sampler's decode step")[:-1]
    return lines


def format_call_size(s) -> list[str]:
    """How the sampler's call was sized (``SamplerPlan.sized``; empty when it was not)."""
    z = s.sized
    if not z:
        return []
    tried = ", ".join(f"{r} rows{' + kept caches' if k else ''} "
                      f"{'refused' if b is None else _mib(b).strip() + ' MiB'}"
                      for r, k, b in z["tried"])
    if z["rows"] is None:
        head = "sampler call sized to fit: NO call size fits"
    else:
        n = -(-s.dims["prompts"] // z["rows"])
        head = (f"sampler call sized to fit (sampler.call_rows: 0): {z['rows']} rows at once, "
                f"{n} chunk{'s' if n != 1 else ''} per {s.dims['prompts']} prompts"
                + (", kept caches off (sampler.reuse_calls 0: they did not fit)"
                   if z["reuse_dropped"] else ""))
    return [f"{head}; budget {_mib(z['budget']).strip()} MiB per device (85% of HBM - train "
            f"state); tried {tried} (compiled peak + kept caches; the kept caches alone, not "
            "compiled, where they alone exceed the budget)"]


def format_decode_step(s) -> list[str]:
    """One decode step's bytes against the roofline (empty when it was not compiled)."""
    if not s.step_bytes:
        return []
    out = [f"decode step (one more token for {s.dims['batch']} rows; XLA's bytes accessed of 2 "
           f"steps - 1, layers unrolled): {_mib(s.step_bytes).strip()} MiB of HBM traffic per "
           f"device; floor (the weights a step reads + KV cache, once) {_mib(s.floor_step_bytes).strip()} MiB: "
           f"{100 * s.roofline_fraction:.0f}% of the roofline; compile {s.step_compile_s:.1f} s"]
    if s.step_bytes_counted and s.step_bytes_counted != s.step_bytes:
        out.append(f"  XLA counts {_mib(s.step_bytes_counted).strip()} MiB: "
                   f"{_mib(s.step_bytes_counted - s.step_bytes).strip()} MiB of them are "
                   "copies into on-chip memory (the KV cache's layer slices), written and "
                   "read there, not through HBM")
    if s.step_seconds:
        out.append(f"  at the chip's {s.bandwidth / 1e9:,.0f} GB/s: {1e3 * s.step_seconds:.2f} "
                   f"ms per step, {s.tokens_per_s_per_chip:,.0f} tokens/s per chip "
                   "(predicted: memory-bound, compute and launch overheads not counted)")
    return out
