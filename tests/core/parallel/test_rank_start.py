"""Self-launched ranks (``python -m deepinfer.engine.rank_main``): from a script on stdin or ``python -c`` (no
``__main__`` to re-import), and a rank that fails while starting reported at once with its error."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deepinfer.engine.rank_processes import RankStartupError, wait_for
from tests.support.rank_hooks import TwoExperts, join_then_die
from tests.support.ranks import run_alone

ROOT = Path(__file__).resolve().parents[3]
ARGS = dict(dtype="float32", max_num_seqs=4, state_cache_bytes=1 << 22, distributed_timeout=120)
PROMPTS = ["Once upon a time", "Tom had a ball.", "One day,"]

#: Generates on the embedded model with DP2 + EP2, printing the greedy tokens as one JSON line; twice, as a
#: notebook that runs its cell again does: the first LLM is dropped (its ranks go with it), the second is shut
#: down, and a third started while the second runs is refused.
PROGRAM = f"""
import gc, json
from deepinfer import LLM, SamplingParams
def run():
    llm = LLM(**{ARGS!r}, data_parallel_size=2, expert_parallel_size=2)
    outs = llm.generate({PROMPTS!r}, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), use_tqdm=False)
    print(json.dumps([o.outputs[0].token_ids for o in outs]), flush=True)
    return llm
llm = run()
del llm
gc.collect()
llm = run()
try:
    LLM(**{ARGS!r}, data_parallel_size=2)
except RuntimeError as exc:
    print(json.dumps(str(exc)))
llm.shutdown()
"""


def _python(*args: str, stdin: str | None = None, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "DEEPINFER_HF_MODEL_DIR")}
    env.update(DEEPINFER_ACCELERATOR="cpu", HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, *args], input=stdin, capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=ROOT)


def _printed(run: subprocess.CompletedProcess[str]) -> list:
    assert run.returncode == 0, run.stderr[-3000:]
    return [json.loads(line) for line in run.stdout.strip().splitlines()]


def _check(run: subprocess.CompletedProcess[str], one_rank: list[list[int]]) -> None:
    first, second, refused = _printed(run)
    assert first == second == one_rank
    assert refused.startswith("this process already leads ranks of another parallel LLM: call shutdown()")


@pytest.fixture(scope="module")
def one_rank() -> list[list[int]]:
    from deepinfer import LLM, SamplingParams

    outs = LLM(**ARGS).generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_a_script_on_stdin_starts_its_ranks(one_rank):
    run = _python("-", stdin=PROGRAM)
    _check(run, one_rank)
    assert "(rank 1) " in run.stderr  # the started rank's log comes back through rank 0, labelled


@pytest.mark.slow  # two more interpreters (~30 s on a loaded 2-core machine); the stdin test above is the sibling
def test_python_c_starts_its_ranks(one_rank):
    _check(_python("-c", PROGRAM), one_rank)


def test_an_argument_only_the_ranks_cannot_read_is_reported_at_once():
    """A path class defined in ``python -c``'s ``__main__``: rank 0 has it, a started rank cannot unpickle it."""
    program = (f"import os\nfrom deepinfer import LLM\nclass Here(os.PathLike):\n    def __fspath__(self):\n"
               f"        return {str(ROOT / 'deepinfer-core/src/deepinfer/assets/tiny_v41')!r}\n"
               f"LLM(Here(), data_parallel_size=2, **{ARGS!r})\n")
    start = time.monotonic()
    run = _python("-c", program)
    assert run.returncode == 1 and time.monotonic() - start < 100  # not the 120 s rendezvous timeout
    message = next(line for line in run.stderr.splitlines() if line.startswith("deepinfer.engine.rank_processes"))
    assert message.startswith("deepinfer.engine.rank_processes.RankStartupError: a rank failed while the ranks were "
                              "starting: rank 1 of 2 exited with code 1: UnpicklingError: this rank cannot rebuild "
                              "LLM's arguments (AttributeError: Can't get attribute 'Here'"), message
    assert "none may come from a notebook's or a script's __main__" in message
    assert "its last lines on stderr:" in run.stderr and "    Traceback (most recent call last)" in run.stderr


def _start_with_a_dying_rank(timeout_s: float) -> tuple[str, float]:
    import torch.distributed as dist

    from deepinfer.backends import current_backend
    from deepinfer.engine.rank_launch import join_world
    from deepinfer.engine.rank_processes import reporting_dead_peers
    from deepinfer.parallel.plan import ParallelConfig

    joined = join_world(ParallelConfig(2), current_backend(), TwoExperts(), timeout_s,
                        functools.partial(join_then_die, 7, timeout_s))
    start = time.monotonic()
    try:
        with reporting_dead_peers(joined.peers):
            wait_for(joined.peers, "ready", timeout_s)
    except RankStartupError as exc:
        return str(exc), time.monotonic() - start
    finally:
        dist.destroy_process_group()
    return "no error", time.monotonic() - start


def test_a_rank_that_dies_after_joining_is_reported_with_its_exit_code_and_stderr():
    message, waited = run_alone(_start_with_a_dying_rank, 120.0, join_s=180)
    assert waited < 60, message
    assert "rank 1 of 2 exited with code 7" in message and "gives up loading its shard" in message
