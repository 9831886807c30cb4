"""The prompt-side copy signals and the router target that ranks by what escalation gains."""

from __future__ import annotations

import numpy as np
import pytest

from shared.escalation import (
    COPY_SIGNALS,
    EdgePolicy,
    copy_hits,
    copy_lookup,
    copy_signals,
    fit_router,
    no_loss_target,
    suffix_match,
)
from shared.routing_eval import apgr, pgr_curves


def _copy_hits_by_search(ids: list[int]) -> list[bool]:
    """The definition, written out: the token after the latest earlier occurrence of the two tokens before."""
    out = []
    for j in range(len(ids)):
        prediction = None
        for s in range(j - 3, -1, -1):
            if j >= 2 and ids[s : s + 2] == ids[j - 2 : j]:
                prediction = ids[s + 2]
                break
        out.append(prediction is not None and prediction == ids[j])
    return out


def test_copy_hits_follow_the_latest_earlier_occurrence() -> None:
    # "a b c ... a b d ... a b": the last "a b" is predicted from the latest one (d), not the first (c).
    a, b, c, d, x = 1, 2, 3, 4, 9
    ids = [a, b, c, x, a, b, d, x, a, b, d]
    assert copy_hits(ids).tolist() == [False] * 9 + [True, True]  # "x a" -> b, then "a b" -> d
    assert copy_hits([a, b, c, x, a, b, d, x, a, b, c])[-1] == np.False_
    rng = np.random.default_rng(0)
    for _ in range(200):
        seq = rng.integers(0, 5, size=int(rng.integers(0, 40))).tolist()
        assert copy_hits(seq).tolist() == _copy_hits_by_search(seq)


def test_copy_signals_see_copyable_text_the_edge_did_not_copy() -> None:
    table = [7, 8, 9, 10] * 20  # a repeating table: every token after the first cycle is copyable
    follows, breaks = [7, 8, 9, 10], [5, 6, 5, 6]
    kept = copy_signals(table, follows)
    missed = copy_signals(table, breaks)
    assert set(kept) == set(COPY_SIGNALS)
    assert kept["prompt_novelty"] == 0.0 and kept["copy_kept"] == 1.0
    assert missed["prompt_novelty"] == 0.0 and missed["copy_kept"] == 0.0
    # Text with nothing to copy: nothing for the cloud's copying to gain, whatever the edge answers.
    novel = copy_signals(list(range(100, 180)), breaks)
    confident = {"prompt_novelty", "copy_kept", "prompt_novelty_all", "copy_unavailable", "copy_first_kept"}
    assert all(novel[k] == 1.0 for k in confident) and novel["suffix_novelty"] == 0.0
    empty = copy_signals([], [])
    assert set(empty) == set(COPY_SIGNALS) and all(empty[k] == 1.0 for k in confident)
    assert empty["suffix_novelty"] == 0.0


def test_the_first_generated_token_and_the_repeated_suffix_say_where_copying_gains() -> None:
    """A copy available for the first generated token that the edge did not take derails the greedy continuation
    (the cloud, copying, gets the rest right): ``copy_first_kept`` drops to 0; a prompt ending in a long stretch it
    has seen before is copyable far ahead: ``suffix_novelty`` falls with the stretch's length."""
    table = [7, 8, 9, 10] * 20
    follows, breaks = [7, 8, 9, 10], [5, 6, 5, 6]
    kept, missed = copy_signals(table, follows), copy_signals(table, breaks)
    assert kept["copy_unavailable"] == missed["copy_unavailable"] == 0.0  # "9 10" was followed by 7 before
    assert kept["copy_first_kept"] == 1.0 and missed["copy_first_kept"] == 0.0
    assert kept["prompt_novelty_all"] < 0.1  # all but the first cycle is copyable
    # The table repeats its whole 80-token suffix (less one cycle): capped.
    assert suffix_match(table)[0] == 32 and kept["suffix_novelty"] == pytest.approx(-np.log(33))
    fresh_end = [*table, 50, 51]  # the last two tokens never seen: nothing to copy from for the next one
    late = copy_signals(fresh_end, breaks)
    assert late["copy_unavailable"] == 1.0 and late["copy_first_kept"] == 1.0 and late["suffix_novelty"] == 0.0
    short = copy_signals([1, 2, 3, 4, 1, 2, 3], [9])  # "1 2 3" repeats: 3 tokens, then "2 3" was followed by 4
    assert short["suffix_novelty"] == pytest.approx(-np.log(4)) and short["copy_first_kept"] == 0.0


def _suffix_match_by_search(ids: list[int], cap: int = 32) -> tuple[int, int]:
    """The definition, written out: every earlier position the suffix may end at, the tokens matched going back
    from it (up to ``cap``), the longest, and the latest position matching that many (-1 when none matches)."""
    best, best_end = 0, -1
    for end in range(len(ids) - 1):  # an earlier occurrence ending at ``end``
        k = 0
        while k < cap and end - k >= 0 and ids[end - k] == ids[len(ids) - 1 - k]:
            k += 1
        if k > 0 and k >= best:
            best, best_end = k, end
    return best, best_end


def test_copy_lookup_and_suffix_match_follow_their_definitions() -> None:
    rng = np.random.default_rng(3)
    for _ in range(300):
        seq = rng.integers(0, 4, size=int(rng.integers(0, 60))).tolist()
        has, hits = copy_lookup(seq)
        searched = _copy_hits_by_search(seq)
        assert hits.tolist() == searched
        # A prediction exists exactly where the two tokens before occurred earlier.
        assert has.tolist() == [
            j >= 2 and any(seq[s : s + 2] == seq[j - 2 : j] for s in range(j - 2)) for j in range(len(seq))
        ]
        assert suffix_match(seq) == _suffix_match_by_search(seq)
        assert suffix_match(seq, cap=3) == _suffix_match_by_search(seq, cap=3)


@pytest.mark.parametrize("vocabulary", [1, 2, 5, 50, 4096])
def test_suffix_match_gives_the_searched_length_and_end_on_long_and_periodic_prompts(vocabulary: int) -> None:
    """Both numbers ``copy_run_missed`` reads, on prompts as long as the micro LM's (248 tokens) and past them, on
    random and periodic text (long repeats, one token repeated throughout), at every cap up to past the prompt."""
    rng = np.random.default_rng(vocabulary)
    for _ in range(150):
        n = int(rng.integers(0, 300))
        seq = rng.integers(0, vocabulary, size=n)
        if rng.random() < 0.5 and n > 0:  # a periodic stretch with a few tokens changed
            seq = np.resize(seq[: int(rng.integers(1, 20))], n)
            seq[rng.integers(0, n, size=int(rng.integers(0, 4)))] = int(rng.integers(0, vocabulary))
        ids = seq.tolist()
        for cap in (0, 1, 2, 3, 32, 400):
            assert suffix_match(ids, cap) == _suffix_match_by_search(ids, cap)
            assert suffix_match(seq, cap) == _suffix_match_by_search(ids, cap)  # an array as the agent may pass
    assert suffix_match([7] * 248) == (32, 246) and suffix_match([7] * 248, cap=400) == (247, 246)
    assert suffix_match([1, 2]) == (0, -1) and suffix_match([3]) == (0, -1) and suffix_match([]) == (0, -1)


def _copy_run_missed_by_search(prompt: list[int], output: list[int], cap: int = 32) -> float:
    """The definition, written out: the longest repeated suffix of the prompt (``_suffix_match_by_search``), the
    tokens after its latest earlier occurrence, and the share of the output that does not follow them."""
    length = _suffix_match_by_search(prompt, cap)[0]
    if length == 0:
        return 0.0
    end = max(
        e
        for e in range(len(prompt) - 1)
        if e - length + 1 >= 0 and prompt[e - length + 1 : e + 1] == prompt[len(prompt) - length :]
    )
    continued = prompt[end + 1 : end + 1 + len(output)]
    if not continued:
        return 0.0
    missed = sum(a != b for a, b in zip(continued, output, strict=False)) / len(continued)
    return -float(np.log1p(length)) * missed


def test_copy_run_missed_sees_a_repeated_stretch_the_edge_did_not_continue() -> None:
    """A prompt ending in a long stretch it has seen before, and an edge answer that does not go on as the stretch
    went on before: the cloud, which copies its context, gains there; ``copy_run_missed`` drops with the stretch's
    length and the share of the answer that broke off. An answer that continues it, or a prompt with nothing
    repeated, keeps it at 0."""
    head = [40, 41, 42, 43, 44, 45, 46, 47]
    prompt = [1, 2, 3, *head, 9, 8, 7, 6, 5, 4, *head[:6]]  # ends in a 6-token stretch first followed by 46 47 9 8
    assert suffix_match(prompt) == (6, 8)  # it ends at the first "45", index 8
    follows = copy_signals(prompt, [46, 47, 9, 8])
    broke_late = copy_signals(prompt, [46, 47, 30, 31])
    broke = copy_signals(prompt, [30, 31, 32, 33])
    assert follows["copy_run_missed"] == 0.0
    assert broke_late["copy_run_missed"] == pytest.approx(-np.log(7) * 0.5)
    assert broke["copy_run_missed"] == pytest.approx(-np.log(7))
    # The same broken answer after a 1-token repeat weighs less: there was little to copy.
    short = copy_signals([5, 6, 7, 8, 5], [30, 31])
    assert short["copy_run_missed"] == pytest.approx(-np.log(2)) and short["copy_run_missed"] > -np.log(7)
    assert copy_signals(list(range(50)), [30, 31])["copy_run_missed"] == 0.0  # nothing repeated
    assert copy_signals([1, 2, 3, 1, 2], [])["copy_run_missed"] == 0.0  # nothing generated
    rng = np.random.default_rng(5)
    for _ in range(300):
        seq = rng.integers(0, 4, size=int(rng.integers(0, 50))).tolist()
        out = rng.integers(0, 4, size=int(rng.integers(0, 9))).tolist()
        assert copy_signals(seq, out)["copy_run_missed"] == pytest.approx(_copy_run_missed_by_search(seq, out))
        assert copy_signals(seq, out, tail=32)["copy_run_missed"] <= 0.0


def test_a_policy_can_ship_a_copy_signal() -> None:
    policy = EdgePolicy.from_json(EdgePolicy("tierline/lm-edge", "copy_kept", 0.5).to_json())
    assert policy.should_escalate({"copy_kept": 0.2}) and not policy.should_escalate({"copy_kept": 0.9})


def test_no_loss_target_orders_by_what_escalation_gains() -> None:
    edge = np.array([1.0, 0.0, 0.5, 0.25])
    cloud = np.array([0.0, 1.0, 0.5, 0.75])
    assert no_loss_target(edge, cloud).tolist() == pytest.approx([1.0, 0.0, 0.5, 0.25])
    assert no_loss_target(np.array([True, False]), np.array([True, True])).tolist() == [0.5, 0.0]


def test_router_on_the_gain_beats_one_on_agreement_when_the_cloud_fixes_what_the_edge_cannot_see() -> None:
    """The LM pair's situation: one feature says when the edge is right (its confidence), another when the cloud
    is (how copyable the text is). The tiers agree where the edge is right, so a router fitted on agreement
    learns only the edge's side; one fitted on the gain sends first the requests the cloud fixes."""
    rng = np.random.default_rng(1)
    n = 2000
    confidence, copyable = rng.uniform(size=n), rng.uniform(size=n)
    edge = (confidence > 0.7).astype(float)
    cloud = np.maximum(edge, copyable > 0.5)
    table = {"confidence": confidence + rng.normal(scale=0.05, size=n), "copyable": copyable}
    agrees = edge * cloud  # the same answer when both are right; wrong answers differ (graded tokens)
    val, test = np.arange(n // 2), np.arange(n // 2, n)

    def test_apgr(target: np.ndarray) -> float:
        router = fit_router({k: v[val] for k, v in table.items()}, target[val], list(table))
        conf = router.confidences({k: v[test] for k, v in table.items()})
        return float(apgr(pgr_curves(conf, edge[test], cloud[test]))[0])

    assert test_apgr(no_loss_target(edge, cloud)) > test_apgr(agrees) + 0.1
