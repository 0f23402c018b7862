"""Hand-built `ModelGraph`s for the cost-model and solver tests (no tracing): a GPT-2-style stack.

    tok (Embedding V x h) -> blocks.i: ln_1, attn.qkv (h -> 3h, fused), attn.proj, ln_2, mlp.fc1 (h -> 4h),
    mlp.fc2 -> ln_f -> lm_head (h -> V; with ``tied=True`` it shares tok.weight)

Sizes are per sample, in the IR's 16-bit convention. Each block saves Korthikanti et al.'s s·h·34 + 5·a·s² bytes,
of which 10·s·h stay whole under tensor parallelism (norm and residual inputs) and 5·a·s² are the attention core.
Edges follow what `passes.trace` emits: layer -> layer through non-layer ops, the residual stream reaching the norms
of its own unit and of the next one (``residual="trace"``) or every later norm (``residual="all"``).
"""

from __future__ import annotations

from partc.ir import ACTIVATION_BYTES, Edge, Gemm, Layer, ModelGraph, Unit
from partc.passes.tp import megatron_style

BLOCK_LAYERS = ("ln_1", "attn.qkv", "attn.proj", "ln_2", "mlp.fc1", "mlp.fc2")
"""A block's layers (names relative to the block), in execution order."""

MEGATRON = {name: megatron_style(name) or "replicate" for name in BLOCK_LAYERS}
"""Megatron-LM's TP styles of a block's layers: qkv and fc1 colwise, proj and fc2 rowwise, the norms whole."""


def linear(fqn: str, unit: str, tokens: int, in_f: int, out_f: int, *, col_groups: int = 0, row_groups: int = 0,
           fused: int = 1, bias: bool = True) -> Layer:
    g = Gemm(batch=1, m=tokens, n=out_f, k=in_f, batch_scales=False)
    params = {f"{fqn}.weight": (out_f, in_f), **({f"{fqn}.bias": (out_f,)} if bias else {})}
    return Layer(fqn=fqn, type="Linear", kind="linear", unit=unit, params=params,
                 num_params=out_f * in_f + (out_f if bias else 0), in_features=in_f, out_features=out_f,
                 col_groups=col_groups or out_f, row_groups=row_groups or in_f, fused=fused, gemms=[g],
                 fwd_flops=g.flops, out_bytes=tokens * out_f * ACTIVATION_BYTES,
                 saved_bytes=tokens * in_f * ACTIVATION_BYTES, memory_bytes=tokens * out_f * ACTIVATION_BYTES)


def norm(fqn: str, unit: str, tokens: int, dim: int) -> Layer:
    return Layer(fqn=fqn, type="LayerNorm", kind="norm", unit=unit,
                 params={f"{fqn}.weight": (dim,), f"{fqn}.bias": (dim,)}, num_params=2 * dim, in_features=dim,
                 out_bytes=tokens * dim * ACTIVATION_BYTES, saved_bytes=tokens * dim * ACTIVATION_BYTES,
                 memory_bytes=2 * tokens * dim * ACTIVATION_BYTES)


def embedding(fqn: str, unit: str, tokens: int, vocab: int, dim: int) -> Layer:
    return Layer(fqn=fqn, type="Embedding", kind="embedding", unit=unit, params={f"{fqn}.weight": (vocab, dim)},
                 num_params=vocab * dim, in_features=dim, out_features=vocab, col_groups=dim, row_groups=vocab,
                 out_bytes=tokens * dim * ACTIVATION_BYTES, memory_bytes=2 * tokens * dim * ACTIVATION_BYTES)


def gpt_block(fqn: str, *, seq: int, dim: int, heads: int) -> tuple[Unit, list[Layer]]:
    """One GPT-2 block (MLP 4h wide) as a unit and its layers, in execution order."""
    s, h, a = seq, dim, heads
    layers = [norm(f"{fqn}.ln_1", fqn, s, h),
              linear(f"{fqn}.attn.qkv", fqn, s, h, 3 * h, col_groups=a, fused=3),
              linear(f"{fqn}.attn.proj", fqn, s, h, h, row_groups=a),
              norm(f"{fqn}.ln_2", fqn, s, h),
              linear(f"{fqn}.mlp.fc1", fqn, s, h, 4 * h),
              linear(f"{fqn}.mlp.fc2", fqn, s, 4 * h, h)]
    core = [Gemm(batch=a, m=s, n=s, k=h // a, batch_scales=True),   # scores  Q K^T
            Gemm(batch=a, m=s, n=h // a, k=s, batch_scales=True)]   # context P V
    unit = Unit(fqn=fqn, kind="block", layers=[x.fqn for x in layers], num_params=sum(x.num_params for x in layers),
                fwd_flops=sum(x.fwd_flops for x in layers) + sum(g.flops for g in core), core_gemms=core,
                saved_bytes=34 * s * h + 5 * a * s * s, saved_bytes_core=5 * a * s * s,
                saved_bytes_replicated=10 * s * h, saved_bytes_replicated_linear=4 * s * h, input_bytes=s * h * ACTIVATION_BYTES, memory_bytes=20 * s * h,
                # the ops between the layers: norms' inputs and dropout masks whole, GELU's input and the attention
                # core split (Korthikanti et al.'s 4 + 2 and 8 + 5as/h)
                op_saved_bytes=14 * s * h + 5 * a * s * s, op_saved_bytes_replicated=6 * s * h,
                signature=f"gpt-block:{h}:{a}")
    return unit, layers


def gpt_graph(*, num_blocks: int = 2, dim: int = 256, heads: int = 8, vocab: int = 1024, seq: int = 512,
              residual: str = "trace", shard_ok: bool = True, tied: bool = False, pos: bool = False) -> ModelGraph:
    """A GPT stack; `shard_ok` False makes qkv -> proj and fc1 -> fc2 unable to stay sharded; `tied` makes the head
    share the token embedding's weight (counted once, on the embedding, as `passes.trace` counts it); `pos` adds a
    learned position embedding to the token embedding's unit, its output summed with the token embedding's
    (`ModelGraph.sums`)."""
    act = seq * dim * ACTIVATION_BYTES
    tok = embedding("tok", "tok", seq, vocab, dim)
    layers: list[Layer] = [tok] + ([embedding("pos", "tok", seq, seq, dim)] if pos else [])
    units = [Unit(fqn="tok", kind="module", layers=[l.fqn for l in layers],
                  num_params=sum(l.num_params for l in layers), input_bytes=8 * seq, signature="tok")]  # int64 ids in
    for i in range(num_blocks):
        unit, block = gpt_block(f"blocks.{i}", seq=seq, dim=dim, heads=heads)
        units.append(unit)
        layers += block
    ln_f = norm("ln_f", "ln_f", seq, dim)
    head = linear("lm_head", "lm_head", seq, dim, vocab, bias=not tied)
    if tied:
        head.num_params = 0
    units.append(Unit(fqn="ln_f", kind="module", layers=["ln_f"], num_params=ln_f.num_params, saved_bytes=act,
                      input_bytes=act, signature="ln_f"))
    units.append(Unit(fqn="lm_head", kind="module", layers=["lm_head"], num_params=head.num_params,
                      fwd_flops=head.fwd_flops, saved_bytes=act, input_bytes=act, signature="lm_head"))
    layers += [ln_f, head]
    by_name = {l.fqn: l for l in layers}
    unit_index = {u.fqn: k for k, u in enumerate(units)}

    edges: list[Edge] = []

    def edge(src: str, dst: str, ok: bool = False) -> None:
        edges.append(Edge(src=src, dst=dst, bytes=by_name[src].out_bytes, shard_ok=ok))

    stream: list[str] = ["tok"] + (["pos"] if pos else [])  # layers whose outputs were added into the stream so far

    def read_stream(dst: str) -> None:
        here = unit_index[by_name[dst].unit]
        for s in stream:
            if residual == "all" or unit_index[by_name[s].unit] >= here - 1:
                edge(s, dst)

    for i in range(num_blocks):
        u = f"blocks.{i}"
        read_stream(f"{u}.ln_1")
        edge(f"{u}.ln_1", f"{u}.attn.qkv")
        edge(f"{u}.attn.qkv", f"{u}.attn.proj", shard_ok)
        stream.append(f"{u}.attn.proj")
        read_stream(f"{u}.ln_2")
        edge(f"{u}.ln_2", f"{u}.mlp.fc1")
        edge(f"{u}.mlp.fc1", f"{u}.mlp.fc2", shard_ok)
        stream.append(f"{u}.mlp.fc2")
    read_stream("ln_f")
    edge("ln_f", "lm_head")
    return ModelGraph(name=f"gpt-{num_blocks}x{dim}", num_params=sum(l.num_params for l in layers), seq_len=seq,
                      units=units, layers=by_name, edges=edges, cut_bytes=[act] * (len(units) - 1),
                      tied={"lm_head.weight": "tok.weight"} if tied else {}, first_unit_required=["tok"],
                      last_unit_required=["ln_f", "lm_head"],
                      info={"hidden": dim, "heads": heads, "vocab": vocab, "layers": num_blocks},
                      sums=[("tok", "pos")] if pos else [])
