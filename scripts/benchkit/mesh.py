"""`bench_kernel.py mesh`: the default model on device meshes (decode time, memory per device), and a paper
estimate of the collectives a tensor-parallel step needs on accelerators.

measure: SmolLM2-135M on forced host devices (`--devices`, default 8, set before jax starts): batch `--batch`
  greedy decoding of held-out HumanEval prompts through `jaxspec.generate`, plain and sam, for each mesh shape
  (data, model); the rules keep attention whole where the model axis does not divide its 3 KV heads. Reported:
  decode ms per step, parameter and KV-cache bytes held by one device, and whether the tokens equal the
  single-device run. Forced host devices share this machine's cores, so this measures correctness and the
  partitioning's overhead, not a speed-up.
layout: the single-device decode step of models/llama.py at a git revision (default 3b547f1, before the
  per-device block layout) against the current file, same weights, interleaved: the layout without a mesh must
  cost what it cost.
estimate: the bytes and messages a decode or verify step of a Llama-3-8B-shaped target exchanges at TP 8
  (Megatron: two all-reduces per layer, one for the vocabulary-parallel embedding, one gather of the logits),
  against the time its weights take to stream, from the formulas printed with the table.

    python scripts/bench_kernel.py mesh measure --devices 8 --batch 8 --new-tokens 48
    python scripts/bench_kernel.py mesh layout --against 3b547f1
    python scripts/bench_kernel.py mesh estimate
"""

from __future__ import annotations

import argparse
import os
import sys

from benchkit import machine, page


def _set_devices(count: int) -> None:
    """Force `count` host devices (and the CPU platform unless JAX_PLATFORMS names one) before jax's backend starts:
    bench_kernel.py has imported jax by now, but no backend runs until a device is asked for."""
    import jax

    jax.config.update("jax_platforms", os.environ.get("JAX_PLATFORMS") or "cpu")
    jax.config.update("jax_num_cpu_devices", count)


def mesh_shapes(devices: int) -> list[tuple[int, int]]:
    """(data, model) shapes to measure on `devices` devices: one device (the reference), every way to use them all,
    and (2, 3) where it fits: a model axis of 3 divides the default model's 3 KV heads, so attention splits over it,
    where model axes of 2, 4 and 8 keep attention whole (`ShardingRules.fitting`)."""
    shapes = [(1, 1)] + [(d, devices // d) for d in range(devices, 0, -1) if devices % d == 0 and devices > 1]
    return shapes + ([(2, 3)] if devices >= 6 else [])


def _bytes_on_first_device(tree) -> int:
    import jax

    total = 0
    for leaf in jax.tree.leaves(tree):
        if hasattr(leaf, "addressable_shards"):
            total += leaf.addressable_shards[0].data.nbytes
    return total


def measure(args) -> None:
    import jax

    import jaxspec
    from benchkit import tables, workloads
    from jaxspec.sharding import ShardingRules, make_mesh, use_rules

    print(machine.line(machine.info()), f"| {len(jax.devices())} forced host devices", flush=True)
    lm = jaxspec.load_model()
    prompts = workloads.held_out_prompts(lm.tokenizer, limit=args.batch)
    rows, reference = [], {}
    for data, model in mesh_shapes(len(jax.devices())):
        mesh = make_mesh(data, model)
        rules = ShardingRules.fitting(lm.config, mesh)
        whole_attention = rules.heads is None
        mesh_lm = lm if (data, model) == (1, 1) else lm.on_mesh(mesh, rules)
        batch = prompts[: args.batch - args.batch % data] if args.batch % data else prompts
        for method in ("none", "sam"):
            spec = None if method == "none" else jaxspec.SpecConfig(method=method)
            kwargs = dict(max_new_tokens=args.new_tokens, spec=spec, ignore_eos=True)
            jaxspec.generate(mesh_lm, batch, **kwargs)  # compile
            out = jaxspec.generate(mesh_lm, batch, **kwargs)
            ms = 1000 * out.stats.decode_s / max(out.stats.steps, 1)
            same = reference.setdefault((method, len(batch)), out.token_ids) == out.token_ids
            p = jaxspec.prepare(mesh_lm, batch, max_new_tokens=args.new_tokens)
            with use_rules(mesh_lm.mesh, mesh_lm.rules):
                state = jaxspec.prefill(mesh_lm.graphdef, mesh_lm.params, p.prompts, p.prompt_lens, p.rows,
                                        p.proposer_params, spec=p.prefill_spec)
            row = [f"({data}, {model})", "whole" if whole_attention else "split", method, len(batch),
                   tables.fmt(ms, ".1f"), out.stats.steps, tables.fmt(_bytes_on_first_device(mesh_lm.params) / 2**20,
                                                                       ".1f"),
                   tables.fmt(_bytes_on_first_device(state.cache) / 2**20, ".1f"), "yes" if same else "NO"]
            rows.append(row)
            print(tables.row(row), file=sys.stderr, flush=True)  # progress; the table below is the report
    print(tables.markdown(["mesh (data, model)", "attention", "method", "rows", "ms / step", "steps",
                           "params MiB / device", "cache MiB / device", "tokens = 1 device"], rows))


# A Llama-3-8B-shaped target and an H100-class accelerator, for the paper estimate.
LLAMA8B = dict(layers=32, hidden=4096, heads=32, kv_heads=8, head_dim=128, mlp=14336, vocab=128256)
HBM_BYTES_PER_S = 3.35e12  # H100 SXM HBM3
LINK_BYTES_PER_S = 450e9  # NVLink 4, one direction per GPU
LINK_LATENCY_S = 8e-6  # one small all-reduce over 8 GPUs (NCCL, latency-bound)


def _ring_bytes(size: float, n: int, kind: str) -> float:
    """Bytes each device sends in a ring all-reduce / all-gather of `size` bytes over n devices."""
    return (2 if kind == "all-reduce" else 1) * (n - 1) / n * size


def estimate(args) -> None:
    from benchkit import tables

    m, n, act = LLAMA8B, args.tp, 2  # bf16 activations and weights
    params = m["layers"] * (m["hidden"] * (m["heads"] + 2 * m["kv_heads"]) * m["head_dim"]
                            + m["heads"] * m["head_dim"] * m["hidden"] + 3 * m["hidden"] * m["mlp"]) \
        + 2 * m["vocab"] * m["hidden"]
    print(f"Llama-3-8B shape: {params / 1e9:.2f} B parameters (bf16), TP {n}, HBM {HBM_BYTES_PER_S / 1e12} TB/s, "
          f"link {LINK_BYTES_PER_S / 1e9:.0f} GB/s, {LINK_LATENCY_S * 1e6:.0f} us per collective")
    print("per step: 2 L all-reduces of [B T, D] (attention output, MLP down), 1 of [B T, D] (vocabulary-parallel "
          "embedding), 1 all-gather of f32 logits [B T, V]; ring bytes: all-reduce 2 (n-1)/n x, all-gather (n-1)/n x")
    rows = []
    for batch, width in ((1, 1), (1, 8), (8, 1), (8, 9), (32, 1), (32, 9)):
        tokens = batch * width
        activation = tokens * m["hidden"] * act
        reduces = 2 * m["layers"] + 1
        sent = reduces * _ring_bytes(activation, n, "all-reduce") \
            + _ring_bytes(tokens * m["vocab"] * 4, n, "all-gather")
        messages = reduces + 1
        comm_s = messages * LINK_LATENCY_S + sent / LINK_BYTES_PER_S
        weights_s = params * act / n / HBM_BYTES_PER_S
        rows.append([batch, width, messages, tables.fmt(sent / 2**20, ".2f"), tables.fmt(comm_s * 1e3, ".3f"),
                     tables.fmt(weights_s * 1e3, ".3f"), tables.fmt(comm_s / weights_s, ".2f")])
    print(tables.markdown(["batch B", "tokens T per row", "collectives", "MiB sent / device", "comm ms",
                           "weight stream ms / device", "comm / weights"], rows))


def layout(args) -> None:
    """The single-device decode step of the model file at git revision `args.against` against the current one,
    on the same weights, interleaved in one process."""
    import dataclasses
    import importlib.util
    import statistics
    import subprocess
    import tempfile
    from pathlib import Path

    from flax import nnx

    import jaxspec
    from benchkit import tables, workloads

    source = subprocess.run(["git", "show", f"{args.against}:models/llama.py"], capture_output=True, text=True,
                            check=True).stdout
    source = source.replace("from .config import", "from jaxspec.models.config import")
    source = source.replace("from .rope import", "from jaxspec.models.rope import")
    path = Path(tempfile.mkdtemp()) / "llama_before.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("llama_before", path)
    before = importlib.util.module_from_spec(spec)
    sys.modules["llama_before"] = before  # dataclasses look their module up while the file runs
    spec.loader.exec_module(before)

    print(machine.line(machine.info()), f"| models/llama.py at {args.against} vs now", flush=True)
    lm = jaxspec.load_model()
    old = dataclasses.replace(lm, graphdef=nnx.split(before.Llama(lm.config, rngs=nnx.Rngs(0)))[0])
    texts = workloads.humaneval_problems()[120:128]
    rows = []
    for batch in (1, 8):
        prompts = [p["prompt"] for p in texts[:batch]]
        for method in ("none", "sam"):
            spec_ = None if method == "none" else jaxspec.SpecConfig(method=method)
            kwargs = dict(max_new_tokens=args.new_tokens, spec=spec_, ignore_eos=True)
            times, tokens = {"before": [], "now": []}, {}
            for model in (old, lm):
                jaxspec.generate(model, prompts, **kwargs)  # compile
            for _ in range(args.repeats):
                for name, model in (("before", old), ("now", lm)):
                    out = jaxspec.generate(model, prompts, **kwargs)
                    times[name].append(1000 * out.stats.decode_s / out.stats.steps)
                    tokens[name] = out.token_ids
            b, n = statistics.median(times["before"]), statistics.median(times["now"])
            rows.append([batch, method, tables.fmt(b), tables.fmt(n), tables.fmt(n / b, ".3f"),
                         "yes" if tokens["before"] == tokens["now"] else "NO"])
            print(tables.row(rows[-1]), flush=True)
    print(tables.markdown(["batch", "method", "ms / step before", "ms / step now", "now / before", "same tokens"],
                          rows))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="bench_kernel.py mesh", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    m = sub.add_parser("measure", help="per-step time and memory per device against mesh shape")
    m.add_argument("--devices", type=int, default=8, help="forced host devices (set before jax starts)")
    m.add_argument("--batch", type=int, default=8)
    m.add_argument("--new-tokens", type=int, default=48)
    e = sub.add_parser("estimate", help="collectives of a tensor-parallel 8B step on accelerators")
    e.add_argument("--tp", type=int, default=8)
    la = sub.add_parser("layout", help="single-device step time: the model file at a git revision vs now")
    la.add_argument("--against", default="3b547f1", help="git revision (default: before the SPMD layout)")
    la.add_argument("--new-tokens", type=int, default=64)
    la.add_argument("--repeats", type=int, default=5)
    for sub_parser in (m, e, la):
        page.add_option(sub_parser, f"kernel-mesh-{sub_parser.prog.split()[-1]}")
    args = parser.parse_args(argv)
    if args.what == "measure":
        _set_devices(args.devices)
    with page.Tee() as printed:
        {"layout": layout, "measure": measure, "estimate": estimate}[args.what](args)
    if args.write_page:
        page.write(args.write_page, printed.text, machine.info(device=args.what != "estimate"))
    return 0
