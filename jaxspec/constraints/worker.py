"""The compile worker: a process that turns constraint specs into token-automaton tables with outlines-core.

Started by `jaxspec.constraints.compiler` as `python path/to/worker.py FD` (FD: its end of a socket pair), it
imports the standard library, numpy, outlines-core and, by path, `limits` and `tables` beside it: never jaxspec
nor jax, so it starts in a fraction of a second and holds ~150 MB. It lowers its priority (the engine's decode
loop comes first) and runs one job at a time under the job's address-space limit (RLIMIT_AS): outlines-core's
Rust allocator aborts the process when that runs out, which the parent reads as the memory budget exceeded; and
under its CPU-time limit (RLIMIT_CPU), past which the kernel ends it with SIGXCPU: the time budget exceeded.
The parent kills it when the job's time runs out or the job is cancelled, and starts another when needed.

Messages (pickled, `multiprocessing.connection`):
  in:  ("compile", job, vocabulary or None)  job: {"fingerprint", "regex" | ("schema", "whitespace"), "eos",
       "vocab_size", "limits", "what"}; vocabulary (fingerprint's (eos id, {token bytes: ids})) when this worker
       has not seen that fingerprint.
  out: ("ok", {field: array}) or ("refused", limit, maximum, value, message) or ("invalid", message).
"""

import math
import os
import resource
import sys
from multiprocessing.connection import Connection

# limits and tables are this script's neighbours (its directory is sys.path[0]), not the jaxspec package's.
import limits as _limits
import outlines_core
import tables as _tables
from outlines_core.json_schema import build_regex_from_schema

# The 256 single bytes: an Index over them checks a regex alone (any syntax or unsupported feature error).
_BYTES = outlines_core.Vocabulary(256, {bytes([b]): [b] for b in range(256)})
_MESSAGE_CHARS = 500  # outlines-core's errors quote the whole regex: a 29 KB schema gave a 15 MB message


def _regex(job: dict, limits: "_limits.ConstraintLimits") -> str:
    if "regex" in job:
        return job["regex"]
    try:  # a schema's whitespace pattern is checked alone: a schema may have no place for it
        outlines_core.Index(job["whitespace"], _BYTES)
    except (ValueError, TypeError) as e:
        raise ValueError(f"invalid whitespace pattern {job['whitespace']!r}: {_limits.shown(str(e))}") from None
    try:
        regex = build_regex_from_schema(job["schema"], job["whitespace"], max_recursion_depth=limits.max_ref_depth)
    except (ValueError, TypeError) as e:
        raise ValueError(f"invalid JSON schema {_limits.shown(job['schema'])}: {_limits.shown(str(e))}") from None
    _limits.check_regex(regex, limits, "the schema's regex")
    return regex


def compile_job(job: dict, vocabulary: "outlines_core.Vocabulary") -> dict:
    """The tables of `job` (see the module docstring), or ConstraintTooLarge / ValueError."""
    limits = _limits.ConstraintLimits(**job["limits"])
    regex = _regex(job, limits)
    try:
        index = outlines_core.Index(regex, vocabulary)
    except (ValueError, TypeError) as e:
        raise ValueError(f"cannot compile {job['what']} over this vocabulary: {e}") from None
    transitions = index.get_transitions()  # {state: {token: next state}}
    states = len(set(transitions) | {n for row in transitions.values() for n in row.values()})
    edges = sum(len(row) for row in transitions.values())
    _limits.check_automaton(states, edges, limits, job["what"])
    return _tables.index_tables(transitions, index.get_initial_state(), index.get_final_states(), tuple(job["eos"]),
                                job["vocab_size"])


def serve(conn: Connection) -> None:
    """Answer jobs until the parent closes its end."""
    vocabularies = {}  # fingerprint -> outlines_core.Vocabulary
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    _, cpu_hard = resource.getrlimit(resource.RLIMIT_CPU)
    while True:
        try:
            _, job, vocabulary = conn.recv()
        except EOFError:
            return
        memory = job["limits"]["memory_bytes"]
        resource.setrlimit(resource.RLIMIT_AS, (memory if hard == resource.RLIM_INFINITY else min(memory, hard),
                                                hard))
        # The time budget counts this process's CPU seconds, not the wall clock: on a busy machine a niced worker
        # waits for the CPU, and that wait is not the spec's cost. Past it the kernel sends SIGXCPU, which ends
        # the process; the parent reads that signal as the time budget exceeded.
        usage = resource.getrusage(resource.RUSAGE_SELF)
        cpu = math.ceil(usage.ru_utime + usage.ru_stime + job["limits"]["time_s"])
        resource.setrlimit(resource.RLIMIT_CPU, (cpu if cpu_hard == resource.RLIM_INFINITY else min(cpu, cpu_hard),
                                                 cpu_hard))
        try:
            if vocabulary is not None:
                eos, tokens = vocabulary
                vocabularies[job["fingerprint"]] = outlines_core.Vocabulary(eos, tokens)
            reply = ("ok", compile_job(job, vocabularies[job["fingerprint"]]))
        except _limits.ConstraintTooLarge as e:
            reply = ("refused", e.limit, e.maximum, e.value, _limits.shown(str(e), _MESSAGE_CHARS))
        except MemoryError:
            os._exit(3)  # the parent reports the memory budget; a fresh worker starts clean
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # noqa: BLE001 - outlines-core's Rust panics are BaseExceptions: the spec's fault
            reply = ("invalid", _limits.shown(str(e) or repr(e), _MESSAGE_CHARS))
        finally:
            resource.setrlimit(resource.RLIMIT_AS, (hard, hard))
            resource.setrlimit(resource.RLIMIT_CPU, (cpu_hard, cpu_hard))
        conn.send(reply)


if __name__ == "__main__":
    os.nice(10)
    serve(Connection(int(sys.argv[1])))
