"""The CPU fast path of dense and MoE models: each engine step's whole layer stack in one compiled call.

`FusedForward.run` replaces DenseForCausalLM's and MoeForCausalLM's module-by-module forward for every step (decode rows,
prefill chunks, mixes of both) when the model can run on kernels/cpu_decoder.py: on the CPU in
float32, every linear on the q8 backend (each projection in the file's own type: q/k/v or gate/up of
different types run as separate kernel calls inside the one compiled step; a sparse MoE layer's router on the q8
kernels and its routed experts on kernels/moe_cpu's kernel, where they lie). Anything else (dense or
int4 weights, other dtypes, GPUs) runs the module forward, which also stays the reference the fused path is tested against.
The engine's fused_forward=False (env NANOCHAT_FUSED_FORWARD=0, KernelOptions.fused_forward) turns it off.

The lean plan: a load that maps its weights from the pack cache also keeps, beside them, this model's fused
decoder as plain arrays and cache names (`keep_lean_plan`), with the embedding and head around it. The lean
one-shot (engine/lean.py) rebuilds the same FusedDecoder from it with numpy buffers, without torch and without
describing the model a second time.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import TYPE_CHECKING

from nanochat.kernels.options import DEFAULT, KernelOptions

if TYPE_CHECKING:   # torch only where the engine's model is at hand: the lean one-shot reads plans without it
    import torch

    from nanochat.models.layers.attention import AttnMetadata

OFF_REASON = "turned off (fused_forward=False, NANOCHAT_FUSED_FORWARD=0)"


def _packed(linear) -> list | None:
    """The q8-packed weights of a Linear, in output order (one, or one per differently typed segment)."""
    from nanochat.kernels.cpu_qgemv import PackedWeight

    parts = linear.quant_parts()
    if not parts or any(p.backend != "q8" for p in parts):
        return None
    return [PackedWeight(p.ggml_type, p.shape, p.weight) for p in parts]


def _why_not_q8(name: str, linear) -> str:
    from nanochat.kernels import gguf_quants as gq

    parts = linear.quant_parts()
    if not parts:
        return f"{name} is a dense {tuple(linear.weight.shape)} {linear.weight.dtype} matrix (not GGUF blocks)"
    off = next(p for p in parts if p.backend != "q8")
    return f"{name} ({gq.type_name(off.ggml_type)}) is on the {off.backend} backend, not the q8 kernels"


def _is_moe(mlp) -> bool:
    from nanochat.models.layers.moe import SparseMoeBlock

    return isinstance(mlp, SparseMoeBlock)


def _moe_why_not(mlp) -> str | None:
    """Why a sparse MoE block (models/layers/moe.py SparseMoeBlock) cannot run in the compiled step, or None."""
    if mlp.shared_expert is not None:
        return "a shared expert (not in the compiled step)"
    host = getattr(mlp.experts, "host", None)
    if host is None:
        return "experts not on the host kernels (moe_offload)"
    if host.backend != "kernel":
        return "expert weight types without a CPU kernel"
    return None


def _moe(mlp):
    from nanochat.kernels.cpu_decoder import MoeMlp

    gate = mlp.gate
    return MoeMlp(router=_packed(gate)[0], experts=mlp.experts.host, top_k=mlp.top_k, routing=mlp.router,
                  renormalize=mlp.renormalize,
                  router_bias=None if gate.bias is None else gate.bias.data.float().contiguous())


class FusedForward:
    """Builds the fused decoder for a model on first use (after the KV cache exists) and rebuilds it if
    the cache is reallocated. `why_not` says why a model cannot use it (None when it can)."""

    def __init__(self, model, options: KernelOptions = DEFAULT):
        # A weak reference: the model owns this object, and a cycle would keep a replaced model's memory
        # until a full garbage collection.
        self._model = weakref.ref(model)
        self.options = options
        self.why_not = self._check(model)
        self._decoder = None

    def _check(self, model) -> str | None:
        if not self.options.fused_forward:
            return OFF_REASON
        if model.tp.on:
            return "tensor parallel (the compiled step has no all-reduce between its layers)"
        if model.backend.kind != "torch" or model.norm.weight.device.type != "cpu":
            return "not on the CPU"
        if str(model.norm.weight.dtype) != "torch.float32":
            return f"dtype {model.norm.weight.dtype} (needs float32)"
        from nanochat.kernels import cpu_qgemv
        if not cpu_qgemv.available():
            return "the CPU kernels are not available"
        for i, layer in enumerate(model.layers):
            a, m = layer.self_attn, layer.mlp
            linears = [("qkv_proj", a.qkv_proj), ("o_proj", a.o_proj)]
            if _is_moe(m):
                why = _moe_why_not(m)
                if why:
                    return f"layer {i} MoE MLP: {why}"
                linears.append(("router", m.gate))
            else:
                linears += [("gate_up_proj", m.gate_up_proj), ("down_proj", m.down_proj)]
            for name, lin in linears:
                if _packed(lin) is None:
                    return f"layer {i} {name}: " + _why_not_q8(name, lin)
        return None

    def usable(self) -> bool:
        return self.why_not is None

    def recheck(self) -> None:
        """Decide again after the model's linears changed (models.layers.use_batch_invariant_kernels)."""
        self.why_not = self._check(self._model())
        self._decoder = None

    def run(self, x: torch.Tensor, positions: torch.Tensor, meta: AttnMetadata) -> torch.Tensor:
        model = self._model()
        first = model.layers[0].self_attn
        if self._decoder is None or not self._decoder.uses(first.k_cache):
            self._decoder = self._build()
        x = x.contiguous() if str(x.dtype) == "torch.float32" else x.float().contiguous()
        return self._decoder.forward(x, positions, meta.slot_mapping, meta.cu_seqlens_q, meta.block_tables,
                                     meta.context_lens, self.options.act_levels, self.options.threads,
                                     meta.window_slot_mapping, meta.window_block_tables)

    def _build(self):
        from nanochat.kernels.cpu_decoder import FusedDecoder

        model = self._model()
        attn0 = model.layers[0].self_attn
        dims, layers, cos, sin, final_norm = self._describe(attn0.k_cache.shape[1], caches=True)
        return FusedDecoder(dims, layers, cos, sin, final_norm)

    def _describe(self, block_size: int, caches: bool):
        """(DecoderDims, DecoderLayers, cos, sin, final norm) of the model; caches=False leaves the layers' K/V
        caches None (the lean plan: the one-shot brings its own)."""
        from nanochat.kernels.cpu_decoder import DecoderDims, DecoderLayer

        model = self._model()
        cfg = model.config
        attn0 = model.layers[0].self_attn
        dense = next((layer.mlp for layer in model.layers if not _is_moe(layer.mlp)), None)   # MoE models: maybe none
        dims = DecoderDims(layers=len(model.layers), hidden=cfg.hidden_size, heads=attn0.num_heads,
                           kv_heads=attn0.num_kv_heads, head_dim=attn0.head_dim,
                           intermediate=0 if dense is None else _packed(dense.down_proj)[0].in_features,
                           rotary_dim=model.rotary.rotary_dim, block_size=block_size,
                           eps=model.norm.eps, activation="silu" if dense is None else dense.act,
                           attention_scale=attn0.scale)
        layers = []
        for layer in model.layers:
            a, m = layer.self_attn, layer.mlp
            moe = _is_moe(m)
            layers.append(DecoderLayer(
                input_norm=layer.input_layernorm.weight.data, post_norm=layer.mlp_norm.weight.data,
                qkv=_packed(a.qkv_proj), o=_packed(a.o_proj)[0], gate_up=None if moe else _packed(m.gate_up_proj),
                down=None if moe else _packed(m.down_proj)[0], moe=_moe(m) if moe else None,
                o_bias=None if a.o_proj.bias is None else a.o_proj.bias.data.float().contiguous(),
                k_cache=a.k_cache if caches else None,
                v_cache=a.v_cache if caches else None,
                qkv_bias=None if a.qkv_proj.bias is None else a.qkv_proj.bias.data.float().contiguous(),
                q_norm=None if a.q_norm is None else a.q_norm.weight.data,
                k_norm=None if a.k_norm is None else a.k_norm.weight.data, rope=a.rotary is not None,
                cos=None if a.rotary in (None, model.rotary) else a.rotary.cos,
                sin=None if a.rotary in (None, model.rotary) else a.rotary.sin, window=a.window,
                attn_out_norm=None if layer.attn_out_norm is None else layer.attn_out_norm.weight.data,
                mlp_out_norm=None if layer.mlp_out_norm is None else layer.mlp_out_norm.weight.data,
                sinks=None if a.sinks is None else a.sinks.detach().float().contiguous()))
        return dims, layers, model.rotary.cos, model.rotary.sin, model.norm.weight.data

    def keep_lean_plan(self, cache, source, max_positions: int) -> None:
        """Write the lean plan beside the pack cache `cache` (models/formats/pack_cache.PackCache) unless one for
        this many positions is there. Nothing is written when the lean path could not run the model the way
        the engine does: the fused step off, an embedding that is not the tied head's packed tiles, a head off the
        q8 kernels, tiles that are not in the cache file, MoE layers (their experts are views of the model file,
        which the lean one-shot does not map)."""
        import torch

        from nanochat.kernels.cpu_qgemv import PackedWeight
        from nanochat.models.formats import pack_cache

        name = lean_plan_name(cache.key)
        kept = pack_cache.read_arrays(name)
        if not self.usable() or (kept is not None and kept[0].get("max_positions") == max_positions):
            return
        model = self._model()
        if any(_is_moe(layer.mlp) for layer in model.layers):
            return
        head = model.lm_head
        embed = getattr(model.embed_tokens, "packed", None)
        head_parts = head.quant_parts() if head.gather is None and head.reduce is None else None
        if embed is None or not head_parts or len(head_parts) != 1 or head_parts[0].backend != "q8" \
                or head_parts[0].prefill_weight is not None:
            return
        arrays: dict = {}
        names: dict[int, str] = {}

        def buffer(t):
            """A tensor's array name (each distinct tensor stored once: layers share RoPE tables)."""
            if t is None:
                return None
            key = t.data_ptr()
            if key not in names:
                names[key] = f"a{len(names)}"
                arrays[names[key]] = t.detach().contiguous().numpy()
            return names[key]

        def weight(w: PackedWeight):
            cached = cache.name_of(w.data)
            if cached is None:
                raise LookupError
            return {"tiles": cached, "type": int(w.ggml_type), "shape": list(w.shape)}

        def field(value):
            if isinstance(value, PackedWeight):
                return {"weight": weight(value)}
            if isinstance(value, list):
                return {"weights": [weight(w) for w in value]}
            if isinstance(value, torch.Tensor):
                return {"array": buffer(value)}
            return {"value": value}

        dims, layers, cos, sin, final_norm = self._describe(0, caches=False)
        p = head_parts[0]
        try:
            meta = {
                "version": LEAN_PLAN_VERSION, "max_positions": max_positions,
                "dims": dataclasses.asdict(dims),
                "layers": [{f.name: field(getattr(layer, f.name)) for f in dataclasses.fields(layer)
                            if f.name not in ("k_cache", "v_cache")} for layer in layers],
                "cos": buffer(cos), "sin": buffer(sin), "final_norm": buffer(final_norm),
                "embedding": weight(embed),
                "head": weight(PackedWeight(p.ggml_type, p.shape, p.weight)),
                "head_bias": buffer(None if head.bias is None else head.bias.data.float()),
                "embed_scale": float(model.embed_scale), "softcap": model.softcap or None,
                "vocab_size": model.config.vocab_size, "arch": model.config.arch,
                "max_position_embeddings": model.config.max_position_embeddings,
                "eos_ids": [int(i) for i in source.eos_ids()], "stated_sampling": source.stated_sampling(),
            }
        except LookupError:   # a tile the cache file does not hold (its write failed): no plan
            return
        pack_cache.write_arrays(name, meta, arrays)


LEAN_PLAN_VERSION = 1


def lean_plan_name(cache_key: str) -> str:
    """The file name (in the pack cache's folder) of the lean plan of a model whose pack cache key is this."""
    return f"{cache_key}.nc-lean"



@dataclasses.dataclass
class LeanModel:
    """A model as the lean plan has it, on numpy buffers: the fused decoder (over the caller's KV caches), the
    embedding's and head's packed tiles, and what the engine does around them."""

    decoder: object                 # kernels.cpu_decoder.FusedDecoder
    embedding: object               # kernels.cpu_qgemv.PackedWeight
    head: object                    # kernels.cpu_qgemv.PackedWeight
    head_bias: object | None        # float32 [vocab] or None
    embed_scale: float
    softcap: float | None


def lean_plan_weights(cache, meta: dict) -> dict | None:
    """Every packed weight a lean plan names, mapped from the pack cache `cache` (PackCache): {tiles name:
    PackedWeight over numpy}; None when any is missing (the lean path does not apply)."""
    from nanochat.kernels.cpu_qgemv import PackedWeight

    refs = [meta["embedding"], meta["head"]]
    for layer in meta["layers"]:
        for f in layer.values():
            refs += [f["weight"]] if "weight" in f else f.get("weights", [])
    found = {}
    for ref in refs:
        tiles = cache.lookup_array(ref["tiles"], ref["type"], tuple(ref["shape"]))
        if tiles is None:
            return None
        found[ref["tiles"]] = PackedWeight(ref["type"], tuple(ref["shape"]), tiles)
    return found


def lean_model(meta: dict, arrays: dict, weights: dict, block_size: int, k_caches: list, v_caches: list) -> LeanModel:
    """The LeanModel of a plan (`meta`, `arrays`: pack_cache.read_arrays; `weights`: lean_plan_weights) over the
    given per-layer KV caches [num_blocks, block_size, kv_heads, head_dim]."""
    from nanochat.kernels.cpu_decoder import DecoderDims, DecoderLayer, FusedDecoder

    def value(f: dict):
        if "weight" in f:
            return weights[f["weight"]["tiles"]]
        if "weights" in f:
            return [weights[w["tiles"]] for w in f["weights"]]
        if "array" in f:
            return None if f["array"] is None else arrays[f["array"]]
        return f["value"]

    dims = DecoderDims(**{**meta["dims"], "block_size": block_size})
    layers = [DecoderLayer(**{k: value(f) for k, f in layer.items()}, k_cache=k, v_cache=v)
              for layer, k, v in zip(meta["layers"], k_caches, v_caches)]
    decoder = FusedDecoder(dims, layers, arrays[meta["cos"]], arrays[meta["sin"]], arrays[meta["final_norm"]])
    return LeanModel(decoder, weights[meta["embedding"]["tiles"]], weights[meta["head"]["tiles"]],
                     None if meta["head_bias"] is None else arrays[meta["head_bias"]], meta["embed_scale"],
                     meta["softcap"])
