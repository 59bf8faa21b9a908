from __future__ import annotations

import pytest

from bench.workloads import WORKLOADS, build_handbook, generate

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("workload", WORKLOADS)
def test_workloads_are_deterministic_and_prefix_stable(workload: str) -> None:
    first = generate(workload, 40, seed=3)
    assert first == generate(workload, 40, seed=3)
    assert generate(workload, 10, seed=3) == first[:10]
    assert first != generate(workload, 40, seed=4)
    assert [r.index for r in first] == list(range(40))
    assert all(r.user and r.max_tokens > 0 for r in first)


def test_shared_prefix_requests_share_one_long_system_prompt_and_vary_questions() -> None:
    requests = generate("shared-prefix", 30, seed=1, prefix_words=800)
    systems = {r.system for r in requests}
    assert len(systems) == 1
    (system,) = systems
    assert system is not None and len(system.split()) >= 800
    assert len({r.user for r in requests}) > 10
    assert requests[0].messages()[0] == {"role": "system", "content": system}
    assert requests[0].prompt().startswith(system)


def test_code_asks_for_long_outputs_and_chat_for_short_ones() -> None:
    assert min(r.max_tokens for r in generate("code", 50)) >= 256
    assert max(r.max_tokens for r in generate("chat", 50)) <= 128
    assert {r.max_tokens for r in generate("chat", 5, max_tokens=7)} == {7}


def test_mixed_draws_every_kind() -> None:
    kinds = [r.kind for r in generate("mixed", 200, seed=0)]
    assert {"chat", "shared-prefix", "code"} == set(kinds)
    assert kinds.count("chat") > kinds.count("code")


def test_handbook_grows_to_any_length_and_unknown_workload_fails() -> None:
    assert len(build_handbook(0, words=6000).text.split()) >= 6000
    with pytest.raises(ValueError, match="unknown workload"):
        generate("poetry", 1)
