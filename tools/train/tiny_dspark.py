"""Train the DSpark drafter (``mtp.*``) of the embedded tiny DeepSeek-V4.1 against the target's own outputs.

What: the target (frozen) writes its own data: each sequence starts at BOS, its first P tokens are sampled at
temperature 1 (P random in [--prompt-min, --prompt-max]: the prompts are the target's own samples), the rest are
its greedy continuation.  DeepInfer's V4.1 model generates them token by token and captures the drafter's input
features (``ForwardBatch.capture_rows``) on the way.  The drafter is the dense one of
``tools.train.dspark_dense`` (differentiable, the released tensor names); its draft layers start from the
target's last layers (same tensor shapes, the drafter's expert count permitting) and ``main_proj`` from the last
target layer's features.  Loss (DeepSpec's): for random anchors, the block ``[anchor, noise x (K-1)]``
predicts the next K tokens (teacher-forced Markov inputs), cross-entropy weighted ``exp(-j / K)`` over the
positions a sampled or greedy target token follows, plus the confidence head's BCE against the actual greedy
acceptance (``argmax draft == target's greedy token``) on the greedy positions.

Then the mtp.* tensors (bf16 matrices; norms, mHC, sinks and router biases in fp32, as the target's) are added to
the asset's model.safetensors, ``num_nextn_predict_layers`` is set in its config.json, and the acceptance is
measured offline with DeepInfer's own drafter (:class:`deepinfer.models.deepseek_v41.dspark.DSparkDrafter`) on
held-out sequences: speculative steps against the target's greedy tokens (anchor = last accepted token, drafts
accepted while they equal the target's tokens, then the target's bonus token).

Run (a few CPU minutes, 2 threads):

    nice .venv/bin/python -m tools.train.tiny_dspark --model deepinfer-core/src/deepinfer/assets/tiny_v41

``--dry-run`` trains and measures without writing the asset.  Everything derives from --seed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

# On a shared 2-core machine, spinning OpenMP workers starve each other (3x slower); must precede torch.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402 - after OMP_WAIT_POLICY is set (see above)
import torch.nn.functional as F  # noqa: E402 - as torch
from safetensors.torch import load_file, save_file  # noqa: E402 - as torch

from deepinfer.models import load_model  # noqa: E402 - as torch
from deepinfer.ops import OpTable  # noqa: E402 - as torch
from tools.train import dspark_dense as dd  # noqa: E402 - as torch
from tools.train import v41_dense as vd  # noqa: E402 - as torch
from tools.train.dspark_accept import Sequences, generate, measure  # noqa: E402 - as torch

#: Drafter tensors kept in fp32 in the checkpoint (as the target's: mHC, sinks, router biases, norms).
KEEP_FP32 = ("_fn", "_base", "_scale", "attn_sink", "gate.bias", "norm.weight", "confidence_head.proj.weight")


# --------------------------------------------------------------------------------------------------
# Training the dense drafter.
# --------------------------------------------------------------------------------------------------


def initialise(drafter: dd.DSparkDense, target: vd.V41Model, seed: int) -> None:
    """Draft layer i from target layer n - L + i where shapes agree; main_proj reads the last target layer's
    features; the Markov head starts with no bias and the confidence head at 1/2."""
    gen = torch.Generator().manual_seed(seed)
    n, hidden = len(target.layers), target.cfg.hidden_size
    source = {k: v for k, v in target.state_dict().items()}
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            stage, rest = int(name.split(".")[1]), name.split(".", 2)[2]
            twin = f"layers.{n - len(drafter.mtp) + stage}.{rest}"
            if twin in source and source[twin].shape == p.shape:
                p.copy_(source[twin])
            elif rest == "main_proj.weight":
                p.normal_(0.0, 0.02 * hidden**-0.5, generator=gen)
                p[:, -hidden:] += torch.eye(hidden)
            elif rest.startswith("markov_head.embed"):
                p.normal_(0.0, 1.0, generator=gen)
            elif rest.startswith(("markov_head.head", "confidence_head")):
                p.zero_()
            elif rest == "norm.weight":
                p.copy_(target.norm.weight)
            elif rest.endswith(("hc_attn_fn", "hc_ffn_fn")):
                p.normal_(0.0, 0.02, generator=gen)
            elif rest.endswith("ffn.gate.weight"):
                p.normal_(0.0, hidden**-0.5, generator=gen)


def block_loss(drafter: dd.DSparkDense, target: vd.V41Model, data: Sequences, seqs: torch.Tensor,
               anchors_per_seq: int, gen: torch.Generator) -> tuple[torch.Tensor, dict[str, float]]:
    """CE of the block's drafts against the next K target tokens + confidence BCE against greedy acceptance."""
    k, length = drafter.spec.block_size, data.tokens.shape[1]
    tokens, greedy_from = data.tokens[seqs], data.greedy_from[seqs]
    b = seqs.shape[0]
    # anchors: the first label (anchor + 1) is a target-written token (after the BOS), the block fits
    low, high = 1, length - 1 - k
    anchors = torch.randint(low, high + 1, (b, anchors_per_seq), generator=gen)
    contexts = drafter.contexts(data.features[seqs])
    seq_of = torch.arange(b)[:, None].expand(b, anchors_per_seq).flatten()
    anchors = anchors.flatten()
    anchor_ids = tokens[seq_of, anchors]
    hidden, logits = drafter.block(contexts, seq_of, anchors, anchor_ids, k, target.embed.weight,
                                   target.head.weight)
    label_pos = anchors[:, None] + 1 + torch.arange(k)
    labels = tokens[seq_of[:, None], label_pos]  # [N, k]
    prev = torch.cat([anchor_ids[:, None], labels[:, :-1]], dim=1)
    step, conf = drafter.heads(hidden, logits, prev)
    weights = torch.exp(-torch.arange(k, dtype=torch.float32) / k).expand(labels.shape)
    ce = F.cross_entropy(step.flatten(0, 1), labels.flatten(), reduction="none").view_as(labels)
    ce_loss = (ce * weights).sum() / weights.sum()
    greedy = label_pos >= greedy_from[seq_of][:, None]
    accepted = (step.argmax(-1) == labels).float()
    bce = F.binary_cross_entropy_with_logits(conf, accepted, reduction="none")
    conf_loss = (bce * greedy).sum() / greedy.sum().clamp(min=1)
    stats = {"ce": float(ce_loss.detach()), "conf": float(conf_loss.detach()),
             "acc": float((accepted * greedy).sum() / greedy.sum().clamp(min=1))}
    return ce_loss + conf_loss, stats


def train(drafter: dd.DSparkDense, target: vd.V41Model, data: Sequences, args: argparse.Namespace) -> None:
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(args.seed + 1)
    start, n = time.time(), data.tokens.shape[0]
    for step in range(args.steps):
        lr = args.lr * min(1.0, (step + 1) / 20) * 0.5 * (1 + math.cos(math.pi * step / args.steps))
        for group in opt.param_groups:
            group["lr"] = lr
        seqs = torch.randperm(n, generator=gen)[: args.batch]
        loss, stats = block_loss(drafter, target, data, seqs, args.anchors, gen)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % 25 == 0 or step == args.steps - 1:
            print(f"step {step:4d}  ce {stats['ce']:.3f}  conf {stats['conf']:.3f}  greedy acc {stats['acc']:.3f}"
                  f"  lr {lr:.2e}  {time.time() - start:.0f}s", flush=True)


# --------------------------------------------------------------------------------------------------
# Saving and measuring.
# --------------------------------------------------------------------------------------------------


def save(drafter: dd.DSparkDense, folder: Path) -> None:
    """Add the mtp.* tensors to model.safetensors and set num_nextn_predict_layers in config.json."""
    state = {}
    for name, t in dd.mtp_state(drafter).items():
        state[name] = t.float() if name.endswith(KEEP_FP32) else t.to(torch.bfloat16)
    weights = folder / "model.safetensors"
    tensors = {k: v for k, v in load_file(str(weights)).items() if not k.startswith("mtp.")}
    save_file({**tensors, **state}, str(weights), metadata={"format": "pt"})
    path = folder / "config.json"
    config = json.loads(path.read_text())
    text = config.get("text_config", config)
    text.update(drafter.spec.to_dict())
    path.write_text(json.dumps(config, indent=2) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, required=True, help="the tiny V4.1 checkpoint (written in place)")
    ap.add_argument("--layers", type=int, default=2, help="num_nextn_predict_layers")
    ap.add_argument("--train-seqs", type=int, default=192)
    ap.add_argument("--heldout-seqs", type=int, default=24)
    ap.add_argument("--length", type=int, default=112)
    ap.add_argument("--prompt-min", type=int, default=8)
    ap.add_argument("--prompt-max", type=int, default=48)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--anchors", type=int, default=16, help="blocks per sequence per step")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dry-run", action="store_true", help="train and measure; do not write the asset")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    t0 = time.time()

    raw = json.loads((args.model / "config.json").read_text())
    text = raw.get("text_config", raw)
    spec = dd.DSparkSpec.from_dict({**text, "num_nextn_predict_layers": args.layers})
    target = vd.load(args.model).requires_grad_(False)
    model = load_model(args.model, ops=OpTable(), dtype=torch.float32, device=torch.device("cpu"))
    bos = int(text.get("bos_token_id", raw.get("bos_token_id", 0)))
    train_data = generate(model, args.train_seqs, args.length, args.prompt_min, args.prompt_max, args.seed, bos)
    heldout = generate(model, args.heldout_seqs, args.length, args.prompt_min, args.prompt_max, args.seed + 1000,
                       bos)
    print(f"generated {args.train_seqs} + {args.heldout_seqs} sequences in {time.time() - t0:.0f}s", flush=True)

    drafter = dd.DSparkDense(target.cfg, spec)
    initialise(drafter, target, args.seed)
    train(drafter, target, train_data, args)

    folder = args.model
    if args.dry_run:
        import shutil
        import tempfile

        folder = Path(tempfile.mkdtemp()) / "model"
        shutil.copytree(args.model, folder)
    save(drafter, folder)
    trained = load_model(folder, ops=OpTable(), dtype=torch.float32, device=torch.device("cpu"))
    result = measure(trained, heldout, spec.block_size)
    print(json.dumps({"drafter": spec.to_dict(), "heldout": result, "cpu_seconds": time.process_time(),
                      "wall_seconds": time.time() - t0}, indent=1))


if __name__ == "__main__":
    main()
