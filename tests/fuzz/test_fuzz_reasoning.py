"""Generated replies through the thinking splitter (seeded, so a failure repeats): tags, pieces of tags,
whitespace and text, streamed in chunks cut at random places (inside the tags too)."""

from __future__ import annotations

import random

import pytest

from nanochat.app.reasoning import CLOSE, OPEN, ThinkingSplitter, join_reasoning, split_reasoning

PIECES = [OPEN, CLOSE, "<", "</", "<th", "</thi", "<think", "</think", ">", "think", " ", "\n", "\n\n", "\t",
          "a", "word", "é", "🙂", "<b>", "x < y", "</", "```"]
SEEDS = range(20)


def reply(rng: random.Random) -> str:
    parts = [rng.choice(PIECES) for _ in range(rng.randrange(0, 30))]
    if rng.random() < 0.5:   # most replies of a reasoning model open with the block
        parts.insert(0, rng.choice([OPEN, f"{OPEN}\n", f"\n{OPEN}\n", " "]))
    return "".join(parts)


def cuts(rng: random.Random, text: str) -> list[str]:
    points = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randrange(0, 8)))) if len(text) > 1 else []
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)])]


def streamed(chunks: list[str], prompted: bool) -> tuple[ThinkingSplitter, list[tuple]]:
    """Feed the chunks; the (reasoning, answer) after each one."""
    splitter, seen = ThinkingSplitter(prompted), []
    for chunk in chunks:
        splitter.feed(chunk)
        seen.append((splitter.reasoning, splitter.answer))
    splitter.finish()
    seen.append((splitter.reasoning, splitter.answer))
    return splitter, seen


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("prompted", [False, True])
def test_a_reply_cut_anywhere_splits_as_the_whole(seed, prompted):
    rng = random.Random(seed)
    for _ in range(300):
        text = reply(rng)
        whole = split_reasoning(text, prompted)
        splitter, seen = streamed(cuts(rng, text), prompted)
        assert (splitter.reasoning, splitter.answer, splitter.closed) == (whole.reasoning, whole.answer, whole.closed)
        # both parts only grow while streaming: a front end appends what each gained
        for (r0, a0), (r1, a1) in zip(seen, seen[1:]):
            assert (r1 or "").startswith(r0 or "") and a1.startswith(a0)
            assert r0 is None or r1 is not None


@pytest.mark.parametrize("seed", SEEDS)
def test_a_reply_without_a_leading_block_is_all_answer_exactly(seed):
    rng = random.Random(seed)
    for _ in range(300):
        text = reply(rng)
        if text.lstrip().startswith(OPEN):
            continue
        split = split_reasoning(text)
        assert split.reasoning is None and split.answer == text and not split.closed


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("prompted", [False, True])
def test_joining_the_parts_gives_a_reply_that_splits_into_them(seed, prompted):
    rng = random.Random(seed)
    for _ in range(300):
        reasoning = reply(rng).replace(CLOSE, "").strip()
        answer = reply(rng).lstrip()
        for closed in (True, False):
            text = join_reasoning(reasoning, answer, closed, prompted)
            split = split_reasoning(text, prompted)
            if CLOSE in reasoning:   # removing one may have made another ("</</think>think>")
                continue
            assert split.reasoning == reasoning and split.closed == closed
            assert split.answer == (answer if closed else "")
