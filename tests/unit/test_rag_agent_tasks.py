"""The RAG corpus, its BM25 search and the two-hop questions (offline, deterministic)."""

import json

import pytest

from examples.rag_agent import corpus, tasks
from examples.rag_agent.corpus import fold


def low(s):
    return fold(s).lower()


def test_corpus_deterministic_and_well_formed():
    ps = corpus.passages()
    corpus.passages.cache_clear()
    corpus.countries.cache_clear()
    assert corpus.passages() == ps                       # rebuilt from scratch: the same
    assert [p["id"] for p in ps] == sorted({p["id"] for p in ps})   # unique, ordered
    kinds = {p["kind"] for p in ps}
    assert kinds == {"country", "city"}
    assert sum(p["kind"] == "country" for p in ps) > 150 and len(ps) > 1000
    assert all(p["title"] and p["text"].startswith(p["title"]) for p in ps)
    peru = corpus.by_id()["country:PE"]["text"]
    assert "capital is Lima" in peru and "(PEN)" in peru and "Spanish" in peru


def test_search_returns_passage_dicts():
    hits = corpus.search("Guadalajara", k=3)
    assert 1 <= len(hits) <= 3 and set(hits[0]) == {"id", "title", "text"}
    assert hits[0]["title"] == "Guadalajara" and "Mexico" in hits[0]["text"]
    assert corpus.search("Bogotá")[0]["id"] == corpus.search("bogota")[0]["id"]   # accents folded
    assert corpus.search("") == [] and corpus.search("the of is") == [] and corpus.search("zzqxw") == []


def test_every_question_is_two_hop_and_supported():
    all_tasks = tasks.all_tasks()
    assert len(all_tasks) >= 500
    assert len({t["task_id"] for t in all_tasks}) == len(all_tasks)
    assert len({t["question"] for t in all_tasks}) == len(all_tasks)
    by_id = corpus.by_id()
    for t in all_tasks:
        first, second = (by_id[s] for s in t["support"])          # both exist
        md = t["metadata"]
        assert first["kind"] == "city" and second["kind"] == "country"
        assert first["title"] == md["entity"] and md["entity"] in t["question"]
        assert second["title"] == md["bridge"] and md["bridge"] in first["text"]   # hop 1 names the bridge
        assert md["bridge"] not in t["question"]                                  # ... the question does not
        # the answer is in the hop-2 passage (each part of the compound answer)
        for part in t["answers"][0].split(", "):
            assert low(part) in low(second["text"]), (t["task_id"], part)


def test_split_disjoint_and_stable():
    train = tasks.load_tasks("train", tasks.TRAIN_SEED, 500)
    heldout = tasks.load_tasks("heldout", tasks.HELDOUT_SEED, 300)
    assert tasks.disjoint(train, heldout)
    assert not tasks.disjoint(train, tasks.load_tasks("train", 7, 50))
    sizes = tasks.pool_sizes()
    assert sizes["train"] >= 1000 and sizes["heldout"] >= 300
    assert all(t["metadata"]["split"] == "heldout" for t in heldout)
    # stable: same call, same list; a larger size extends it; another seed reorders
    assert tasks.load_tasks("train", 0, 20) == train[:20]
    assert [t["task_id"] for t in tasks.load_tasks("train", 1, 20)] != [t["task_id"] for t in train[:20]]
    json.dumps(train + heldout)   # JSON-serialisable
    for field in ("task_id", "question", "answers", "support"):
        assert all(t[field] for t in train)


def test_load_tasks_rejects_bad_arguments():
    with pytest.raises(ValueError):
        tasks.load_tasks("test", 0, 10)
    with pytest.raises(ValueError):
        tasks.load_tasks("train", 0, 0)
    with pytest.raises(ValueError):
        tasks.load_tasks("heldout", 0, tasks.pool_sizes()["heldout"] + 1)


#: measured 2026-12-01: the question itself as the query finds the hop-1 passage in the
#: top 3 for 100.0% of the 1867 questions (top 1: 99.3%); the bridge name plus what is
#: asked ("Mexico currency") finds the hop-2 passage at rank 1 for 97.3%
HOP1_TOP3_FLOOR = 0.97
HOP2_TOP1_FLOOR = 0.90


def test_retrieval_floors():
    all_tasks = tasks.all_tasks()
    hop1 = sum(t["support"][0] in {h["id"] for h in corpus.search(t["question"], 3)} for t in all_tasks)
    assert hop1 / len(all_tasks) >= HOP1_TOP3_FLOOR
    hop2 = 0
    for t in all_tasks:
        asked = t["metadata"]["template"].split("_", 1)[1].replace("_", " ")
        hits = corpus.search(f"{t['metadata']['bridge']} {asked}", 1)
        hop2 += bool(hits) and hits[0]["id"] == t["support"][1]
    assert hop2 / len(all_tasks) >= HOP2_TOP1_FLOOR
