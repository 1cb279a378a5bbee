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
