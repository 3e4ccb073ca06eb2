"""Time the CUDA MoE routers against core's reference ops (GPU host only).

    python -m tools.bench.moe_router                 # table; --json PATH also writes the rows

Per case: device time per call replayed from a CUDA graph (what a decode step pays; the router GEMM included, and
timed alone in the ``gemm us`` column: the rest is what the kernel replaces) and eager time per call (host launch
cost included: what a prefill pays), for the reference op and the kernel, at decode b1 / b16 / b64 and prefill
1024 / 16384 tokens, the slice's 64, V4-Flash's 256 and V4.1's 384 experts, hidden 4096, bf16, sqrt(softplus)
with the fp32 correction bias, top-6; and the hash router at 256 experts.  Each row also compares the kernel with
the reference (expert sets equal, largest weight difference) and says whether the kernel ran from its AOT cubin.
"""

from __future__ import annotations

import argparse
import json
import sys

from tools.timing import device_time, graph_time


def rows() -> list[dict[str, object]]:
    import torch

    from deepinfer.ops import moe as reference
    from deepinfer_cuda.kernels import moe_hash_router, moe_router

    gen = torch.Generator(device="cuda").manual_seed(0)
    out = []
    for experts, tokens_list in [(64, (1, 16, 64, 1024)), (256, (1, 16, 64, 1024, 16384)), (384, (1, 1024))]:
        w = (torch.randn(experts, 4096, device="cuda", generator=gen) * 4096**-0.5).to(torch.bfloat16)
        bias = 0.1 * torch.randn(experts, device="cuda", generator=gen)
        for tokens in tokens_list:
            x = torch.randn(tokens, 4096, device="cuda", generator=gen).to(torch.bfloat16)
            ids = torch.randint(0, experts, (tokens, 6), device="cuda", generator=gen)
            cases = [("moe_router", moe_router, lambda: moe_router.moe_router(x, w, bias, 6, 1.5, "sqrtsoftplus"),
                      lambda: reference.moe_router(x, w, bias, 6, 1.5, "sqrtsoftplus"))]
            if experts == 256:
                cases.append(("moe_hash_router", moe_hash_router,
                              lambda: moe_hash_router.moe_hash_router(x, w, ids, 1.5, "sqrtsoftplus"),
                              lambda: reference.moe_hash_router(x, w, ids, 1.5, "sqrtsoftplus")))
            for name, module, ours, ref in cases:
                module.KERNEL.reset()
                got, expected = ours(), ref()
                if name == "moe_router":
                    same = torch.equal(got[1].sort(1).values, expected[1].sort(1).values)
                    err = (got[0].gather(1, got[1].argsort(1)) - expected[0].gather(1, expected[1].argsort(1)))
                else:
                    same, err = True, got - expected
                out.append({"op": name, "case": f"T={tokens} E={experts} k=6 bf16",
                            "gemm_graph_us": graph_time(lambda: torch.nn.functional.linear(x, w), 20) * 1e6,
                            "ref_graph_us": graph_time(ref, 20) * 1e6, "graph_us": graph_time(ours, 20) * 1e6,
                            "ref_eager_us": device_time(ref) * 1e6, "eager_us": device_time(ours) * 1e6,
                            "same_experts": same, "max_weight_err": err.abs().max().item(),
                            "path": "cubin" if module.KERNEL.launch_counts["cubin"] else "jit"})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args(argv)
    table = rows()
    print(f"{'op':<16} {'case':<22} {'gemm us':>8} {'ref graph us':>12} {'graph us':>9} {'ref eager us':>12} "
          f"{'eager us':>9} {'experts':>7} {'w err':>8} path")
    for r in table:
        print(f"{r['op']:<16} {r['case']:<22} {r['gemm_graph_us']:>8.1f} {r['ref_graph_us']:>12.1f} "
              f"{r['graph_us']:>9.1f} "
              f"{r['ref_eager_us']:>12.1f} {r['eager_us']:>9.1f} {'same' if r['same_experts'] else 'DIFF':>7} "
              f"{r['max_weight_err']:>8.1e} {r['path']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(table, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
