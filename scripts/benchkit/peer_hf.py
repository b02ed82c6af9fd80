"""The Hugging Face peer: transformers generating on torch float32 CPU, for benchmark comparisons.

This is what a user would otherwise pick to run the same GGUF model, so the benchmark script
reports its throughput next to jaxspec's.  Two plain functions:

* :func:`load_peer` loads a GGUF checkpoint with ``transformers`` (de-quantized to float32;
  transformers needs ``accelerate`` installed to read GGUF files).
* :func:`run_peer` generates for a list of already-tokenized prompts, ``batch_size`` prompts per
  ``model.generate`` call, and returns the generated ids and the throughput.

Conventions (kept identical to jaxspec's benchmark so the numbers compare):

* torch runs with ``torch.set_num_threads(2)``.
* Greedy (``do_sample=False``) when ``temperature == 0``; otherwise plain temperature sampling
  (``top_k=0``, ``top_p=1.0``, seeded with ``torch.manual_seed(seed)`` once before timing).
  No repetition penalty, no chat template; the prompts are token ids as given (no BOS added).
* Batches are left-padded with pad id 2 and an attention mask.
* Ids 0 and 2 end a sequence.  Each output is cut after its first end id (the end id is kept),
  and only these tokens count towards ``tokens_per_s``; padding emitted after a row finished and
  the prompt tokens do not count.
* ``prompt_lookup_num_tokens`` turns on transformers' prompt-lookup decoding (its n-gram
  speculative decoding); transformers supports it only at batch size 1.
* One short warm-up generation runs before the clock starts; the reported time covers only the
  ``generate`` calls over all prompts.

torch and transformers are imported inside the functions, so importing this module works
without them.
"""

from __future__ import annotations

from .timing import clocked

EOS_IDS = (0, 2)
PAD_ID = 2
NUM_THREADS = 2

__all__ = ["load_peer", "run_peer", "EOS_IDS", "PAD_ID"]


def load_peer(gguf_dir: str, gguf_file: str):
    """Load ``gguf_dir/gguf_file`` as a float32 ``transformers`` causal LM in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(NUM_THREADS)
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file, dtype=torch.float32)
    model.eval()
    return model


def _cut_at_eos(tokens: list[int]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in EOS_IDS:
            return tokens[: i + 1]
    return tokens


def _generate_batch(model, batch: list[list[int]], max_new_tokens: int, gen_kwargs: dict) -> list[list[int]]:
    """One left-padded ``generate`` call; returns each row's new tokens cut after the first EOS."""
    import torch

    width = max(len(p) for p in batch)
    ids = torch.full((len(batch), width), PAD_ID, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, prompt in enumerate(batch):
        ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        mask[row, width - len(prompt) :] = 1
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_new_tokens,
            eos_token_id=list(EOS_IDS),
            pad_token_id=PAD_ID,
            **gen_kwargs,
        )
    new = out[:, width:].tolist()
    return [_cut_at_eos(row) for row in new]


def run_peer(
    model,
    prompt_ids: list[list[int]],
    max_new_tokens: int,
    batch_size: int,
    prompt_lookup_num_tokens: int | None = None,
    temperature: float = 0.0,
    seed: int = 0,
) -> dict:
    """Generate up to ``max_new_tokens`` for every prompt, ``batch_size`` prompts at a time.

    Returns ``dict(tokens_per_s=..., outputs=..., seconds=...)``: ``outputs[i]`` are the new token
    ids of prompt ``i`` up to and including its first EOS (0 or 2); ``seconds`` is the wall time of
    the timed ``generate`` calls and ``tokens_per_s`` the number of output tokens over it.
    """
    import torch

    if batch_size < 1:
        raise ValueError("batch_size must be >= 1")
    if prompt_lookup_num_tokens is not None and batch_size != 1:
        raise ValueError("transformers' prompt-lookup decoding supports batch_size == 1 only")
    if not prompt_ids:
        return {"tokens_per_s": 0.0, "outputs": [], "seconds": 0.0}
    torch.set_num_threads(NUM_THREADS)

    gen_kwargs: dict = {"repetition_penalty": 1.0, "num_beams": 1}
    if temperature and temperature > 0:
        gen_kwargs.update(do_sample=True, temperature=float(temperature), top_k=0, top_p=1.0)
    else:
        gen_kwargs.update(do_sample=False)
    if prompt_lookup_num_tokens is not None:
        gen_kwargs["prompt_lookup_num_tokens"] = int(prompt_lookup_num_tokens)

    batches = [prompt_ids[i : i + batch_size] for i in range(0, len(prompt_ids), batch_size)]

    # Warm-up: a short generation of the first batch's shape, not timed.
    torch.manual_seed(seed)
    _generate_batch(model, batches[0], min(4, max_new_tokens), gen_kwargs)

    torch.manual_seed(seed)
    seconds, outputs = clocked(lambda: [o for batch in batches
                                        for o in _generate_batch(model, batch, max_new_tokens, gen_kwargs)])

    n_tokens = sum(len(o) for o in outputs)
    return {"tokens_per_s": n_tokens / seconds if seconds > 0 else 0.0, "outputs": outputs, "seconds": seconds}
