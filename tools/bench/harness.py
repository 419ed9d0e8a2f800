"""What the benchmarks and the profiler share, so that no benchmark imports another.

The machine's description (`detect_hardware`: reads /proc/cpuinfo and runs nvidia-smi),
a benchmark's own model repository (`build_repository`: writes generated configs under
build/bench/ and hard-links the model files from the real repository; `build_user_repository`:
a copy of an external model's folder from the user's own repository, its files hard-linked and
its config.pbtxt a fresh file with the setup's fields, so the user's files are never written),
the configs with
the tenant quotas taken out (`without_tenant_quotas`, pure), the report files
(`write_report`: JSON and a PNG beside it; `hardware_report`, pure) and the goodput a
previous run measured (`measured_goodput`: reads results/goodput.json).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import platform
import shutil
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tritonclient.grpc import model_config_pb2 as mc

from tools.paths import DEFAULT_MODEL_REPOSITORY, REPO_ROOT
from tools.repository.configs import GeneratedModel, expected_files
from tools.spec.profile import Hardware

BENCH_DIR = REPO_ROOT / "build" / "bench"
GOODPUT_RESULTS = REPO_ROOT / "results" / "goodput.json"

GPU_VENDOR_WORDS = frozenset({"nvidia", "tesla", "geforce", "quadro"})
GPU_FAMILY_WORDS = frozenset({"rtx", "gtx"})  # a family word names nothing alone: "RTX 4090" is one model


def profile_name_for_gpu(gpu: str) -> str:
    """The profile name for a GPU as nvidia-smi names it: its model, lower case.

    "NVIDIA H100 80GB HBM3" -> "h100", "NVIDIA A100-SXM4-80GB" -> "a100", "Tesla T4" -> "t4",
    "NVIDIA GeForce RTX 4090" -> "rtx4090"; memory size and form factor are left out, so
    one profile serves every variant of a model. "gpu" when no model word is left.
    """
    words = [word.lower() for word in gpu.split() if word.lower() not in GPU_VENDOR_WORDS]
    parts = [word.split("-")[0] for word in words]
    model = parts[:2] if parts and parts[0] in GPU_FAMILY_WORDS else parts[:1]
    name = "".join(ch for ch in "".join(model) if ch.isascii() and ch.isalnum())
    return name or "gpu"


def detect_hardware(name: str | None) -> Hardware:
    """Describe this machine: CPU model and count, the GPU if nvidia-smi sees one, versions."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu, gpu_details = None, {}
    if shutil.which("nvidia-smi"):
        result = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"],
                                capture_output=True, text=True, timeout=30)
        if result.returncode == 0 and result.stdout.strip():
            name, _, mib = result.stdout.strip().splitlines()[0].rpartition(",")
            gpu = name.strip() or mib.strip()
            with contextlib.suppress(ValueError):  # gpu_memory_gb sizes the LLM's KV cache (gen-config)
                gpu_details["gpu_memory_gb"] = round(float(mib) / 1024, 1)
    import onnxruntime

    kind = "gpu" if gpu else "cpu"
    if name is None:
        name = "cpu" if gpu is None else profile_name_for_gpu(gpu)
    memory_gb = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    return Hardware(
        name=name,
        kind=kind,
        description=f"{gpu} + {cpu}" if gpu else f"{os.cpu_count()} x {cpu}",
        cpu_count=os.cpu_count() or 0,
        gpu=gpu,
        details={"memory_gb": memory_gb, "platform": platform.platform(), "python": platform.python_version(),
                 "onnxruntime": onnxruntime.__version__, "providers": onnxruntime.get_available_providers(),
                 **gpu_details},
    )


def hardware_report(hardware: Hardware, details: bool = False) -> dict[str, Any]:
    """The `hardware` entry of a result file; with `details`, the versions and memory too."""
    report: dict[str, Any] = {"description": hardware.description, "cpu_count": hardware.cpu_count,
                              "gpu": hardware.gpu}
    return {**report, **hardware.details} if details else report


def without_tenant_quotas(plan: list[GeneratedModel], model_name: str) -> list[GeneratedModel]:
    """The plan with the per-tenant quotas of `model_name` taken out.

    Every benchmark request comes from one anonymous tenant, whose tier quota (a business
    limit: 150 req/s and 200 generated tokens/s for the standard tier in this repo's spec)
    would otherwise cap what a fast machine shows. Quotas are measured by `bench overload`;
    the benchmarks measure batching. Authentication, admission and the queues stay as
    generated.
    """
    out = []
    for model in plan:
        if model.name == model_name and "tenants" in model.config.parameters:
            config = mc.ModelConfig()
            config.CopyFrom(model.config)
            del config.parameters["tenants"]
            header = (*model.header, "Benchmark copy: the per-tenant quotas are taken out (the benchmark "
                      "sends every request as one anonymous tenant).")
            model = dataclasses.replace(model, config=config, header=header)
        out.append(model)
    return out


def build_repository(setup: str, plan: list[GeneratedModel]) -> Path:
    """A model repository for one setup: generated configs, model files hard-linked from the real
    one. A bucket model the real repository does not have (an edge derived for another workload)
    runs the files of the bucket it was estimated from (`GeneratedModel.files_from`), the express
    model those of a bucket (`files_of`) when the repository has none of its own: a model's
    bucket models all run the same graph, at different lengths."""
    target = BENCH_DIR / setup
    shutil.rmtree(target, ignore_errors=True)
    add_to_repository(target, plan, plan)
    return target


def add_to_repository(target: Path, models: Sequence[GeneratedModel], plan: Sequence[GeneratedModel]) -> None:
    """Write `models` (of `plan`) into the repository at `target` as `build_repository` does:
    their configs and shims, their files hard-linked. A search point that lingers where the
    session's first plan did not needs the express model added this way."""
    for path, text in expected_files(list(models), target).items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    by_name = {model.name: model for model in plan}

    def files_folder(model: GeneratedModel) -> str:
        """The real repository's folder whose files `model` runs: its own, else the one it names
        (the express model's bucket, itself perhaps an unprofiled edge)."""
        seen = []
        while not (DEFAULT_MODEL_REPOSITORY / model.name).is_dir() and (model.files_from or model.files_of):
            seen.append(model.name)
            name = model.files_from or model.files_of
            model = by_name.get(name, dataclasses.replace(model, name=name, files_from="", files_of=""))
            if model.name in seen:
                break
        return model.name

    for model in models:
        folder = files_folder(model)
        if not (DEFAULT_MODEL_REPOSITORY / folder).is_dir() and model.config.backend == "python":
            continue  # a Python model of the benchmark's own (the shim is all it runs): no files to link
        for version in model.versions:
            source = DEFAULT_MODEL_REPOSITORY / folder / str(version)
            for item in source.iterdir():
                if item.is_file() and item.name != "model.py":  # model files; the shim is generated
                    os.link(item, target / model.name / str(version) / item.name)


def link_or_copy(source: str, target: str) -> None:
    """Hard-link `source` at `target`; copy it where a link cannot be made (another file system)."""
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def copy_user_model(source: Path, target: Path, config_text: str) -> None:
    """The user's model folder `source` at `target`: every file hard-linked (or copied) but its
    config.pbtxt, which is written fresh with `config_text` (a link would write through to the
    user's own file)."""
    def skipped(folder: str, names: list[str]) -> set[str]:
        return {"config.pbtxt"} & set(names) if Path(folder) == source else {"__pycache__"} & set(names)

    shutil.copytree(source, target, ignore=skipped, copy_function=link_or_copy)
    (target / "config.pbtxt").write_text(config_text)


def build_user_repository(setup: str, plan: list[GeneratedModel]) -> tuple[Path, ...]:
    """For a plan with external models: a repository beside the setup's (served with
    `extra_repositories`) holding a copy of each, its config.pbtxt the plan's text for the
    setup (`GeneratedModel.config_text`: the user's own with the setup's batching fields); ()
    for a plan without one."""
    external = [model for model in plan if model.user_config is not None]
    if not external:
        return ()
    target = BENCH_DIR / f"{setup}.user"
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    for model in external:
        copy_user_model(model.user_config.parent, target / model.name, model.config_text())
    return (target,)


def write_json(report: dict, out: Path) -> None:
    """Write a benchmark's result JSON, making its folder."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")


def write_report(report: dict, out: Path, plot: Callable[[dict, Path], None], log: Callable[[str], None]) -> None:
    """Write a benchmark's JSON and, beside it, the PNG that `plot(report, path)` draws."""
    write_json(report, out)
    plot_path = out.with_suffix(".png")
    plot(report, plot_path)
    log(f"wrote {out} and {plot_path}")


def measured_goodput(path: Path = GOODPUT_RESULTS) -> float | None:
    """slo_bucketed's goodput in a goodput result file; None when there is none to read."""
    try:
        return float(json.loads(path.read_text())["setups"]["slo_bucketed"]["goodput_rps"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
