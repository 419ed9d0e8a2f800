"""What the benchmarks share: the goodput a previous run measured, the report files, the
hardware entry of a result file."""

from __future__ import annotations

import json

from tools.bench.harness import hardware_report, measured_goodput, write_json, write_report
from tools.spec.profile import Hardware


def test_measured_goodput_reads_slo_bucketed_and_is_none_without_a_usable_file(tmp_path):
    path = tmp_path / "goodput.json"
    assert measured_goodput(path) is None  # no file
    path.write_text("{not json")
    assert measured_goodput(path) is None
    path.write_text(json.dumps({"setups": {"default_batching": {"goodput_rps": 16}}}))
    assert measured_goodput(path) is None  # no slo_bucketed setup
    path.write_text(json.dumps({"setups": {"slo_bucketed": {"goodput_rps": 136}}}))
    assert measured_goodput(path) == 136.0


def test_write_report_writes_the_json_and_the_plot_beside_it(tmp_path):
    out = tmp_path / "results" / "bench.json"
    drawn, logged = [], []
    write_report({"figure": 1}, out, lambda report, path: drawn.append((report, path)), logged.append)
    assert json.loads(out.read_text()) == {"figure": 1} and out.read_text().endswith("\n")
    assert drawn == [({"figure": 1}, out.with_suffix(".png"))]
    assert logged == [f"wrote {out} and {out.with_suffix('.png')}"]
    write_json({"figure": 2}, tmp_path / "other" / "x.json")
    assert json.loads((tmp_path / "other" / "x.json").read_text()) == {"figure": 2}


def test_hardware_report_has_the_versions_only_when_asked():
    hardware = Hardware(name="cpu", kind="cpu", description="2 x CPU", cpu_count=2, gpu=None,
                        details={"memory_gb": 8.0, "python": "3.12"})
    assert hardware_report(hardware) == {"description": "2 x CPU", "cpu_count": 2, "gpu": None}
    assert hardware_report(hardware, details=True) == {"description": "2 x CPU", "cpu_count": 2, "gpu": None,
                                                        "memory_gb": 8.0, "python": "3.12"}
