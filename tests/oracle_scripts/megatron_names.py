"""A tiny megatron-core GPTModel saved as a DCP folder under its distributed-checkpoint names, and its logits.

argv[1] is JSON: {"folder": DCP folder to write, "npz": per-layer state dict to write, "logits": .npy to
write (or null), "family": "llama" | "qwen2.5" | "qwen3" | "qwen3-moe", "config": config.json to write}.
The DCP holds what ``model.sharded_state_dict()`` names (layers stacked on a leading axis, the local spec's norms as
``linear_qkv.layer_norm_weight`` / ``linear_fc1.layer_norm_weight``), saved with plain
``torch.distributed.checkpoint.save``; ``load`` mode reads a DCP folder back into the npz.
"""

import json
import os
import sys
import warnings

warnings.filterwarnings("ignore")
ARGS = json.loads(sys.argv[1])
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", str(ARGS.get("port", 29561)))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402


def model_and_config():
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    moe = ARGS["family"] == "qwen3-moe"
    qk = ARGS["family"] in ("qwen3", "qwen3-moe")
    extra = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, moe_aux_loss_coeff=0.0) if moe else {}
    if ARGS["family"] == "qwen2.5":
        extra["add_qkv_bias"] = True  # Qwen2's q/k/v biases, megatron's linear_qkv.bias
    cfg = TransformerConfig(
        **extra,
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=96,
        kv_channels=24,
        use_cpu_initialization=True,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        normalization="RMSNorm",
        layernorm_epsilon=1e-6,
        qk_layernorm=qk,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_dropout_fusion=False,
    )
    torch.manual_seed(0)
    spec = get_gpt_layer_local_spec(num_experts=4 if moe else None, qk_layernorm=qk, normalization="RMSNorm")
    model = GPTModel(
        cfg,
        spec,
        vocab_size=96,
        max_sequence_length=64,
        position_embedding_type="rope",
        rotary_base=10000,
        share_embeddings_and_output_weights=False,
    ).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    arch, kind = {
        "llama": ("LlamaForCausalLM", "llama"),
        "qwen3": ("Qwen3ForCausalLM", "qwen3"),
        "qwen3-moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
        "qwen2.5": ("Qwen2ForCausalLM", "qwen2"),
    }[ARGS["family"]]
    hf = {
        "architectures": [arch],
        "model_type": kind,
        "vocab_size": 96,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 24,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 64,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "attention_bias": False,
        "torch_dtype": "float32",
    }
    if moe:
        hf.update(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            router_aux_loss_coef=0.0,
        )
    return model, hf


def stacked(model):
    """The sharded_state_dict's keys and global tensors: per-layer tensors stacked on a layer axis."""
    out, layers = {}, {}
    names = {
        "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
        "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
    }
    for k, v in model.state_dict().items():
        if "_extra_state" in k:
            continue
        if k.startswith("decoder.layers."):
            _, _, n, rest = k.split(".", 3)
            if rest.startswith("mlp.experts.local_experts."):
                _, _, _, e, fc = rest.split(".", 4)
                layers.setdefault("mlp.experts.experts." + fc, {}).setdefault(int(n), {})[int(e)] = v
            else:
                layers.setdefault(names.get(rest, rest), {})[int(n)] = v
        else:
            out[k] = v
    for rest, by_layer in layers.items():
        per_layer = [by_layer[i] for i in sorted(by_layer)]
        if isinstance(per_layer[0], dict):  # experts: [layers, experts, ...]
            per_layer = [torch.stack([d[e] for e in sorted(d)]) for d in per_layer]
        out["decoder.layers." + rest] = torch.stack(per_layer)
    return out


def main():
    if ARGS.get("mode") == "load":
        sd = {}
        meta = dcp.FileSystemReader(ARGS["folder"]).read_metadata()
        for k, md in meta.state_dict_metadata.items():
            sd[k] = torch.empty(md.size, dtype=md.properties.dtype)
        dcp.load(sd, checkpoint_id=ARGS["folder"], no_dist=True)
        np.savez(ARGS["npz"], **{k: v.numpy() for k, v in sd.items()})
        return

    model, hf = model_and_config()
    with open(ARGS["config"], "w") as f:
        json.dump(hf, f)
    np.savez(ARGS["npz"], **{k: v.numpy() for k, v in model.state_dict().items() if "_extra_state" not in k})
    dcp.save(stacked(model), checkpoint_id=ARGS["folder"], no_dist=True)
    if ARGS.get("logits"):
        # megatron's rotary embedding and its dropout RNG tracker ask for the GPU; the model is on CPU
        import contextlib

        from megatron.core.tensor_parallel import random as megatron_random

        torch.cuda.current_device = lambda: "cpu"
        megatron_random.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
        from megatron.core.transformer.moe import router  # its gating matmul is Transformer Engine's: plain on CPU

        def gating(inp, weight, bias, dtype):
            return torch.nn.functional.linear(inp.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype))

        router.router_gating_linear = gating
        ids = torch.arange(24).reshape(2, 12) % 96
        pos = torch.arange(12).unsqueeze(0).expand(2, 12)
        mask = torch.triu(torch.ones(1, 1, 12, 12, dtype=torch.bool), diagonal=1)
        with torch.no_grad():
            logits = model(ids, pos, mask)
        np.save(ARGS["logits"], logits.float().numpy())


if __name__ == "__main__":
    main()
