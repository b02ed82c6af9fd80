"""Continuous batching with adaptive speculation: the engine behind `scripts/serve.py`.

Requests arrive at any time and leave at any time; the device sees fixed shapes only. The engine keeps one
`DecodeState` of B rows ("slots") on the device and, in a background thread, repeats:

1. retire rows that finished or were cancelled, and admit waiting requests into free rows: each admission is
   one prefill of the request alone, written into its row in place (its first token streams right away);
2. ask the draft policy for the draft caps of this load (`jaxspec.policy.DraftPolicy`);
3. run the jitted speculative loop (`decode_chunk`) for up to `chunk_steps` steps: rows with different
   sampling settings, methods and draft budgets share every step;
4. read back what each row committed and hand it to the request's callback.

B is one of a few compiled sizes ("slot buckets", 1 and multiples of 8 by default): a lone request runs
at batch 1, and the state grows to the next bucket when the rows are full and shrinks when few rows remain.
A row's place changes only at such a regroup, which copies the kept rows once. Per-request values
(sampling settings, seeds, limits, stop ids, method, draft budget) are arrays, so nothing recompiles as
requests come and go.

Each request chooses a proposer among those the engine was built with (`none`, `ngram`, `sam`, run together
by a `MixedProposer`; or one trained head, `medusa`, `eagle`, `eagle2`, `eagle3` or `dflash`, beside `none`); its row
drafts at most min(its own budget, the policy's cap for the load) tokens, or tree nodes.

One job per module:

- `jaxspec.engine.config`: `EngineConfig`, the static settings;
- `jaxspec.engine.request`: `Request` in, `Output` events out, `Handle`, the errors, request validation;
- `jaxspec.engine.slots`: pure functions on a batched `DecodeState` (insert a row, regroup, empty rows,
  per-row settings as batch arrays), usable without the engine;
- `jaxspec.engine.runner`: the device side, prefill, chunks, readback, warm-up, `EngineMetrics`;
- `jaxspec.engine.engine`: the `Engine`, its queue, admission, cancellation, shutdown and loop thread.
"""

from .config import SHARED_BATCH_METHODS, EngineConfig
from .engine import Engine
from .request import EngineStopped, Handle, InvalidRequest, Output, QueueFull, Request, RequestStats
from .runner import EngineMetrics

__all__ = ["SHARED_BATCH_METHODS", "Engine", "EngineConfig", "EngineMetrics", "EngineStopped", "Handle",
           "InvalidRequest", "Output", "QueueFull", "Request", "RequestStats"]
