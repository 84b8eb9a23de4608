#!/usr/bin/env python3
"""Train the tiny DeepSeek-V4.1 arithmetic model (``configs/arith-v41``) from a seed.

mlaserve's own V4.1 model is the trainer (:func:`model.v41.training.forward_sequences`, the
inference forward's numerics, batched over whole sequences), so the checkpoint is what
``model.v4_family.load_v4_family`` reads by construction (HF-V4.1 tensor names). Each step draws
fresh random ``a+b=`` pairs (never a held-out one, see ``arith_data.py``); a share of the
prompts carries a preamble of earlier solved sums, so sequences run past the 16-token window
and the compressed entries and the indexer take part; a fifth lack the leading BOS. The loss
covers every answer's digits and "\\n" and the final EOS, plus the indexer's KL loss. The
router biases follow DeepSeek's auxiliary-loss-free balancing. Training stops at ``--steps``
or after ``--max-seconds``, whichever comes first (the cosine schedule follows the nearer one).

    python scripts/train_arith_v41.py --device cuda --steps 3000 --max-seconds 200 --out /tmp/arith-v41

The output directory holds config.json, model.safetensors (bf16; mHC, sinks and router biases
fp32), the tokenizer files, generation_config.json and train_log.json.
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

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_CONFIG = os.path.join(REPO, "configs", "arith-v41.json")
DEMO_PROMPT = (123, 456)


def load_config(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def build_model(config: dict, tokenizer_json: str, seed: int, device):
    from model.config import parse_model_config
    from model.v41.model import DeepseekV41ForCausalLM
    from model.v41.training import prepare_for_training

    with torch.device(device):
        model = DeepseekV41ForCausalLM(parse_model_config(config), torch.float32)
    prepare_for_training(model, seed)
    return model.bind_tokenizer(tokenizer_json)


def lr_at(step: int, progress: float, warmup: int, peak: float) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def stored_dtypes(config: dict) -> dict[str, torch.dtype]:
    """Each tensor's dtype in a bf16 V4.1 checkpoint: what a bf16 model holds (mHC, sinks,
    router biases and engram scales stay float32)."""
    from model.config import parse_model_config
    from model.v41.model import DeepseekV41ForCausalLM

    with torch.device("meta"):
        model = DeepseekV41ForCausalLM(parse_model_config(config), torch.bfloat16)
    return {k: v.dtype for k, v in model.state_dict().items()}


def export_checkpoint(model, config: dict, out_dir: str) -> None:
    """Round the weights to their stored dtypes in place (so the in-memory model is the
    exported one) and write the checkpoint directory."""
    from safetensors.torch import save_file

    from model.shard_writer import write_generation_config

    os.makedirs(out_dir, exist_ok=True)
    dtypes = stored_dtypes(config)
    weights = {}
    with torch.no_grad():
        for name, p in model.state_dict().items():
            stored = p.detach().to(dtypes[name])
            p.copy_(stored.to(p.dtype))
            weights[name] = stored.cpu().contiguous()
    save_file(weights, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    text = config.get("text_config", config)
    write_generation_config(out_dir, text["bos_token_id"], text["eos_token_id"])
    arith_data.write_tokenizer_files(out_dir)


def write_log(out_dir: str, log: dict) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "train_log.json"), "w", encoding="utf-8") as f:
        json.dump(log, f, indent=2)
        f.write("\n")


def logits_fn(model):
    from model.v41.training import forward_sequences

    return lambda ids: forward_sequences(model, ids).logits


def evaluate(model, tok, rows, device, with_bos=True):
    was_training = model.training
    model.eval()
    acc, failures = arith_data.greedy_exact_match_logits(logits_fn(model), tok, rows, device, with_bos=with_bos)
    model.train(was_training)
    return acc, failures


def greedy_incremental(model, tok, text: str, max_tokens: int = 6) -> str:
    """Greedy continuation through the inference path (one request, prefill then decode)."""
    device = next(model.parameters()).device
    state = model.new_state()
    logits = model(torch.tensor(tok.encode(text).ids, device=device), state)[-1]
    out = []
    for _ in range(max_tokens):
        token = int(logits.argmax())
        out.append(token)
        if token == tok.token_to_id(arith_data.EOS):
            break
        logits = model(torch.tensor([token], device=device), state)[-1]
    return tok.decode(out, skip_special_tokens=False)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=DEFAULT_CONFIG, help="V4.1 config.json of the model to train")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--max-seconds", type=float, default=200.0, help="wall-clock budget of the training loop")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", required=True, help="checkpoint directory to write")
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--bias-update-speed", type=float, default=1e-3)
    p.add_argument("--indexer-loss-weight", type=float, default=1.0)
    p.add_argument("--no-bos-fraction", type=float, default=0.2)
    p.add_argument("--fewshot-fraction", type=float, default=0.6,
                   help="share of training prompts with a preamble of solved sums")
    p.add_argument("--min-shots", type=int, default=2)
    p.add_argument("--max-shots", type=int, default=5)
    p.add_argument("--bf16", action="store_true", help="bf16 autocast (default: float32, TF32 matmuls on CUDA)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--eval-n", type=int, default=500, help="held-out pairs per periodic eval")
    p.add_argument("--final-eval-n", type=int, default=2000)
    args = p.parse_args(argv)
    if args.steps < 1 or args.batch_size < 1 or args.max_seconds <= 0:
        p.error("--steps, --batch-size and --max-seconds must be positive")
    if not 0 <= args.min_shots <= args.max_shots:
        p.error("--min-shots must be between 0 and --max-shots")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("--device cuda requested but CUDA is not available")
    return args


def main(argv=None) -> int:
    run(argv)
    return 0


def run(argv=None):
    """Train, export and check; returns (the trained model as exported, the training log)."""
    from model.v41.training import forward_sequences, masked_lm_loss, update_router_biases

    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    os.makedirs(args.out, exist_ok=True)
    arith_data.write_tokenizer_files(args.out)
    tokenizer_json = os.path.join(args.out, "tokenizer.json")
    tok = arith_data.build_tokenizer()
    config = load_config(args.config)
    model = build_model(config, tokenizer_json, args.seed, device)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"DeepseekV41ForCausalLM: {n_params / 1e6:.2f} M parameters, device {device}", flush=True)
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(
        [{"params": [p for p in trained if p.dim() >= 2], "weight_decay": args.weight_decay},
         {"params": [p for p in trained if p.dim() < 2], "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), **({"fused": True} if device.type == "cuda" else {}),
    )
    eval_bare = [([], a, b) for a, b in arith_data.held_out_pairs(args.eval_n)]
    eval_fewshot = arith_data.held_out_fewshot_rows(args.eval_n, args.min_shots, args.max_shots)
    width = arith_data.fewshot_max_tokens(args.max_shots)  # one batch shape for every step
    history, losses, step = [], [], 0
    t0 = time.perf_counter()
    while step < args.steps:
        elapsed = time.perf_counter() - t0
        progress = max(step / args.steps, elapsed / args.max_seconds)
        if progress >= 1.0:
            break
        lr = lr_at(step, progress, args.warmup, args.lr)
        for g in opt.param_groups:
            g["lr"] = lr
        rows = arith_data.sample_fewshot_rows(rng, args.batch_size, args.fewshot_fraction,
                                              args.min_shots, args.max_shots)
        without_bos = rng.random(len(rows)) < args.no_bos_fraction
        ids, labels = arith_data.encode_fewshot_batch(tok, rows, without_bos, width)
        ids, labels = ids.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16):
            out = forward_sequences(model, ids)
            lm_loss = masked_lm_loss(out.logits, labels)
            indexer_loss = torch.stack(out.indexer_losses).mean() if out.indexer_losses else lm_loss * 0
        opt.zero_grad(set_to_none=True)
        (lm_loss + args.indexer_loss_weight * indexer_loss).backward()
        torch.nn.utils.clip_grad_norm_(trained, 1.0)
        opt.step()
        load = update_router_biases(model, out.expert_ids, args.bias_update_speed)
        step += 1
        if step % args.log_every == 0:
            if not math.isfinite(lm_loss.item()):
                write_log(args.out, {"args": vars(args), "steps": step, "loss_curve": losses, "history": history})
                raise RuntimeError(f"the loss is {lm_loss.item()} at step {step}: training diverged "
                                   f"(try a lower --lr than {args.lr})")
            max_load = max(float(f.max()) for f in load) if load else float("nan")
            losses.append([step, round(lm_loss.item(), 5)])
            print(f"step {step:5d}  loss {lm_loss.item():.4f}  indexer KL {indexer_loss.item():.4f}  "
                  f"lr {lr:.2e}  T {ids.shape[1]}  max expert load {max_load:.3f}  "
                  f"{time.perf_counter() - t0:6.1f}s", flush=True)
        if step % args.eval_every == 0:
            acc, _ = evaluate(model, tok, eval_bare, device)
            acc_fs, _ = evaluate(model, tok, eval_fewshot, device)
            elapsed = time.perf_counter() - t0
            history.append({"step": step, "loss": lm_loss.item(), "indexer_kl": indexer_loss.item(),
                            "heldout_exact_match": acc, "heldout_fewshot_exact_match": acc_fs,
                            "seconds": round(elapsed, 1)})
            print(f"step {step:5d}  held-out greedy exact match {acc:.4f}, with preamble {acc_fs:.4f} "
                  f"({len(eval_bare)} pairs)  {elapsed:6.1f}s", flush=True)
    train_seconds = time.perf_counter() - t0
    print(f"trained {step} steps in {train_seconds:.1f}s ({step / train_seconds:.2f} steps/s)", flush=True)

    log = {
        "command": " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]),
        "args": vars(args),
        "parameters": n_params,
        "steps": step,
        "train_seconds": round(train_seconds, 1),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "history": history,
        "loss_curve": losses,
        "router_bias": [layer.ffn.gate.bias.tolist() for layer in model.model.layers],
    }
    export_checkpoint(model, config, args.out)
    write_log(args.out, log)  # before verification, so a failure there keeps the record
    log["final"] = final_checks(model, tok, args, device)
    write_log(args.out, log)
    return model, log


def final_checks(model, tok, args, device) -> dict:
    """Reload the checkpoint through the serving loader, check it is the in-memory model, and
    score it: batched greedy on held-out pairs (bare and with preambles, fp32 and bf16 compute)
    and the inference path (prefill + decode) on the demo prompt."""
    from model.v4_family import load_v4_family

    model.eval()
    reloaded = load_v4_family(args.out, torch.float32, device)
    probe, _ = arith_data.encode_fewshot_batch(tok, arith_data.held_out_fewshot_rows(8))
    probe = probe.to(device)
    with torch.no_grad():
        diff = (logits_fn(reloaded)(probe) - logits_fn(model)(probe)).abs().max().item()
    if diff > 1e-4:  # same weights, same kernels: a difference means the export lost something
        raise RuntimeError(f"reloaded checkpoint's logits differ from the trained model's by {diff}")
    n = args.final_eval_n
    bare = [([], a, b) for a, b in arith_data.held_out_pairs(n)]
    fewshot = arith_data.held_out_fewshot_rows(n, args.min_shots, args.max_shots)
    result = {"reload_max_logit_diff": diff, "heldout_pairs": n}
    for tag, rows, with_bos in (("", bare, True), ("_without_bos", bare, False), ("_fewshot", fewshot, True)):
        acc, failures = evaluate(reloaded, tok, rows, device, with_bos)
        result["heldout_exact_match" + tag] = acc
        result["failures" + tag] = [list(f) for f in failures[:10]]
    bf16 = load_v4_family(args.out, torch.bfloat16, device)
    result["heldout_fewshot_exact_match_bf16"], _ = evaluate(bf16, tok, fewshot[:500], device)
    demo = arith_data.prompt_text(*DEMO_PROMPT)
    result["demo"] = {demo: greedy_incremental(reloaded, tok, demo)}
    for shots, a, b in fewshot[:3]:
        text = arith_data.fewshot_text(shots, a, b)
        result["demo"][text] = greedy_incremental(reloaded, tok, text)
    print(f"exported checkpoint (bf16 weights, reloaded, fp32 compute): held-out greedy exact match "
          f"{result['heldout_exact_match']:.4f} on {n} pairs ({result['heldout_exact_match_without_bos']:.4f} "
          f"without BOS), {result['heldout_exact_match_fewshot']:.4f} with a preamble "
          f"({result['heldout_fewshot_exact_match_bf16']:.4f} bf16 compute, {min(n, 500)} pairs); "
          f"{demo} -> {result['demo'][demo]!r}", flush=True)
    for text, got in result["failures_fewshot"][:5]:
        print(f"  miss: {text!r} -> {got!r}")
    return result


if __name__ == "__main__":
    sys.exit(main())
