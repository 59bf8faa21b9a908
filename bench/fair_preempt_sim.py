"""New tenants arriving at a full engine, on the scheduler alone (no model; decision 0034): how
many steps until each has a seat beside a flood holding all 64, and how many sequences are
preempted for them, with ``engine.fair_preempt`` off and on.

    python -m bench.fair_preempt_sim
"""

from __future__ import annotations

import itertools

from libs.engine.block_pool import BlockPool
from libs.engine.kv_manager import KvManager
from libs.engine.params import SamplingParams
from libs.engine.scheduler import Scheduler
from libs.engine.sequence import Sequence
from libs.settings import EngineSettings

SEATS, FLOOD, PROMPT, ANSWER = 64, 96, 32, 128  # seats, flood's open streams, tokens
_ids = itertools.count()


def new_seq(tenant: str) -> Sequence:
    first = 1000 * next(_ids)
    s = Sequence(
        f"{tenant}-{first}", 0, list(range(first, first + PROMPT)), PROMPT, SamplingParams()
    )
    s.tenant = tenant
    return s


def step(s: Scheduler) -> None:
    """One schedule and a pretend forward; an answered sequence is replaced by a new one."""
    for item in s.schedule().scheduled:
        samples = item.samples
        item.seq.num_computed_tokens += item.num_new_tokens
        s.kv.commit(item.seq)
        if samples:
            item.seq.append_token(7)
            if item.seq.num_output_tokens >= ANSWER:
                s.remove(item.seq)
                s.add(new_seq(item.seq.tenant))


def run(preempt: bool, newcomers: int) -> tuple[list[int], int]:
    settings = EngineSettings(block_size=16, max_num_seqs=SEATS, fair_preempt=preempt)
    s = Scheduler(settings, KvManager(BlockPool(8192, 16), "m"))
    for _ in range(FLOOD):
        s.add(new_seq("flood"))
    for _ in range(3 * ANSWER + ANSWER // 2):  # the flood alone, mid-way through its answers
        step(s)
    before = s.num_preemptions
    for k in range(newcomers):
        s.add(new_seq(f"new{k}"))
    seated: dict[str, int] = {}
    n = 0
    while len(seated) < newcomers:
        n += 1
        step(s)
        for x in s.running:
            seated.setdefault(x.tenant, n)
    return sorted(v for t, v in seated.items() if t != "flood"), s.num_preemptions - before


def main() -> None:
    for preempt in (False, True):
        for newcomers in (4, 8, 16):
            waits, preempted = run(preempt, newcomers)
            print(
                f"fair_preempt={str(preempt).lower():5} newcomers={newcomers:2}: steps to a seat "
                f"median {waits[len(waits) // 2]}, max {waits[-1]}; sequences preempted {preempted}"
            )


if __name__ == "__main__":
    main()
