"""The real-arrival scenarios (Azure LLM inference trace 2023) and the priority column of recorded traces."""

from __future__ import annotations

import csv
import fnmatch
import gzip
import json
import tomllib
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from loraplane.sim import azure
from loraplane.sim.azure import AzureOptions, azure_trace, load_service
from loraplane.sim.cli import main as sim_main
from loraplane.sim.trace import (
    AZURE_SCENARIOS,
    SCENARIOS,
    Trace,
    TraceError,
    load_csv,
    scenario,
    zipf_weights,
)
from tests.sim.conftest import ADAPTER_BYTES

DATA = Path(azure.__file__).resolve().parent / "data"
ROWS = {"conv": 19_366, "code": 8_819}


def _raw(service: str) -> tuple[np.ndarray, list[int], list[int]]:
    """A packaged file read without the module: (arrival ns, prompt tokens, generated tokens)."""
    with gzip.open(DATA / f"azure-llm-2023-{service}.csv.gz", "rt", newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["TIMESTAMP", "ContextTokens", "GeneratedTokens"]
    stamps = np.array([r[0] for r in rows[1:]], dtype="datetime64[ns]").astype(np.int64)
    return stamps, [int(r[1]) for r in rows[1:]], [int(r[2]) for r in rows[1:]]


def _trace(name: str, seed: int = 0, requests: int | None = None, **options: float) -> Trace:
    return azure_trace(name, requests, seed, ADAPTER_BYTES, AzureOptions(**options))  # type: ignore[arg-type]


def _service_of(trace: Trace) -> list[str]:
    """Per request of an uncompressed azure-merged trace, its service, found from the files' timestamps."""
    conv, code = _raw("conv")[0], _raw("code")[0]
    start = min(conv[0], code[0])
    conv_times = set(((conv - start) / 1e9).tolist())
    return ["conv" if t in conv_times else "code" for t in trace.arrival]


def test_the_packaged_files_load_and_every_scenario_has_all_their_rows() -> None:
    for service, rows in ROWS.items():
        assert len(_raw(service)[0]) == rows
        assert len(load_service(service)) == rows
    assert set(AZURE_SCENARIOS) <= set(SCENARIOS)
    assert len(scenario("azure-conv", None, 0, ADAPTER_BYTES)) == ROWS["conv"]
    assert len(SCENARIOS["azure-code"](ROWS["code"], 0, ADAPTER_BYTES)) == ROWS["code"]
    merged = scenario("azure-merged", None, 0, ADAPTER_BYTES)
    assert len(merged) == sum(ROWS.values())
    assert merged.meta["clipped_input_rows"] == merged.meta["clipped_output_rows"] == "0"
    with pytest.raises(TraceError, match="has 19,366 requests"):
        scenario("azure-conv", 20_000, 0, ADAPTER_BYTES)


def test_the_package_data_patterns_ship_the_traces() -> None:
    """A wheel carries the traces: pyproject's package-data patterns match every file of sim/loraplane/sim/data."""
    config = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"]["package-data"]["*"]
    files = sorted(p.name for p in DATA.iterdir())
    assert {"azure-llm-2023-conv.csv.gz", "azure-llm-2023-code.csv.gz", "README.md"} <= set(files)
    for name in files:
        assert any(fnmatch.fnmatch(f"data/{name}", p) for p in patterns), name


@pytest.mark.parametrize("compress", [1.0, 2.5])
def test_arrivals_are_the_real_gaps_divided_by_the_compression(compress: float) -> None:
    stamps, n_in, n_out = _raw("conv")
    trace = _trace("azure-conv", compress=compress)
    assert trace.arrival[0] == 0.0
    assert np.diff(trace.arrival) == pytest.approx(np.diff(stamps) / 1e9 / compress, abs=1e-9)
    assert trace.input_tokens == n_in and trace.output_tokens == n_out
    assert trace.duration == pytest.approx((stamps[-1] - stamps[0]) / 1e9 / compress)
    # merged: both services on one timeline from the first row of either
    conv, code = _raw("conv")[0], _raw("code")[0]
    both = np.sort(np.concatenate([conv, code]))
    merged = _trace("azure-merged", compress=compress)
    assert merged.arrival == pytest.approx(((both - both[0]) / 1e9 / compress).tolist(), abs=1e-9)


def test_requests_take_the_first_rows_of_the_timeline() -> None:
    whole = _trace("azure-merged", compress=2)
    first = _trace("azure-merged", requests=500, compress=2)
    assert len(first) == 500
    assert first.arrival == whole.arrival[:500] and first.input_tokens == whole.input_tokens[:500]


def test_the_same_seed_gives_the_same_trace_another_seed_another_assignment() -> None:
    one, again, other = _trace("azure-merged"), _trace("azure-merged"), _trace("azure-merged", seed=1)
    assert one.adapter == again.adapter and one.tenant == again.tenant and one.tenants == again.tenants
    assert other.arrival == one.arrival and other.input_tokens == one.input_tokens
    assert sum(a != b for a, b in zip(one.adapter, other.adapter, strict=True)) > len(one) // 2
    assert [t.priority for t in other.tenants] != [t.priority for t in one.tenants]


def test_zipf_skew_sets_the_popularity() -> None:
    uniform = Counter(_trace("azure-conv", zipf=0.0, locality=0.0).adapter)
    assert len(uniform) == 500 and max(uniform.values()) / ROWS["conv"] < 0.006  # 1/500 = 0.002 each
    skewed = _trace("azure-conv", zipf=1.2, locality=0.0)
    shares = sorted(Counter(skewed.adapter).values(), reverse=True)
    expected = zipf_weights(500, 1.2)
    assert shares[0] / ROWS["conv"] == pytest.approx(expected[0], abs=0.02)
    assert sum(shares[:10]) / ROWS["conv"] == pytest.approx(expected[:10].sum(), abs=0.03)


def _recent_repeats(trace: Trace, window: int) -> float:
    """Share of requests whose adapter is one of the previous ``window`` requests' adapters."""
    hits = sum(trace.adapter[i] in trace.adapter[max(0, i - window) : i] for i in range(1, len(trace)))
    return hits / (len(trace) - 1)


def test_locality_repeats_recent_adapters() -> None:
    none, some, most = (_trace("azure-code", locality=p) for p in (0.0, 0.5, 0.9))
    assert int(none.meta["reused"]) == 0 and int(most.meta["reused"]) > 0.85 * len(most)
    assert _recent_repeats(none, 8) < 0.4
    assert _recent_repeats(none, 8) + 0.2 < _recent_repeats(some, 8) < _recent_repeats(most, 8) - 0.2
    assert _recent_repeats(most, 8) > 0.85
    # a wider window reuses from further back: repeats within the last 8 requests drop
    wide = _trace("azure-code", locality=0.9, locality_window=200)
    assert _recent_repeats(wide, 8) < _recent_repeats(most, 8) - 0.2


def test_merged_services_use_disjoint_families() -> None:
    for families in (2, 4):
        trace = _trace("azure-merged", families=families)
        service = _service_of(trace)
        assert Counter(service) == ROWS
        used = {s: {a for a, t in zip(trace.adapter, service, strict=True) if t == s} for s in ROWS}
        assert used["conv"] and used["code"] and not used["conv"] & used["code"]
        assert {a % families for a in used["conv"]} == set(range(0, families, 2))
        assert {a % families for a in used["code"]} == set(range(1, families, 2))
        assert all(trace.adapters[a].name.startswith(f"{s}-") for a, s in zip(trace.adapter, service, strict=True))
    with pytest.raises(TraceError, match="at least 2 families"):
        _trace("azure-merged", families=1)


def test_families_each_rank_their_own_adapters() -> None:
    """Four families of one service: each has its own head, so the four most popular adapters are one per family."""
    trace = _trace("azure-conv", families=4, locality=0.0)
    top = [a for a, _ in Counter(trace.adapter).most_common(4)]
    assert sorted(a % 4 for a in top) == [0, 1, 2, 3]
    one = Counter(_trace("azure-conv", families=1, locality=0.0).adapter).most_common(1)[0][1]
    assert Counter(trace.adapter)[top[0]] < 0.5 * one  # one family's head takes a quarter of the traffic


def test_tenant_classes_have_their_shares() -> None:
    trace = _trace("azure-merged")
    assert len(trace.tenants) == 50
    assert Counter((t.cls, t.priority) for t in trace.tenants) == {("gold", 1): 5, ("sheddable", -1): 10, ("standard", 0): 35}
    assert trace.tenant == [trace.adapters[a].tenant for a in trace.adapter]
    assert all(adapter.tenant == i % 50 for i, adapter in enumerate(trace.adapters))
    custom = _trace("azure-conv", tenants=20, gold_share=0.3, sheddable_share=0.5)
    assert Counter(t.priority for t in custom.tenants) == {1: 6, -1: 10, 0: 4}
    assert Counter(t.priority for t in _trace("azure-conv", gold_share=0, sheddable_share=0).tenants) == {0: 50}


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"compress": 0.0}, "compress must be"),
        ({"compress": float("nan")}, "compress must be"),
        ({"zipf": -1.0}, "zipf must be"),
        ({"locality": 1.5}, "locality must be"),
        ({"adapters": 4, "families": 5}, "families must be"),
        ({"adapters": 4, "tenants": 5}, "tenants must be"),
        ({"gold_share": 0.6, "sheddable_share": 0.5}, "must be <= 1"),
    ],
)
def test_options_are_validated(options: dict[str, float], message: str) -> None:
    with pytest.raises(TraceError, match=message):
        AzureOptions(**options)  # type: ignore[arg-type]


def test_options_apply_to_the_azure_scenarios_only() -> None:
    with pytest.raises(TraceError, match="apply to azure-conv, azure-code, azure-merged only"):
        scenario("gie-multilora", 100, 0, ADAPTER_BYTES, AzureOptions(compress=2))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--scenario", "azure-conv", "--compress", "0"], "--compress: must be a number > 0"),
        (["--scenario", "azure-conv", "--compress", "-2"], "--compress: must be a number > 0"),
        (["--scenario", "azure-conv", "--locality", "1.2"], "--locality: must be in [0, 1]"),
        (["--scenario", "azure-conv", "--adapters", "0"], "--adapters: must be >= 1"),
        (["--scenario", "hot-plus-burst", "--compress", "2", "--zipf", "1.1"],
         "--compress, --zipf apply to the scenarios azure-conv, azure-code, azure-merged only, not to --scenario hot-plus-burst"),
        (["--compress", "2"], "not to --scenario hot-plus-burst"),
        (["--trace", "t.csv", "--families", "2"], "--families apply to the scenarios"),
    ],
)  # fmt: skip
def test_cli_refuses_bad_azure_options(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        sim_main(argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--scenario", "azure-merged", "--families", "1"], "needs at least 2 families"),
        (["--scenario", "azure-conv", "--gold-share", "0.6", "--sheddable-share", "0.6"], "must be <= 1"),
        (["--scenario", "azure-code", "--requests", "9000"], "has 8,819 requests"),
    ],
)
def test_cli_explains_options_the_scenario_cannot_use(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert sim_main(argv) == 2
    assert message in capsys.readouterr().err.replace("\n", " ")


def test_cli_runs_an_azure_scenario_with_its_options(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    saved = tmp_path / "azure.csv"
    argv = ["--scenario", "azure-merged", "--requests", "300", "--compress", "3", "--adapters", "40", "--families", "4",
            "--policies", "round-robin", "--pods", "2", "--jobs", "1", "--json", "--save-trace", str(saved)]  # fmt: skip
    assert sim_main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["requests"] == 300 and report["scenario"] == "azure-merged"
    assert report["trace_options"]["compress"] == "3.0" and report["trace_options"]["families"] == "4"
    back = load_csv(saved, ADAPTER_BYTES)
    expected = _trace("azure-merged", requests=300, compress=3, adapters=40, families=4)
    assert [back.adapters[a].name for a in back.adapter] == [expected.adapters[a].name for a in expected.adapter]


def test_priority_column_round_trips(tmp_path: Path) -> None:
    trace = _trace("azure-merged", requests=2000)
    text = trace.to_csv()
    assert text.splitlines()[0].split(",")[6] == "priority"
    path = tmp_path / "azure.csv"
    path.write_text(text)
    back = load_csv(path, ADAPTER_BYTES)
    want = {t.name: (t.cls, t.priority) for t in trace.tenants}
    assert {t.name: (t.cls, t.priority) for t in back.tenants} == {t.name: want[t.name] for t in back.tenants}
    assert {t.priority for t in back.tenants} == {-1, 0, 1}
    # a trace whose tenants all have priority 0 is written as before: no priority column
    plain = scenario("gie-multilora", 50, 0, ADAPTER_BYTES)
    assert "priority" not in plain.to_csv().splitlines()[0]
    # hot-plus-burst's gold tenants keep their priority through --save-trace / --trace
    hot = scenario("hot-plus-burst", 300, 0, ADAPTER_BYTES)
    path.write_text(hot.to_csv())
    assert {t.name: t.priority for t in load_csv(path, ADAPTER_BYTES).tenants} == {t.name: t.priority for t in hot.tenants}


def test_priority_column_errors(tmp_path: Path) -> None:
    path = tmp_path / "prio.csv"
    head = "timestamp,adapter,tenant,input_tokens,output_tokens,priority\n"
    path.write_text(head + "0.0,a@v1,t,10,5,1\n1.0,b@v1,u,10,5,\n2.0,a@v1,t,10,5,0\n")
    with pytest.raises(TraceError, match=r"prio.csv:4: tenant 't' has priority 0 here but 1 on line 2"):
        load_csv(path, ADAPTER_BYTES)
    path.write_text(head + "0.0,a@v1,t,10,5,high\n")
    with pytest.raises(TraceError, match=r"prio.csv:2: priority must be an integer"):
        load_csv(path, ADAPTER_BYTES)
    path.write_text(head + "0.0,a@v1,t,10,5,-1\n1.0,b@v1,u,10,5,\n2.0,a@v1,t,10,5,-1\n")
    assert [(t.name, t.priority) for t in load_csv(path, ADAPTER_BYTES).tenants] == [("t", -1), ("u", 0)]
    path.write_text(head.replace(",priority", "") + "0.0,a@v1,t,10,5\n")
    assert load_csv(path, ADAPTER_BYTES).tenants[0].priority == 0


def test_table_shape() -> None:
    shape = azure.shape(_trace("azure-merged", compress=2))
    assert shape["requests"] == sum(ROWS.values())
    assert shape["req_per_s"] == pytest.approx(shape["requests"] / shape["duration_s"])
    assert 1700 < shape["duration_s"] < 1800
