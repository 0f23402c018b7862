"""The plan of a chosen candidate, and a plan read from disk checked against the model and predicted again.

`make_plan` writes what plan.json holds (the stages, the TP map, the predictions per pipeline rank, the next
best plans); `replan` is `--from-plan`'s: every stage, unit and layer the plan names checked against the traced
model and cluster (one line each), then predicted as the search would; `no_fit_message` the error when nothing
fits; `dump` the `--dump-dir` files of the chosen candidate (`graph.txt`, `costs.json`).
"""

from __future__ import annotations

import json
from pathlib import Path

from partc.cluster import Cluster
from partc.errors import PartcError
from partc.ir import ModelGraph
from partc.plan import Plan, Stage
from partc.passes import assemble, cost, cost_step, cost_types, memory
from partc.passes.search import Candidate, SearchResult
from partc.passes.tp import evaluate_tp


def no_fit_message(clus: Cluster, result: SearchResult) -> str:
    usable = clus.usable_memory_bytes
    gib = 1024**3
    if result.least_memory is None:
        return f"no plan fits in {usable / gib:.1f} GiB per GPU on {clus.name}"
    c = result.least_memory_candidate
    p = c.parallel
    return (f"the model fits no plan: the least memory any plan needs is {result.least_memory / gib:.1f} GiB per "
            f"GPU ({p.summary()}), but a {clus.gpu} has {usable / gib:.1f} GiB usable "
            f"({clus.memory_bytes / gib:.1f} GiB less its reserves); "
            f"use more GPUs or a larger GPU")


def replan(graph: ModelGraph, clus: Cluster, gpus: int, plan: Plan, global_batch_size: int | None) -> Candidate:
    """Validate a plan from disk against the model and cluster, and predict it again."""
    par = plan.parallel
    if par.world_size != gpus:
        raise PartcError(f"the plan is for {par.world_text()} GPUs, but --gpus is {gpus}")
    if global_batch_size is not None and global_batch_size != par.global_batch_size:
        raise PartcError(f"the plan's global batch is {par.global_batch_size}, but --global-batch-size is "
                         f"{global_batch_size}")
    if plan.cluster.get("name") not in (None, clus.name):
        raise PartcError(f"the plan was made for cluster {plan.cluster.get('name')!r}; pass --cluster "
                         f"{plan.cluster.get('name')} (or the same cluster file)")
    if par.tp > clus.gpus_per_node:
        raise PartcError(f"tp {par.tp} exceeds the {clus.gpus_per_node} GPUs of a node")
    want = par.num_stages
    if len(plan.stages) != want:
        raise PartcError(f"the plan has {len(plan.stages)} stages; pp x virtual_stages = {want}")
    index = {u.fqn: i for i, u in enumerate(graph.units)}
    bounds, pos = [], 0
    for s in plan.stages:
        for m in s.modules:
            if m not in index:
                raise PartcError(f"stage {s.index} names {m!r}, which is not a unit of the model (units: "
                                 f"{', '.join(u.fqn for u in graph.units[:6])}, ...)")
        ids = [index[m] for m in s.modules]
        if ids != list(range(pos, pos + len(ids))):
            raise PartcError(f"stage {s.index} must hold the next units in execution order, starting at "
                             f"{graph.units[pos].fqn if pos < len(graph.units) else '(none left)'}")
        bounds.append((pos, pos + len(ids)))
        pos += len(ids)
    if pos != len(graph.units):
        raise PartcError(f"the stages cover {pos} of the model's {len(graph.units)} units; missing "
                         f"{graph.units[pos].fqn} and after")
    for k, (_, end) in enumerate(bounds[:-1]):
        if graph.cut_ok and not graph.cut_ok[end - 1]:
            why = "a tensor whose size depends on values (a routing's selected tokens) would cross it" \
                if graph.cut_value_sized and graph.cut_value_sized[end - 1] else \
                "an op before that boundary reads one after it"
            raise PartcError(f"stage {k} cannot end at {graph.units[end - 1].fqn}: {why}; move the boundary")
    unknown = sorted(set(plan.tp) - set(graph.layers))
    if unknown:
        raise PartcError(f"the plan's tp map names {unknown[0]!r}, which is not a layer of the model")
    missing = [f for f in graph.layers if f not in plan.tp]
    if missing:
        raise PartcError(f"the plan's tp map has no style for layer {missing[0]!r} ({len(missing)} missing)")
    tp = evaluate_tp(graph, par.tp, plan.tp, clus, par.micro_batch_size)
    pred = assemble.predict(graph, clus, par, tp, bounds)
    if not cost_step.fits(clus, pred.memory_per_gpu):
        gib = 1024**3
        raise PartcError(f"the plan needs {pred.memory_per_gpu.total / gib:.1f} GiB per GPU but a {clus.gpu} has "
                         f"{clus.usable_memory_bytes / gib:.1f} GiB usable")
    return Candidate(parallel=par, tp=tp, bounds=bounds, prediction=pred)


def expert_routing(imbalance: float) -> str:
    """The plan's ``predicted.expert_routing`` under ep: the routing its numbers assume, and whose they are."""
    if imbalance == 1.0:
        return "uniform: every expert gets an equal share of every rank's (token, expert) pairs"
    return (f"skewed: the busiest rank of each ep group receives {imbalance:g} times the mean (token, expert) rows, "
            f"every rank sending it {imbalance:g}/ep of its own; predicted.ranks[] are that rank's: its experts' "
            f"compute and activations {imbalance:g} times the mean rows', its all-to-alls as long as its share takes "
            f"to arrive, and comm_bytes.ep the bytes that leave it, as the runtime counts them")


def _predicted(pred: cost_types.Prediction, global_batch_size: int, imbalance: float = 1.0) -> dict:
    return {
        "step_time_s": pred.step_time_s, "tokens_per_s": pred.tokens_per_s,
        "samples_per_s": global_batch_size / pred.step_time_s,
        "model_tflops_per_gpu": pred.model_tflops_per_gpu, "mfu": pred.mfu,
        "bubble_fraction": pred.bubble_fraction, "memory_per_gpu": pred.memory_per_gpu.to_dict(),
        "breakdown_s": {"compute": pred.compute_s, "tp_comm": pred.tp_comm_s, "pp_comm": pred.pp_comm_s,
                        "bubble": pred.bubble_s, "dp_comm": pred.dp_comm_s, "optimizer": pred.optimizer_s},
        # One entry per pipeline rank, in rank order: what one GPU of it needs and moves in a step (the runtime
        # measures the same: partc.runtime.comm, `--log-jsonl`).
        "ranks": [{"time_s": r.time_s, "memory_bytes": r.memory.to_dict(),
                   "comm_bytes": {axis: int(round(nbytes)) for axis, nbytes in r.comm_bytes.items()},  # axes in use
                   "timeline_s": r.timeline_s}  # what the step's walk takes (`partc.timeline`, report.html)
                  for r in pred.ranks],
        # Under ep, the routing the all-to-alls and the experts' GEMMs are priced at (docs/expert-parallel.md).
        **({"expert_routing": expert_routing(imbalance)}
           if any("ep" in r.comm_bytes for r in pred.ranks) else {}),
    }


def make_plan(graph: ModelGraph, clus: Cluster, best: Candidate, result: SearchResult | None, *, path: str,
              entry: str, tokens: bool = True) -> Plan:
    """`tokens`: the model takes token inputs (its throughput is in tokens/s; else in samples/s)."""
    par, pred = best.parallel, best.prediction
    stages = []
    for k, (lo, hi) in enumerate(best.bounds):
        rank = pred.ranks[k % par.pp]
        stages.append(Stage(index=k, rank=k % par.pp, modules=[u.fqn for u in graph.units[lo:hi]],
                            predicted={"time_s": rank.time_s, "memory_bytes": int(round(rank.memory.total))}))
    model = {"name": graph.name, "path": path, "entry": entry, "num_params": graph.num_params,
             "num_units": len(graph.units), **{k: v for k, v in graph.info.items() if v is not None},
             "throughput_unit": "tokens" if tokens else "samples"}
    alternatives = []
    for c in (result.alternatives[:5] if result else []):
        alternatives.append({"parallel": c.parallel.to_dict(), "step_time_s": c.step_time_s,
                             "memory_bytes": int(round(c.prediction.memory_per_gpu.total)),
                             "mfu": c.prediction.mfu})
    return Plan(model=model, cluster=clus.to_dict(), parallel=par, tp=dict(best.tp.styles), stages=stages,
                predicted=_predicted(pred, par.global_batch_size, par.imbalance), alternatives=alternatives,
                tp_why=dict(best.tp.why), tp_loss=memory.tp_loss(graph, par, best.tp))


def dump(graph: ModelGraph, clus: Cluster, best: Candidate, dump_dir: str | Path) -> None:
    """`graph.txt` (units, layers, edges) and `costs.json` (per-unit costs under the chosen plan)."""
    out = Path(dump_dir)
    out.mkdir(parents=True, exist_ok=True)
    lines = [f"# {graph.name}: {graph.num_params:,} parameters, {len(graph.units)} units, "
             f"{len(graph.layers)} layers, seq_len {graph.seq_len} (per sample, unsharded)"]
    for u in graph.units:
        lines.append(f"unit {u.fqn} [{u.kind}] params={u.num_params:,} fwd_flops={u.fwd_flops:.4g} "
                     f"saved={u.saved_bytes:,}B core={u.saved_bytes_core:,}B input={u.input_bytes:,}B")
        for m in u.layers:
            layer = graph.layers[m]
            lines.append(f"  layer {m} {layer.type} ({layer.kind}) in={layer.in_features} out={layer.out_features} "
                         f"col_groups={layer.col_groups} row_groups={layer.row_groups} fused={layer.fused} "
                         f"params={layer.num_params:,} fwd_flops={layer.fwd_flops:.4g} tp={best.tp.styles.get(m)}")
    for e in graph.edges:
        lines.append(f"edge {e.src} -> {e.dst} bytes={e.bytes:,} shard_ok={e.shard_ok}")
    (out / "graph.txt").write_text("\n".join(lines) + "\n")
    par = best.parallel
    parts = cost.unit_time_parts(graph, clus, par, best.tp)
    params = memory.unit_param_counts(graph, par, best.tp)
    acts = memory.unit_activation_bytes(graph, par, best.tp)
    units = [{"unit": u.fqn, "compute_s": parts[i].compute_s, "tp_comm_s": parts[i].tp_comm_s,
              "params_per_gpu": params[i], "activation_bytes_per_microbatch": acts[i],
              "collectives": [{"kind": c.kind, "phase": c.phase, "bytes_per_sample": c.nbytes, "reason": c.reason}
                              for c in best.tp.collectives.get(u.fqn, [])]}
             for i, u in enumerate(graph.units)]
    data = {"parallel": par.to_dict(), "units": units, "prediction": best.prediction.to_dict(),
            "cut_bytes_per_sample": graph.cut_bytes, "cut_fixed_bytes_per_micro_batch": graph.cut_fixed_bytes}
    (out / "costs.json").write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
