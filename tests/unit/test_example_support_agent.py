import pytest

from examples.support_agent.feedback import SYSTEM, messages_for, reward_of


def test_ratings_are_rewards():
    assert [reward_of(r) for r in ("up", " Down ", "UP")] == [1.0, 0.0, 1.0]
    for bad in ("", "meh", "5"):
        with pytest.raises(ValueError, match="rating must be one of up, down"):
            reward_of(bad)


def test_next_turn_messages_keep_the_session_history():
    history = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    assert messages_for(history, "Who are you?") == [
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Who are you?"}]
    assert len(history) == 2
    assert messages_for([], "Q") == [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Q"}]
