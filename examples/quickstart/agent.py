"""A one-call agent that spanrl trains: it answers sums, and is rewarded when the sum is right.

Train it (starts the stack, evaluates before and after on held-out sums, writes results/):

    make train AGENT=examples.quickstart.agent:spec
"""
import random
import re

import openai

import spanrl


def load_tasks(split: str, seed: int, size: int) -> list[dict]:
    """``size`` sums; training sums have a first term below 50, held-out ones above (disjoint)."""
    rng = random.Random(f"{split}-{seed}")
    low = 2 if split == "train" else 50
    tasks = []
    for i in range(size):
        a, b = rng.randint(low, low + 47), rng.randint(2, 49)
        tasks.append({"task_id": f"sum-{split}-{seed}-{i}", "answer": a + b,
                      "question": f"What is {a} + {b}? Reply with the number only."})
    return tasks


def reward(text: str, answer: int) -> dict[str, float]:
    """1 for the right number (a number alone, or as the reply's last number), 0.1 for a number."""
    numbers = re.findall(r"-?\d+", text)
    correct = float(bool(numbers) and int(numbers[-1]) == answer)
    return {"correct": correct, "format": float(bool(re.fullmatch(r"\s*-?\d+\s*\.?\s*", text)))}


async def sum_agent(ctx: spanrl.RolloutContext) -> None:
    """One attempt: one LLM call through spanrl's proxy (recorded and trained on), one reward."""
    client = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key)
    reply = await client.chat.completions.create(
        model="policy", max_tokens=16, temperature=1.0,
        messages=[{"role": "user", "content": ctx.task["question"]}])
    parts = reward(reply.choices[0].message.content or "", ctx.task["answer"])
    ctx.emit_reward(parts["correct"] + 0.1 * parts["format"], **parts)


spec = spanrl.AgentSpec(
    name="quickstart", runner=sum_agent, load_tasks=load_tasks,
    demo={"iterations": 3, "tasks": 6, "group_size": 6, "heldout_tasks": 100},
)
