"""The infra files cannot all run here (GPUs, Docker, Kubernetes): keep them valid and consistent with the
code — the same reasoning parser as the profile, the same deployments as prefect.yaml, no secret in a file.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from eagle3_datagen.profiles import BUILTIN_PROFILES

INFRA = Path(__file__).resolve().parents[2] / "infra"


def _documents(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def test_every_manifest_parses_and_names_its_kind() -> None:
    for path in sorted((INFRA / "k8s").glob("*.yaml")):
        for doc in _documents(path):
            assert {"apiVersion", "kind", "metadata", "spec"} <= set(doc), path
            if doc["kind"] in ("Deployment", "StatefulSet"):
                labels = doc["spec"]["template"]["metadata"]["labels"]
                assert doc["spec"]["selector"]["matchLabels"].items() <= labels.items(), path


def test_vllm_services_use_the_profiles_reasoning_parser() -> None:
    parser = BUILTIN_PROFILES["kimi-k2.5"].reasoning_parser
    compose = _documents(INFRA / "compose.yaml")[0]
    assert f"--reasoning-parser {parser}" in compose["services"]["vllm-kimi"]["command"]
    assert "--tensor-parallel-size 8" in compose["services"]["vllm-kimi"]["command"]
    [statefulset, _service] = _documents(INFRA / "k8s" / "vllm.yaml")
    args = statefulset["spec"]["template"]["spec"]["containers"][0]["args"]
    assert f"--reasoning-parser={parser}" in args and "--tensor-parallel-size=8" in args


def test_compose_has_the_whole_service_and_keeps_secrets_in_the_environment() -> None:
    services = _documents(INFRA / "compose.yaml")[0]["services"]
    assert {"postgres", "prefect-server", "s3", "vllm-kimi", "worker"} <= set(services)
    assert services["worker"]["command"] == "prefect worker start --pool eagle3"
    for name, service in services.items():
        for key, value in (service.get("environment") or {}).items():
            if any(word in key for word in ("PASSWORD", "SECRET", "API_KEY", "ACCESS_KEY")):
                assert str(value).startswith("${"), f"{name}.{key} holds a literal secret"


def test_prefect_yaml_deploys_every_flow_to_the_pool_the_infra_starts() -> None:
    config = _documents(INFRA.parent / "prefect.yaml")[0]
    import importlib

    for deployment in config["deployments"]:
        module, name = deployment["entrypoint"].split(":")
        assert hasattr(importlib.import_module(module), name), deployment["entrypoint"]
        assert deployment["work_pool"]["name"] == "eagle3"


def test_the_nightly_schedule_runs_the_documented_example_config() -> None:
    """Turning the nightly deployment's schedule on runs its default parameters: they must be the documented
    example, a valid config, and aimed at the compose stack's services (an absolute output, as a worker
    requires). The pipeline deployment has no schedule: its form opens with values for this machine."""
    from eagle3_datagen.config import parse_config

    deployments = {d["name"]: d for d in _documents(INFRA.parent / "prefect.yaml")[0]["deployments"]}
    nightly = deployments["nightly"]
    example = yaml.safe_load((INFRA.parent / "examples" / "nightly.yaml").read_text())
    [schedule] = nightly["schedules"]
    assert schedule["active"] is False and nightly["parameters"]["config"] == example
    assert nightly["entrypoint"] == deployments["pipeline"]["entrypoint"] and "schedules" not in deployments[
        "pipeline"]
    config = parse_config(example)
    services = _documents(INFRA / "compose.yaml")[0]["services"]
    assert config.server.endpoints == ["http://vllm-kimi:8000"]
    assert config.model.name in services["vllm-kimi"]["command"]
    assert config.output_uri.startswith("s3://") and "/data/prompts" in str(services["worker"]["volumes"])


def test_the_form_opens_with_values_that_run_on_this_machine() -> None:
    """No site's values in the form: an absolute output under the folder `prefect deploy` ran in, the repo's own
    questions and tiny model, a number of requests in flight (`auto` needs vLLM's /metrics)."""
    from eagle3_datagen.config import parse_config

    pipeline = next(d for d in _documents(INFRA.parent / "prefect.yaml")[0]["deployments"] if d["name"] == "pipeline")
    repo = INFRA.parent
    resolved = yaml.safe_load(yaml.safe_dump(pipeline["parameters"]["config"]).replace("{{ $PWD }}", str(repo)))
    config = parse_config(resolved)
    assert config.output_uri == str(repo / "runs")
    assert Path(config.data.source).is_file() and config.model.tokenizer == str(repo / "build" / "tiny-model")
    assert isinstance(config.server.max_in_flight, int) and config.server.endpoints == ["http://127.0.0.1:8000"]


def test_the_ray_cluster_runs_this_ray_and_the_worker_names_its_head() -> None:
    """Ray refuses a driver whose version differs from the cluster's: the manifest must follow the pin."""
    import ray

    [cluster] = _documents(INFRA / "k8s" / "raycluster.yaml")
    assert cluster["kind"] == "RayCluster" and cluster["spec"]["rayVersion"] == ray.__version__
    workers = cluster["spec"]["workerGroupSpecs"]
    assert any(group["template"]["spec"]["containers"][0]["resources"]["limits"].get("nvidia.com/gpu")
               for group in workers), "GPU workers for extraction"
    [worker] = _documents(INFRA / "k8s" / "worker.yaml")
    env = {e["name"]: e.get("value") for e in worker["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["RAY_ADDRESS"] == f"{cluster['metadata']['name']}-head-svc:6379"
    pipeline_ray = next(d for d in _documents(INFRA.parent / "prefect.yaml")[0]["deployments"]
                        if d["name"] == "pipeline-ray")
    assert pipeline_ray["entrypoint"] == "flows.pipeline:pipeline_on_ray"
