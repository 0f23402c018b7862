"""Hand-built `ModelGraph`s for solver tests (no tracing): a GPT-2-style stack.

    tok (Embedding V x h) -> blocks.i: ln_1, attn.qkv (h -> 3h, fused), attn.proj, ln_2, mlp.fc1 (h -> 4h), mlp.fc2
    -> ln_f -> lm_head (h -> V)

Edges follow what `passes.trace` emits: layer -> layer through non-layer ops, the residual stream reaching the norms
of its own unit and of the next one (``residual="trace"``) or every later norm (``residual="all"``).
"""

from __future__ import annotations

from partc.ir import ACTIVATION_BYTES, Edge, Gemm, Layer, ModelGraph, Unit


def linear(fqn: str, unit: str, tokens: int, in_f: int, out_f: int, *, col_groups: int = 0, row_groups: int = 0,
           fused: int = 1) -> Layer:
    g = Gemm(batch=1, m=tokens, n=out_f, k=in_f, batch_scales=False)
    return Layer(fqn=fqn, type="Linear", kind="linear", unit=unit,
                 params={f"{fqn}.weight": (out_f, in_f), f"{fqn}.bias": (out_f,)}, num_params=out_f * in_f + out_f,
                 in_features=in_f, out_features=out_f, col_groups=col_groups or out_f, row_groups=row_groups or in_f,
                 fused=fused, gemms=[g], fwd_flops=g.flops, out_bytes=tokens * out_f * ACTIVATION_BYTES,
                 saved_bytes=tokens * in_f * ACTIVATION_BYTES)


def norm(fqn: str, unit: str, tokens: int, dim: int) -> Layer:
    return Layer(fqn=fqn, type="LayerNorm", kind="norm", unit=unit,
                 params={f"{fqn}.weight": (dim,), f"{fqn}.bias": (dim,)}, num_params=2 * dim, in_features=dim,
                 out_bytes=tokens * dim * ACTIVATION_BYTES, memory_bytes=2 * tokens * dim * ACTIVATION_BYTES)


def embedding(fqn: str, unit: str, tokens: int, vocab: int, dim: int) -> Layer:
    return Layer(fqn=fqn, type="Embedding", kind="embedding", unit=unit, params={f"{fqn}.weight": (vocab, dim)},
                 num_params=vocab * dim, in_features=dim, out_features=vocab, col_groups=dim, row_groups=vocab,
                 out_bytes=tokens * dim * ACTIVATION_BYTES)


def gpt_graph(*, num_blocks: int = 2, dim: int = 256, heads: int = 8, vocab: int = 1024, seq: int = 512,
              ffn: int | None = None, residual: str = "trace", shard_ok: bool = True) -> ModelGraph:
    """A GPT stack; `shard_ok` False makes qkv -> proj and fc1 -> fc2 unable to stay sharded."""
    ffn = ffn or 4 * dim
    act = seq * dim * ACTIVATION_BYTES
    layers: list[Layer] = [embedding("tok", "tok", seq, vocab, dim)]
    units = [Unit(fqn="tok", kind="module", layers=["tok"], num_params=vocab * dim, signature="tok")]
    for i in range(num_blocks):
        u = f"blocks.{i}"
        block = [norm(f"{u}.ln_1", u, seq, dim),
                 linear(f"{u}.attn.qkv", u, seq, dim, 3 * dim, col_groups=heads, fused=3),
                 linear(f"{u}.attn.proj", u, seq, dim, dim, row_groups=heads),
                 norm(f"{u}.ln_2", u, seq, dim),
                 linear(f"{u}.mlp.fc1", u, seq, dim, ffn),
                 linear(f"{u}.mlp.fc2", u, seq, ffn, dim)]
        hd = dim // heads
        core = [Gemm(batch=heads, m=seq, n=seq, k=hd, batch_scales=True),
                Gemm(batch=heads, m=seq, n=hd, k=seq, batch_scales=True)]
        units.append(Unit(fqn=u, kind="block", layers=[l.fqn for l in block],
                          num_params=sum(l.num_params for l in block), core_gemms=core, input_bytes=act,
                          signature=f"gpt-block:{dim}:{heads}:{ffn}"))
        layers += block
    layers.append(norm("ln_f", "ln_f", seq, dim))
    layers.append(linear("lm_head", "lm_head", seq, dim, vocab))
    units.append(Unit(fqn="ln_f", kind="module", layers=["ln_f"], num_params=2 * dim, signature="ln_f"))
    units.append(Unit(fqn="lm_head", kind="module", layers=["lm_head"], num_params=dim * vocab,
                      signature="lm_head"))
    by_name = {l.fqn: l for l in layers}
    unit_index = {u.fqn: k for k, u in enumerate(units)}

    edges: list[Edge] = []

    def edge(src: str, dst: str, ok: bool = False) -> None:
        edges.append(Edge(src=src, dst=dst, bytes=by_name[src].out_bytes, shard_ok=ok))

    stream: list[str] = ["tok"]  # layers whose outputs were added into the residual stream so far

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
                      first_unit_required=["tok"], last_unit_required=["ln_f", "lm_head"],
                      info={"hidden": dim, "heads": heads, "vocab": vocab, "layers": num_blocks})
