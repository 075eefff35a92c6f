"""infra/capacity.py: the projection from per-span CPU costs, with hand-computed values."""
import json

import pytest

from spanrl.infra import capacity as cap


def test_cores_needed_is_rate_times_cost_over_utilisation():
    # 100 000 spans/s × 462 µs = 46.2 core-seconds per second; at 75 % busy: 61.6 cores
    assert cap.cores_needed(462, 100_000, 0.75) == pytest.approx(61.6, abs=1e-12)
    assert cap.cores_needed(1500, 100_000) == pytest.approx(150.0, abs=1e-12)
    assert cap.cores_needed(0, 100_000) == 0.0


@pytest.mark.parametrize("us, rate, util", [(-1, 10, 1), (1, -10, 1), (1, 10, 0), (1, 10, 1.5)])
def test_cores_needed_refuses_nonsense(us, rate, util):
    with pytest.raises(ValueError):
        cap.cores_needed(us, rate, util)


def test_whole_cores_rounds_up_but_forgives_float_noise():
    assert cap.whole_cores(150.00000000000003) == 150
    assert cap.whole_cores(119.99999999999999) == 120
    assert cap.whole_cores(150.1) == 151
    assert cap.whole_cores(0.0) == 1  # a service that runs at all needs one process


def test_partitions_and_brokers():
    assert cap.min_partitions(200) == 200
    with pytest.raises(ValueError):
        cap.min_partitions(0)
    assert cap.kafka_brokers(120.0, 3, 8) == 15  # 120 cores / 8 per broker
    assert cap.kafka_brokers(2.0, 3, 8) == 3  # never fewer than the replicas
    with pytest.raises(ValueError):
        cap.kafka_brokers(1.0, 0, 8)


def test_project_100k_spans_per_s():
    costs = cap.Costs({"bridge": 462, "worker": 1500, "kafka": 300}, spans_per_rollout=8, transitions_per_rollout=5)
    p = cap.project(costs, 100_000, utilisation=0.75, replication_factor=3, cores_per_broker=8)
    assert p.rollouts_per_s == 12_500 and p.transitions_per_s == 62_500
    # bridge 46.2 / 0.75 = 61.6; worker 150 / 0.75 = 200; kafka 300 µs × 3 replicas = 90 cores / 0.75 = 120
    assert p.cores == pytest.approx({"bridge": 61.6, "worker": 200.0, "kafka": 120.0})
    assert p.processes == {"bridge": 62, "worker": 200, "kafka": 120}
    assert p.partitions == 200 and p.brokers == 15 and p.notes == []


def test_project_without_a_broker_figure_says_so():
    costs = cap.Costs({"bridge": 462, "worker": 1500}, 8, 5)
    p = cap.project(costs, 1000)
    assert p.processes == {"bridge": 1, "worker": 2}  # 0.462 -> 1, 1.5 -> 2
    assert p.partitions == 2 and p.brokers is None and p.notes == ["kafka: not measured"]
    with pytest.raises(ValueError):
        cap.project(cap.Costs({"worker": 1}, 0, 5), 1000)


BURST = {"spanrl": {"params": {"rollouts": 100}, "runs": [
    {"spans": 800, "transitions": 500, "expected_transitions": 500, "cpu_s": {"bridge": 0.37, "worker": 1.24}},
    {"spans": 800, "transitions": 500, "expected_transitions": 500, "cpu_s": {"bridge": 0.40, "worker": 1.20}},
    {"spans": 800, "transitions": 500, "expected_transitions": 500, "cpu_s": {"bridge": 0.36, "worker": 1.30}},
]}}
SUSTAINED = {"sustained": {"spanrl": {"cpu_us_per_span": {"bridge": 400, "worker": 900, "broker": 250},
                                      "spans_per_rollout": 8, "transitions_per_rollout": 5}}, **BURST}


def test_costs_from_the_burst_benchmark():
    c = cap.costs_from_bench(BURST)
    # medians of 0.37/800, 0.40/800, 0.36/800 s and 1.24, 1.20, 1.30 s per 800 spans
    assert c.us_per_span == pytest.approx({"bridge": 462.5, "worker": 1550.0})
    assert (c.spans_per_rollout, c.transitions_per_rollout) == (8, 5)


def test_costs_from_the_sustained_benchmark_win_over_the_burst():
    c = cap.costs_from_bench(SUSTAINED)
    assert c.us_per_span == {"bridge": 400, "worker": 900, "kafka": 250}  # broker is read as kafka
    assert (c.spans_per_rollout, c.transitions_per_rollout) == (8, 5)


# the layout bench.sustained writes: one entry per worker/bridge count, per-process figures
SUSTAINED_RUNS = {"mode": "sustained", "workload": {"spans_per_rollout": 8}, "spanrl": [
    {"workers": 1, "bridges": 1, "rollouts": 10000, "spans": 80000, "expected_transitions": 50000,
     "processes": {"bridge0": {"cpu_us_per_span": 300.0}, "worker0": {"cpu_us_per_span": 700.0},
                   "kafka": {"cpu_us_per_span": 260.0, "cpu_us_per_span_minus_idle": 200.0},
                   "client": {"cpu_us_per_span": 999.0}}},
    {"workers": 2, "bridges": 2, "rollouts": 10000, "spans": 80000, "expected_transitions": 50000,
     "processes": {"bridge0": {"cpu_us_per_span": 160.0}, "bridge1": {"cpu_us_per_span": 170.0},
                   "worker0": {"cpu_us_per_span": 400.0}, "worker1": {"cpu_us_per_span": 380.0},
                   "kafka": {"cpu_us_per_span": 250.0, "cpu_us_per_span_minus_idle": 210.0},
                   "client": {"cpu_us_per_span": 999.0}}},
]}


def test_costs_from_the_sustained_runs_sum_each_services_processes():
    last = cap.costs_from_bench(SUSTAINED_RUNS, "s.json")  # default: the scale-out run
    assert last.us_per_span == pytest.approx({"bridge": 330.0, "worker": 780.0, "kafka": 210.0})
    assert (last.spans_per_rollout, last.transitions_per_rollout) == (8, 5)
    assert last.source == "s.json (run 1: 2 workers, 2 bridges)"
    first = cap.costs_from_bench(SUSTAINED_RUNS, "s.json", side=0)
    assert first.us_per_span == pytest.approx({"bridge": 300.0, "worker": 700.0, "kafka": 200.0})
    with pytest.raises(cap.CostsMissing, match="run 0"):
        cap.costs_from_bench({"spanrl": [{"rollouts": 1, "spans": 8, "processes": {"client": {}}}]})


def test_costs_missing_are_named():
    with pytest.raises(cap.CostsMissing, match="cpu_us_per_span"):
        cap.costs_from_bench({"spanrl": {"params": {"rollouts": 1}}})


def test_flags_override_the_json():
    c = cap.merge_flags(cap.costs_from_bench(BURST, "b.json"), {"kafka": 300, "worker": None}, None, 6)
    assert c.us_per_span == pytest.approx({"bridge": 462.5, "worker": 1550.0, "kafka": 300})
    assert (c.spans_per_rollout, c.transitions_per_rollout, c.source) == (8, 6, "b.json + flags")
    with pytest.raises(cap.CostsMissing):
        cap.merge_flags(None, {"worker": 1}, 8, None)


def test_cli_reads_the_json_and_flags(tmp_path, capsys):
    f = tmp_path / "latest.json"
    f.write_text(json.dumps(BURST))
    assert cap.main(["--from", str(f), "--kafka-us", "300", "--spans-per-s", "100000", "--utilisation", "0.75",
                     "--replication-factor", "3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)["projection"]
    # worker 1550 µs: 155 / 0.75 = 206.67 -> 207 workers and partitions; bridge 46.25 / 0.75 = 61.67 -> 62
    assert out["processes"] == {"bridge": 62, "worker": 207, "kafka": 120}
    assert out["partitions"] == 207 and out["brokers"] == 15
    assert cap.main(["--from", str(tmp_path / "absent.json")]) == 2
    assert cap.main(["--from", str(f)]) == 0  # the table; kafka not measured is printed, not an error
    assert "kafka: not measured" in capsys.readouterr().out


def test_a_negative_idle_corrected_broker_figure_falls_back_to_the_raw_one():
    from spanrl.infra.capacity import service_costs

    procs = {"kafka": {"cpu_us_per_span": 436.0, "cpu_us_per_span_minus_idle": -2175.0},
             "worker0": {"cpu_us_per_span": 1083.0}, "bridge0": {"cpu_us_per_span": 349.0}, "client": {"cpu_us_per_span": 655.0}}
    assert service_costs(procs) == {"kafka": 436.0, "worker": 1083.0, "bridge": 349.0}
    procs["kafka"]["cpu_us_per_span_minus_idle"] = 400.0
    assert service_costs(procs)["kafka"] == 400.0
