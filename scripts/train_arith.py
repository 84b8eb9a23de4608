#!/usr/bin/env python3
"""Train the bundled tiny DeepSeek-V3 arithmetic model (``configs/arith``) from a seed.

HF transformers' ``DeepseekV3ForCausalLM`` is the trainer, so the checkpoint is standard HF
format by construction. Each step draws fresh random ``a+b=`` pairs (never a held-out one,
see ``arith_data.py``; a fifth of the prompts lack the leading BOS, as prompts tokenized
by clients do); the loss covers only the answer digits, the "\\n" and EOS. The MoE
router's ``e_score_correction_bias`` is trained the way DeepSeek-V3 does it without an
auxiliary loss: after each step every expert's bias moves by ``--bias-update-speed`` toward
balanced load (then all biases are shifted so the smallest is 0, which leaves routing
unchanged and keeps biased scores positive).

    python scripts/train_arith.py --device cuda --steps 1500 --out /tmp/arith

The output directory holds config.json, model.safetensors (bf16; the router bias fp32),
the tokenizer files, generation_config.json and train_log.json (metrics, time, device).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import arith_data  # noqa: E402

ROPE_YARN = {
    "rope_type": "yarn",
    "factor": 2.0,
    "original_max_position_embeddings": 256,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}
ROPE_THETA = 10000.0


def model_config_dict(vocab_size: int) -> dict:
    """The config.json of the bundled model.

    Both ``rope_scaling`` (transformers 4.x, vLLM, DeepSeek's own files) and
    ``rope_parameters`` (transformers 5.x) are written, with the same YaRN values.
    """
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": vocab_size,
        "hidden_size": 256,
        "intermediate_size": 512,
        "moe_intermediate_size": 256,
        "num_hidden_layers": 4,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "q_lora_rank": 128,
        "kv_lora_rank": 64,
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 16,
        "v_head_dim": 32,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "n_group": 2,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": int(
            ROPE_YARN["factor"] * ROPE_YARN["original_max_position_embeddings"]
        ),
        "rope_theta": ROPE_THETA,
        "rope_scaling": dict(ROPE_YARN, type="yarn"),
        "rope_parameters": dict(ROPE_YARN, rope_theta=ROPE_THETA),
        "rope_interleave": True,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 1,
        "num_nextn_predict_layers": 0,
        "use_cache": True,
        "torch_dtype": "bfloat16",
        "dtype": "bfloat16",
    }


def build_model(config: dict):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    # transformers 5.x reads rope_parameters; hand it only that spelling of the YaRN values.
    native = {k: v for k, v in config.items() if k != "rope_scaling"}
    return DeepseekV3ForCausalLM(DeepseekV3Config.from_dict(native))


class RouterBalancer:
    """Aux-loss-free load balancing of DeepSeek-V3: nudge each expert's selection bias."""

    def __init__(self, model, speed: float):
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

        self.speed = speed
        self.routers = [m for m in model.modules() if isinstance(m, DeepseekV3TopkRouter)]
        if not self.routers:
            raise RuntimeError("model has no DeepseekV3TopkRouter (no MoE layer?)")
        self.load = {id(r): None for r in self.routers}
        for r in self.routers:
            r.register_forward_hook(self._record)

    def _record(self, module, _inputs, outputs):
        if not module.training:
            return
        # transformers versions disagree on the order of the router's outputs; the selected
        # expert ids are its one integer tensor.
        (topk_indices,) = [t for t in outputs if not torch.is_floating_point(t)]
        n_experts = module.e_score_correction_bias.numel()
        counts = torch.bincount(topk_indices.flatten(), minlength=n_experts)
        prev = self.load[id(module)]
        self.load[id(module)] = counts if prev is None else prev + counts

    @torch.no_grad()
    def step(self) -> list[list[float]]:
        """Apply the bias update; return each layer's expert load fractions of this step."""
        fractions = []
        for r in self.routers:
            load = self.load[id(r)]
            self.load[id(r)] = None
            if load is None:
                continue
            load = load.float()
            bias = r.e_score_correction_bias
            bias.add_(self.speed * torch.sign(load.mean() - load))
            bias.sub_(bias.min())
            fractions.append(load / load.sum())
        return fractions


def lr_at(step: int, steps: int, warmup: int, peak: float) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def canonical_state_dict(model, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The weights under DeepSeek's checkpoint names (one tensor per expert projection).

    transformers 5.x keeps experts fused ([E, 2I, H] gate_up and [E, H, I] down); real
    DeepSeek checkpoints, vLLM and transformers 4.x name every expert's projections.
    The router's correction bias stays fp32, as in DeepSeek-V3's release.
    """
    out = {}
    for name, t in model.state_dict().items():
        t = t.detach().to("cpu")
        if name.endswith("e_score_correction_bias"):
            out[name] = t.float().contiguous()
        elif name.endswith("mlp.experts.gate_up_proj"):
            prefix = name[: -len("gate_up_proj")]
            inter = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{prefix}{e}.gate_proj.weight"] = t[e, :inter].to(dtype).contiguous()
                out[f"{prefix}{e}.up_proj.weight"] = t[e, inter:].to(dtype).contiguous()
        elif name.endswith("mlp.experts.down_proj"):
            prefix = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                out[f"{prefix}{e}.down_proj.weight"] = t[e].to(dtype).contiguous()
        else:
            out[name] = t.to(dtype).contiguous()
    return out


def export_checkpoint(model, config: dict, out_dir: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    weights = canonical_state_dict(model, torch.bfloat16)
    save_file(weights, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    gen = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"],
           "pad_token_id": config["pad_token_id"]}
    with open(os.path.join(out_dir, "generation_config.json"), "w", encoding="utf-8") as f:
        json.dump(gen, f, indent=2)
        f.write("\n")
    arith_data.write_tokenizer_files(out_dir)
    return weights


def verify_export(out_dir: str, weights: dict[str, torch.Tensor], device: str):
    """Reload the checkpoint with HF and check every parameter came back bit-exact."""
    from transformers import AutoTokenizer, DeepseekV3ForCausalLM

    reloaded = DeepseekV3ForCausalLM.from_pretrained(out_dir, dtype=torch.float32)
    again = canonical_state_dict(reloaded, torch.float32)
    if again.keys() != weights.keys():
        raise RuntimeError(f"reloaded keys differ: {sorted(again.keys() ^ weights.keys())[:5]}")
    for k, v in weights.items():
        if not torch.equal(again[k], v.float()):
            raise RuntimeError(f"reloaded tensor {k} differs from the exported one")
    hf_tok = AutoTokenizer.from_pretrained(out_dir)
    if hf_tok("12+30=").input_ids != arith_data.build_tokenizer().encode("12+30=").ids:
        raise RuntimeError("AutoTokenizer and tokenizers disagree on '12+30='")
    return reloaded.to(device)


def write_log(out_dir: str, log: dict) -> None:
    with open(os.path.join(out_dir, "train_log.json"), "w", encoding="utf-8") as f:
        json.dump(log, f, indent=2)
        f.write("\n")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", required=True, help="checkpoint directory to write")
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--bias-update-speed", type=float, default=1e-3)
    p.add_argument("--no-bos-fraction", type=float, default=0.2,
                   help="share of training prompts sent without the leading BOS")
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--eval-n", type=int, default=500, help="held-out pairs per periodic eval")
    p.add_argument("--final-eval-n", type=int, default=2000)
    args = p.parse_args(argv)
    if args.steps < 1 or args.batch_size < 1:
        p.error("--steps and --batch-size must be positive")
    if not 0.0 <= args.no_bos_fraction < 1.0:
        p.error("--no-bos-fraction must be in [0, 1)")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("--device cuda requested but CUDA is not available")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    device = torch.device(args.device)
    use_bf16 = device.type == "cuda"

    tok = arith_data.build_tokenizer()
    config = model_config_dict(tok.get_vocab_size())
    model = build_model(config).to(device)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"DeepseekV3ForCausalLM: {n_params / 1e6:.2f} M parameters, device {device}", flush=True)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95),
    )
    balancer = RouterBalancer(model, args.bias_update_speed)
    eval_pairs = arith_data.held_out_pairs(args.eval_n)
    history = []
    t0 = time.perf_counter()
    for step in range(args.steps):
        lr = lr_at(step, args.steps, args.warmup, args.lr)
        for g in opt.param_groups:
            g["lr"] = lr
        a, b = arith_data.sample_training_pairs(rng, args.batch_size)
        without_bos = rng.random(len(a)) < args.no_bos_fraction
        ids, labels = arith_data.encode_training_batch(tok, a, b, without_bos)
        ids, labels = ids.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_bf16):
            loss = model(input_ids=ids, labels=labels, use_cache=False).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        load = balancer.step()
        last = step + 1 == args.steps
        if (step + 1) % args.log_every == 0 or last:
            max_load = max(float(f.max()) for f in load) if load else float("nan")
            print(f"step {step + 1:5d}  loss {loss.item():.4f}  lr {lr:.2e}  "
                  f"max expert load {max_load:.3f}  {time.perf_counter() - t0:6.1f}s", flush=True)
        if (step + 1) % args.eval_every == 0 or last:
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_bf16):
                acc, _ = arith_data.greedy_exact_match(model, tok, eval_pairs, device)
                acc_nb, _ = arith_data.greedy_exact_match(
                    model, tok, eval_pairs, device, with_bos=False
                )
            elapsed = time.perf_counter() - t0
            history.append({"step": step + 1, "loss": loss.item(), "heldout_exact_match": acc,
                            "heldout_exact_match_without_bos": acc_nb, "seconds": elapsed})
            print(f"step {step + 1:5d}  held-out greedy exact match {acc:.4f} "
                  f"(without BOS {acc_nb:.4f}; {len(eval_pairs)} pairs)  {elapsed:6.1f}s",
                  flush=True)
    train_seconds = time.perf_counter() - t0

    import transformers

    log = {
        "command": " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]),
        "args": vars(args),
        "parameters": n_params,
        "train_seconds": round(train_seconds, 1),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda"
        else platform.processor() or "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "history": history,
        "router_bias": [r.e_score_correction_bias.tolist() for r in balancer.routers],
    }
    weights = export_checkpoint(model, config, args.out)
    write_log(args.out, log)  # before verification, so a failure there keeps the record

    reloaded = verify_export(args.out, weights, device)
    final_pairs = arith_data.held_out_pairs(args.final_eval_n)
    acc, failures = arith_data.greedy_exact_match(reloaded, tok, final_pairs, device)
    short = [(x, y) for x, y in arith_data.held_out_pairs() if x < 100 and y < 100]
    acc_short, _ = arith_data.greedy_exact_match(reloaded, tok, short, device)
    acc_no_bos, _ = arith_data.greedy_exact_match(
        reloaded, tok, final_pairs, device, with_bos=False
    )
    print(f"exported checkpoint (bf16, reloaded with HF, fp32 compute): held-out greedy exact "
          f"match {acc:.4f} on {len(final_pairs)} pairs ({acc_no_bos:.4f} without BOS), "
          f"{acc_short:.4f} on {len(short)} pairs with a, b < 100; "
          f"training took {train_seconds:.1f}s", flush=True)
    for a_, b_, got in failures[:10]:
        print(f"  miss: {a_}+{b_}= -> {got!r}")
    log["final"] = {
        "heldout_pairs": len(final_pairs), "heldout_exact_match": acc,
        "heldout_exact_match_without_bos": acc_no_bos,
        "short_pairs": len(short), "short_exact_match": acc_short,
        "failures": [list(f) for f in failures[:20]],
    }
    write_log(args.out, log)
    return 0


if __name__ == "__main__":
    sys.exit(main())
