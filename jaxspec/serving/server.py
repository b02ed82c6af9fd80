"""The server's command: a model over an OpenAI-compatible HTTP API, continuous batching, adaptive speculation.

    python scripts/serve.py                      # smollm2-135m, SAM speculation, http://127.0.0.1:8000
    python scripts/serve.py --policy off         # plain decoding only

Endpoints: POST /v1/completions, POST /v1/chat/completions (both with `stream: true`), GET /v1/models,
GET /health, GET /metrics (Prometheus). Beside OpenAI's fields a request may send `top_k`, `min_p`,
`ignore_eos`, `stop_token_ids` and `speculative` ({"method": "none"|"ngram"|"sam", "num_speculative_tokens": K}
or "off").

Access: with --api-key (or the JAXSPEC_API_KEY environment variable, which `ps` does not show) every route but
the playground page, /health and /metrics needs `Authorization: Bearer KEY`. Bound to a loopback address, the
server answers only requests whose Host header is localhost, 127.0.0.1 or [::1] (a page elsewhere that
rebinds its DNS name to 127.0.0.1 cannot reach it); --allowed-hosts changes that list.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys


def parse_args(argv=None) -> argparse.Namespace:
    from ..methods import METHODS, names
    from .bodies import DEFAULT_MAX_BODY_BYTES

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m",
                   help="a named model, a .gguf file or a Hugging Face directory (default: %(default)s)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                   help="the model's dtype (default: bfloat16 on a GPU or TPU, float32 on a CPU)")
    p.add_argument("--served-model-name", default=None,
                   help="the name clients send as `model` (default: the --model value)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default: %(default)s)")
    p.add_argument("--api-key", default=os.environ.get("JAXSPEC_API_KEY") or None,
                   help="require `Authorization: Bearer KEY` on every route but the playground page, /health and "
                        "/metrics (default: the JAXSPEC_API_KEY environment variable; none: open)")
    p.add_argument("--allowed-hosts", default=None,
                   help="comma-separated names a request's Host header may carry (ports aside; IPv6 in brackets), "
                        "or * for any (default: localhost,127.0.0.1,[::1] when --host is a loopback address, else any)")
    p.add_argument("--max-slots", type=int, default=8,
                   help="the most requests decoded at once; more wait in a queue (default: %(default)s)")
    p.add_argument("--slot-buckets", default=None,
                   help="comma-separated batch sizes to compile, ending at --max-slots; the engine runs the "
                        "smallest that holds its requests (default: 1 and multiples of 8)")
    p.add_argument("--cache-len", type=int, default=2048,
                   help="KV-cache slots per request: prompt + max_tokens must fit. Attention on CPU "
                        "reads all of them every step, so keep it near the longest request (default: %(default)s)")
    p.add_argument("--method", default="sam", choices=names(served=True),
                   help="speculation method for requests that do not choose one; medusa, eagle, eagle2, eagle3 and "
                        "dflash use the heads shipped for the model (default: %(default)s)")
    p.add_argument("--methods", default=None,
                   help="methods compiled in, comma-separated; a request may pick any of them. none, ngram and "
                        "sam mix freely; a head method is served alone beside none (default: none,ngram,sam, "
                        "or none,METHOD for a head method)")
    p.add_argument("--num-speculative-tokens", "-k", type=int, default=None,
                   help="K, the most draft tokens per request and step (default: the method's, "
                        + ", ".join(f"{m} {METHODS[m].defaults['num_speculative_tokens']}"
                                    for m in names(served=True) if m != "none")
                        + "; medusa, eagle2 and eagle3 count tree nodes)")
    p.add_argument("--policy", default="adaptive", choices=["adaptive", "fixed", "off"],
                   help="when to speculate: adaptive (by load, switched off where measured slower), fixed "
                        "(always), off (never) (default: %(default)s)")
    p.add_argument("--spec-max-active", type=int, default=4,
                   help="adaptive policy: speculate only while at most this many requests are in flight "
                        "(running or queued) (default: %(default)s)")
    p.add_argument("--chunk-steps", type=int, default=8,
                   help="decode steps between host visits: tokens stream in chunks of this many steps, and "
                        "new requests join between chunks (default: %(default)s)")
    p.add_argument("--max-waiting", type=int, default=256,
                   help="requests queued beyond the free slots; more get HTTP 429; 0 serves only what the slots "
                        "hold (default: %(default)s)")
    p.add_argument("--max-prediction-len", type=int, default=None,
                   help="longest predicted output (`prediction`, in tokens) a request may carry; 0 serves none "
                        "(default: 1024, or the cache length when shorter; 0 when a trained head is served)")
    p.add_argument("--max-logprobs", type=int, default=20,
                   help="most likely tokens a request may ask for per position (completions `logprobs`, chat "
                        "`top_logprobs`); -1 turns log-probabilities off (default: %(default)s)")
    p.add_argument("--constraint-states", type=int, default=4096,
                   help="structured output: automaton states the batch's constraints may hold together; a "
                        "`response_format` needing more alone gets HTTP 400 (default: %(default)s)")
    p.add_argument("--constraint-edges", type=int, default=1 << 22,
                   help="structured output: (state, token) edges the batch's constraints may hold together "
                        "(default: %(default)s, enough for `json_object` over a 49k vocabulary)")
    p.add_argument("--constraint-time-s", type=float, default=30.0,
                   help="structured output: seconds one constraint may take to compile, in its worker process; "
                        "longer ones get HTTP 400 (default: %(default)s)")
    p.add_argument("--constraint-memory-mib", type=int, default=2048,
                   help="structured output: memory one constraint's compile may use, in MiB (default: %(default)s)")
    p.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                   help="largest request body accepted, in bytes; larger ones get HTTP 413 (default: %(default)s)")
    p.add_argument("--no-warmup", action="store_true",
                   help="skip compiling every batch size before listening (the first requests then wait)")
    p.add_argument("--background-compile", action=argparse.BooleanOptionalAction, default=True,
                   help="answer /health once the smallest batch's plain programs are compiled, and compile larger "
                        "batches, speculation and longer prompts' prefills while serving (default); "
                        "--no-background-compile compiles all of it first")
    p.add_argument("--graceful-timeout", type=float, default=30.0,
                   help="seconds to finish in-flight requests after SIGINT/SIGTERM (default: %(default)s)")
    p.add_argument("--mesh", default=None, metavar="DATAxMODEL",
                   help="split the model over DATA x MODEL devices (e.g. 2x4): batch rows over DATA, tensor parallel "
                        "over MODEL (attention kept whole where MODEL does not divide its heads); default one device")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p.parse_args(argv)


def allowed_hosts(host: str, allowed: str | None) -> tuple[str, ...] | None:
    """The Host names to accept (None: any): `allowed` as given, else the loopback names for a loopback `host`."""
    from .app import LOOPBACK_HOSTS

    if allowed is not None:
        names = tuple(h.strip() for h in allowed.split(",") if h.strip())
        return None if names == ("*",) else names
    loopback = host in ("localhost", "::1", "[::1]") or host.startswith("127.")
    return LOOPBACK_HOSTS if loopback else None


def default_prediction_len(methods: str, cache_len: int) -> int:
    """1024 tokens (at most the cache), or 0 when a method that is served alone (a trained head) is compiled in:
    predictions draft beside the lookup methods only."""
    from jaxspec.engine import SHARED_BATCH_METHODS

    chosen = [m.strip() for m in methods.split(",") if m.strip()]
    return min(1024, cache_len) if all(m in SHARED_BATCH_METHODS for m in chosen) else 0


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    import uvicorn

    import jaxspec

    # Compiled programs are reused across restarts (the real model compiles for minutes on a small CPU).
    jaxspec.enable_compilation_cache()
    from jaxspec.constraints import ConstraintLimits
    from jaxspec.engine import SHARED_BATCH_METHODS, Engine, EngineConfig
    from jaxspec.policy import DraftPolicy
    from jaxspec.serving import create_app

    try:
        spec = jaxspec.SpecConfig(method=args.method, num_speculative_tokens=(
            None if args.method == "none" else args.num_speculative_tokens))
        methods = args.methods or (",".join(SHARED_BATCH_METHODS) if args.method in SHARED_BATCH_METHODS
                                   else f"none,{args.method}")
        buckets = None if args.slot_buckets is None else tuple(int(b) for b in args.slot_buckets.split(","))
        config = EngineConfig(max_slots=args.max_slots, cache_len=args.cache_len, spec=spec,
                              methods=tuple(m.strip() for m in methods.split(",") if m.strip()),
                              chunk_steps=args.chunk_steps, max_waiting=args.max_waiting, slot_buckets=buckets,
                              max_logprobs=None if args.max_logprobs == -1 else args.max_logprobs,
                              max_prediction_len=(default_prediction_len(methods, args.cache_len)
                                                  if args.max_prediction_len is None else args.max_prediction_len),
                              constraint_states=args.constraint_states, constraint_edges=args.constraint_edges,
                              constraint_limits=ConstraintLimits(time_s=args.constraint_time_s,
                                                                 memory_bytes=args.constraint_memory_mib << 20),
                              background_compile=args.background_compile)
        policy = DraftPolicy.named(args.policy, max_active=args.spec_max_active)
        lm = jaxspec.load_model(args.model, dtype=args.dtype)
        if args.mesh is not None:
            from jaxspec.sharding import ShardingRules, make_mesh, parse_mesh

            mesh = make_mesh(*parse_mesh(args.mesh))
            lm = lm.on_mesh(mesh, ShardingRules.fitting(lm.config, mesh))
        engine = Engine(lm, config, policy=policy)
        name = args.served_model_name or args.model

        def announce():
            print(f"jaxspec: serving {name} at http://{args.host}:{args.port} (method {spec.method}, "
                  f"K={config.num_speculative_tokens}, policy {args.policy}, {config.max_slots} slots, "
                  f"cache {config.cache_len}" + (f", mesh {args.mesh}" if args.mesh else "") + ")", flush=True)

        app = create_app(engine, served_model_name=name, warmup=not args.no_warmup,
                         graceful_timeout_s=args.graceful_timeout, on_ready=announce,
                         max_body_bytes=args.max_body_bytes, api_key=args.api_key,
                         allowed_hosts=allowed_hosts(args.host, args.allowed_hosts))
    except ValueError as e:
        print(f"{os.path.basename(sys.argv[0]) or 'serve'}: error: {e}", file=sys.stderr)
        return 2

    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                timeout_graceful_shutdown=args.graceful_timeout)
    if engine.compiling():
        # Requests are finished; a program still compiles on the engine's thread (speculation, at start-up).
        # Waiting could take a minute, and Python's finalisation beside an XLA compile crashes: end here.
        logging.getLogger("jaxspec.engine").info("exiting while a program compiles in the background")
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0

