"""The RAG agent's reward: SQuAD F1 by hand, normalisation, tags, exact values."""

import pytest

from examples.rag_agent.reward import CORRECT_F1, extract_answer, f1_score, normalise, reward

PESO = {"answers": ["Mexican Peso", "Peso", "MXN"]}
COMPOUND = {"answers": ["Mexico, Mexico City"]}


@pytest.mark.parametrize("text, expected", [
    ("The Peso!", "peso"),
    ("  an   Apple, a day ", "apple day"),
    ("Bogotá", "bogota"),
    ("Côte d'Ivoire", "cote divoire"),   # punctuation deleted, not spaced (SQuAD)
    ("theatre", "theatre"),          # articles only as whole words
    ("", ""),
])
def test_normalise(text, expected):
    assert normalise(text) == expected


def test_f1_by_hand():
    # pred [mexican, peso, coins] vs gold [mexican, peso]: 2 shared, P=2/3, R=1 -> 0.8
    assert f1_score("Mexican peso coins", "Mexican Peso") == pytest.approx(0.8)
    # pred [peso] vs gold [mexican, peso]: P=1, R=1/2 -> 2/3
    assert f1_score("peso", "Mexican Peso") == pytest.approx(2 / 3)
    # repeated tokens count once each side (multiset intersection): [paris, paris] vs [paris]
    assert f1_score("Paris Paris", "Paris") == pytest.approx(2 * 0.5 * 1 / 1.5)
    assert f1_score("Lima", "Quito") == 0.0
    assert f1_score("", "Quito") == 0.0
    assert f1_score("the", "") == 1.0            # both normalise to nothing (SQuAD)


def test_extract_answer():
    assert extract_answer("I think <answer> Peso </answer>") == ("Peso", True)
    assert extract_answer("<answer>Euro</answer> no, <ANSWER>Peso</ANSWER>") == ("Peso", True)
    assert extract_answer("<answer> </answer> Peso") == ("<answer> </answer> Peso", False)
    assert extract_answer("It is the peso.") == ("It is the peso.", False)
    assert extract_answer("<answer>Peso") == ("<answer>Peso", False)   # unclosed: no format
    assert extract_answer(None) == ("", False)


def test_reward_exact_values():
    assert reward("<answer>Peso</answer>", PESO) == (1.0, {"f1": 1.0, "format": 1.0, "correct": 1.0})
    # best alias: "the mexican peso" -> [mexican, peso] exact for "Mexican Peso"
    assert reward("<answer>the Mexican peso.</answer>", PESO)[0] == 1.0
    # tagged, wrong
    assert reward("<answer>Euro</answer>", PESO) == (0.1, {"f1": 0.0, "format": 1.0, "correct": 0.0})
    # untagged: whole reply is the answer; [it, is, peso] vs [peso]: P=1/3, R=1 -> 0.5
    assert reward("It is the peso.", PESO) == (0.45, {"f1": 0.5, "format": 0.0, "correct": 0.0})
    assert reward("", PESO) == (0.0, {"f1": 0.0, "format": 0.0, "correct": 0.0})


def test_reward_partial_and_correct_threshold():
    # [mexico, city] vs [mexico, mexico, city]: shared 2, P=1, R=2/3 -> F1 0.8 -> correct at the threshold
    value, comp = reward("<answer>Mexico City</answer>", COMPOUND)
    assert comp == {"f1": 0.8, "format": 1.0, "correct": 1.0} and value == pytest.approx(0.82)
    assert CORRECT_F1 == 0.8
    # [mexico] vs gold: P=1, R=1/3 -> 0.5 -> not correct; 0.9*0.5 + 0.1
    assert reward("<answer>Mexico</answer>", COMPOUND) == (0.55, {"f1": 0.5, "format": 1.0, "correct": 0.0})
    assert reward("<answer>Mexico, Mexico City</answer>", COMPOUND)[1]["correct"] == 1.0
