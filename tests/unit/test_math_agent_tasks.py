"""The main job's arithmetic word problems and the written-down train / held-out split."""
import pytest

from examples.math_agent import tasks as T
from examples.math_agent.calc import calculate


def test_deterministic_and_extending():
    a = T.load_arith_tasks(seed=3, size=5)
    assert a == T.load_arith_tasks(seed=3, size=5)
    assert T.load_arith_tasks(seed=3, size=8)[:5] == a
    assert [t["task_id"] for t in a] == [f"arith_word-3-{i}" for i in range(5)]
    # the first item of seed 0, pinned: a change of the generator changes every split
    first = T.load_arith_tasks(seed=0, size=1)[0]
    assert first["question"] == "Jon has 28 cartons of 14 eggs and gives away 76 eggs. How many eggs are left?"
    assert first["answer"] == "316" and first["metadata"]["expression"] == "28*14-76"


def test_answers_are_what_the_calculator_computes():
    for t in T.load_arith_tasks(seed=0, size=300):
        assert calculate(t["metadata"]["expression"]) == t["answer"], t
        assert int(t["answer"]) > 0
        # every number of the expression appears in the question (the tool call is a copy)
        for num in t["metadata"]["expression"].replace("*", " ").replace("+", " ").replace("-", " ") \
                .replace("/", " ").split():
            assert num in t["question"]


def test_every_kind_occurs():
    kinds = {t["metadata"]["kind"] for t in T.load_arith_tasks(seed=0, size=100)}
    assert kinds == {"mul", "add", "sub", "div", "mul_sub", "mul_add"}


def test_train_and_heldout_split_share_no_question():
    train = T.load_arith_tasks(T.TRAIN_SEED, 400)
    heldout = T.load_arith_tasks(T.HELDOUT_SEED, 400)
    assert T.disjoint(train, heldout)
    assert not T.disjoint(train, train[:1])
    # the few-shot demonstrations are not tasks of either set
    from examples.math_agent.agent import FEW_SHOT
    questions = {t["question"] for t in train + heldout}
    assert not any(text.split("\n")[0].removeprefix("Question: ") in questions for _, text in FEW_SHOT)


def test_load_task_set():
    assert T.load_task_set("arith_word", 0, 2) == T.load_arith_tasks(0, 2)
    with pytest.raises(ValueError):
        T.load_task_set("nope", 0, 2)
    with pytest.raises(ValueError):
        T.load_arith_tasks(0, 0)


def test_balanced_training_set_has_every_kind_in_each_six():
    from examples.math_agent.tasks import KINDS, load_arith_tasks, load_task_set

    tasks = load_task_set("arith_word_balanced", 0, 24)
    for i in range(0, 24, 6):
        assert [t["metadata"]["kind"] for t in tasks[i:i + 6]] == list(KINDS)
    assert tasks[0]["task_id"] == "arith_word_balanced-0-0"
    for t in tasks:  # the expression computes the answer
        assert str(int(eval(t["metadata"]["expression"]))) == t["answer"]  # noqa: S307 - our own digits
    held = load_arith_tasks(1000, 200)
    assert not ({t["question"] for t in tasks} & {t["question"] for t in held})


def test_one_step_balanced_set_cycles_mul_add_sub_and_keeps_the_six_kind_set_unchanged():
    from examples.math_agent.tasks import load_arith_tasks, load_task_set

    tasks = load_task_set("arith_word_mul_add_sub", 0, 12)
    assert [t["metadata"]["kind"] for t in tasks[:6]] == ["mul", "add", "sub", "mul", "add", "sub"]
    assert tasks[4]["task_id"] == "arith_word_mul_add_sub-0-4"
    for t in tasks:
        assert str(int(eval(t["metadata"]["expression"]))) == t["answer"]  # noqa: S307 - our own digits
    assert not ({t["question"] for t in tasks} & {t["question"] for t in load_arith_tasks(1000, 200)})
    assert tasks[0]["question"] == "A crate holds 49 bottles. How many bottles are in 67 crates?"
    # the six-kind set's items are still the ones study 2 trained on (same generator seeds)
    assert load_task_set("arith_word_balanced", 0, 1)[0]["question"] == (
        "A shelf holds 97 books. How many books are in 59 shelves?")
