"""The project as an installed package, not a checkout: a wheel built from the repository, and one built from
exactly what infra/worker.Dockerfile copies into the worker image, each installed (not editable) into a fresh
virtual environment and used from a folder that holds no sources: the command answers `--help` and every
entrypoint of prefect.yaml imports from the installed files. The image's Python and Ray are those of the Ray
cluster (infra/k8s/raycluster.yaml), which refuses a driver of another version.

Dependencies come from the test's own environment (.venv), nothing is downloaded, and the wheels are built
without build isolation (which would fetch setuptools).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path, PurePosixPath

import pytest
import yaml
from packaging.specifiers import SpecifierSet

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "infra" / "worker.Dockerfile"
PACKAGES = ("eagle3_datagen", "flows", "tasks", "cli")
TIMEOUT_S = 600

# Run by the fresh environment's interpreter: each entrypoint imported as a worker imports it, and where every
# module of the project and its package data were found.
IMPORT_ENTRYPOINTS = """
import importlib, importlib.resources, json, sys
import prefect

found = {}
for entrypoint in sys.argv[1:]:
    module_name, name = entrypoint.split(":")
    found[entrypoint] = isinstance(getattr(importlib.import_module(module_name), name), prefect.Flow)
data = importlib.resources.files("eagle3_datagen")
print(json.dumps({
    "flows": found,
    "modules": {name: module.__file__ for name, module in sys.modules.items()
                if name.split(".")[0] in PACKAGES and getattr(module, "__file__", None)},
    "package_data": [data.joinpath(f).is_file() for f in ("py.typed", "data/demo_questions.jsonl")],
}))
""".replace("PACKAGES", repr(PACKAGES))


def _env(tmp: Path) -> dict[str, str]:
    """The environment of every command here: temporary files and Prefect's home under tmp, no user site, no
    path or virtual environment inherited from the caller, no pip cache, no prompts."""
    (tmp / "tmp").mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP") and not k.startswith("PIP_")}
    return {**env, "TMPDIR": str(tmp / "tmp"), "PYTHONNOUSERSITE": "1", "PREFECT_HOME": str(tmp / "prefect-home"),
            "PIP_NO_CACHE_DIR": "1", "PIP_NO_INPUT": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}


def _run(args: list[str | Path], tmp: Path, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([str(a) for a in args], cwd=cwd, env=_env(tmp), capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    assert done.returncode == 0, f"{shlex.join(map(str, args))} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


def build_wheel(source: Path, tmp: Path) -> Path:
    """`pip wheel` of source, with this interpreter's setuptools (no isolation, no index)."""
    out = tmp / "wheel"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", out,
          source], tmp)
    [wheel] = out.glob("eagle3_datagen-*.whl")
    return wheel


def install(wheel: Path, tmp: Path) -> Path:
    """A fresh virtual environment holding the wheel (not editable), its dependencies taken from this one's
    site-packages; returns its bin folder.

    This environment's folders are appended by a .pth file rather than through --system-site-packages (which
    would add the base interpreter's, not .venv's): a folder named in a .pth file has its own .pth files
    ignored, so the checkout's editable install (a .pth file in .venv) cannot shadow the wheel. The wheel is
    installed before that file exists, so pip sees no other eagle3-datagen."""
    env_dir = tmp / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", env_dir], tmp)
    python = env_dir / "bin" / "python"
    _run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index", wheel], tmp)
    site = Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], tmp).stdout.strip())
    ours = dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))
    (site / "_eagle3_test_dependencies.pth").write_text("".join(f"{p}\n" for p in ours))
    return env_dir / "bin"


def entrypoints() -> list[str]:
    """prefect.yaml's entrypoints as module:name (a `flows/pipeline.py:pipeline` path names module flows.pipeline)."""
    found = []
    for deployment in yaml.safe_load((REPO / "prefect.yaml").read_text())["deployments"]:
        path, name = deployment["entrypoint"].rsplit(":", 1)
        module = path.removesuffix(".py").replace("/", ".") if path.endswith(".py") else path
        found.append(f"{module}:{name}")
    return sorted(set(found))


def source_files(root: Path) -> set[str]:
    """The files of the project's packages under root, as a wheel names them."""
    return {f.relative_to(root).as_posix() for package in PACKAGES for f in (root / package).rglob("*")
            if f.is_file() and "__pycache__" not in f.parts}


def check_installed(bin_dir: Path, tmp: Path, cwd: Path) -> None:
    """From cwd, a folder without the project's sources: the command and every prefect.yaml entrypoint work, and
    everything they import of the project comes from the environment's site-packages."""
    assert not any((cwd / p).exists() for p in PACKAGES), f"{cwd} holds sources that would hide the installed ones"
    usage = _run([bin_dir / "eagle3-datagen", "--help"], tmp, cwd=cwd).stdout
    assert "usage: eagle3-datagen" in usage
    named = entrypoints()
    assert "flows.pipeline:pipeline" in named
    found = json.loads(_run([bin_dir / "python", "-c", IMPORT_ENTRYPOINTS, *named], tmp, cwd=cwd).stdout)
    assert found["flows"] == dict.fromkeys(named, True), "every entrypoint is a Prefect flow"
    env_dir = bin_dir.parent.resolve()
    elsewhere = {n: f for n, f in found["modules"].items() if not Path(f).resolve().is_relative_to(env_dir)}
    assert not elsewhere, f"imported from outside the fresh environment (not the wheel): {elsewhere}"
    assert found["package_data"] == [True, True], "py.typed and data/*.jsonl ship in the wheel"


# The worker image, as its Dockerfile builds it: WORKDIR, COPY and RUN replayed on a folder standing for its root.

def _instructions() -> list[tuple[str, str]]:
    joined = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    lines = [line.strip() for line in joined.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]


def _base_image() -> str:
    args: dict[str, str] = {}
    for op, rest in _instructions():
        if op == "ARG" and "=" in rest:
            key, value = rest.split("=", 1)
            args[key.strip()] = value.strip().strip('"')
        elif op == "FROM":
            return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args[m.group(1) or m.group(2)], rest.split()[0])
    raise AssertionError(f"no FROM in {DOCKERFILE}")


def replay_dockerfile(root: Path) -> tuple[Path, Path]:
    """Copies what the Dockerfile's COPY lines copy, where they copy it, under root. Returns the folder its
    `pip install` installs and the image's final working directory."""
    workdir = PurePosixPath("/")
    installed: Path | None = None

    def at(path: str) -> Path:
        return root / (workdir / path).relative_to("/")

    for op, rest in _instructions():
        if op == "WORKDIR":
            workdir = workdir / rest
            at(".").mkdir(parents=True, exist_ok=True)
        elif op == "COPY":
            *sources, dest = shlex.split(rest)
            assert not any(s.startswith("--") for s in sources), f"only plain COPY lines are replayed: {rest}"
            target = at(dest)
            for source in sources:
                path = REPO / source
                assert path.exists(), f"COPY {source}: no such file in the repository"
                if path.is_dir():  # Docker copies a folder's contents
                    shutil.copytree(path, target, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__"))
                else:
                    into_folder = dest.endswith("/") or len(sources) > 1 or target.is_dir()
                    (target if into_folder else target.parent).mkdir(parents=True, exist_ok=True)
                    shutil.copy2(path, target / path.name if into_folder else target)
        elif op == "RUN":
            for command in re.split(r"&&|;|\|\|", rest):
                words = shlex.split(command)
                if "install" in words and any(w in ("pip", "pip3") for w in words[:words.index("install")]):
                    options = words[words.index("install") + 1:]
                    assert not {"-e", "--editable"} & set(options), f"the image installs editable: {command}"
                    [target] = [w for w in options if not w.startswith("-")]
                    installed = at(target)
    assert installed is not None, f"no `pip install` in {DOCKERFILE}"
    return installed, at(".")


@pytest.fixture(scope="module")
def repo_wheel(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, set[str]]:
    """The wheel of a copy of the checkout's files (tracked or not ignored), as a clone would build it; built once
    for the module. A copy, so the build's build/ and egg-info folders stay out of the checkout."""
    tmp = tmp_path_factory.mktemp("repo-wheel")
    listed = subprocess.run(["git", "-C", REPO, "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            capture_output=True, text=True, check=True).stdout
    source = tmp / "source"
    for name in filter(None, listed.split("\0")):
        if (REPO / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, source / name)
    return build_wheel(source, tmp), source_files(source)


@pytest.fixture(scope="module")
def image_wheel(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, set[str], Path]:
    """The wheel the worker image installs, built from only what its Dockerfile copies; with the image's final
    working directory (replayed)."""
    tmp = tmp_path_factory.mktemp("image-wheel")
    installed, workdir = replay_dockerfile(tmp / "root")
    return build_wheel(installed, tmp), source_files(installed), workdir


def test_repo_wheel_holds_every_package_and_its_data(repo_wheel: tuple[Path, set[str]]) -> None:
    wheel, sources = repo_wheel
    missing = sorted(sources - set(zipfile.ZipFile(wheel).namelist()))
    assert not missing, f"the wheel lacks {missing}"
    assert {"tasks/run/__init__.py", "tasks/evaluate/__init__.py", "eagle3_datagen/data/demo_questions.jsonl",
            "eagle3_datagen/py.typed"} <= sources


def test_repo_wheel_installed_runs_the_cli_and_every_entrypoint(repo_wheel: tuple[Path, set[str]],
                                                               tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    check_installed(install(repo_wheel[0], tmp_path), tmp_path, cwd=elsewhere)


def test_image_wheel_holds_every_package_of_the_checkout(image_wheel: tuple[Path, set[str], Path],
                                                         repo_wheel: tuple[Path, set[str]]) -> None:
    wheel, _, _ = image_wheel
    missing = sorted(repo_wheel[1] - set(zipfile.ZipFile(wheel).namelist()))
    assert not missing, f"the image's wheel lacks {missing}: does {DOCKERFILE.name} COPY every package?"


def test_image_install_runs_the_cli_and_every_entrypoint(image_wheel: tuple[Path, set[str], Path],
                                                        tmp_path: Path) -> None:
    """From the image's working directory, which must hold prefect.yaml (its deployments' pull step) and no
    sources (Prefect imports an entrypoint with the working directory first on sys.path)."""
    wheel, _, workdir = image_wheel
    assert (workdir / "prefect.yaml").is_file(), "the worker's folder holds prefect.yaml"
    check_installed(install(wheel, tmp_path), tmp_path, cwd=workdir)


def test_image_python_and_ray_are_the_clusters() -> None:
    """The Prefect worker (the Ray driver) and every Ray node run one Python and one Ray: the worker image's, or a
    rayproject/ray image of the same versions."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    [ray_pin] = [m.group(1) for d in project["dependencies"] if (m := re.fullmatch(r"ray(?:\[.*\])?==(\S+)", d))]
    base = _base_image()
    python = re.fullmatch(r"(?:docker\.io/)?(?:library/)?python:(\d+)\.(\d+)[^:]*", base)
    assert python, f"the worker image is built FROM {base}, not an official python image"
    image_python = f"{python.group(1)}.{python.group(2)}"
    assert SpecifierSet(project["requires-python"]).contains(f"{image_python}.0"), project["requires-python"]
    # the pinned Ray is the one installed and tested here (make setup): the image's Python must be this one's
    assert image_python == f"{sys.version_info.major}.{sys.version_info.minor}", (
        f"the image's Python {image_python} is not the one Ray {ray_pin} is installed and tested on here")

    [cluster] = yaml.safe_load_all((REPO / "infra" / "k8s" / "raycluster.yaml").read_text())
    [worker] = yaml.safe_load_all((REPO / "infra" / "k8s" / "worker.yaml").read_text())
    worker_image = worker["spec"]["template"]["spec"]["containers"][0]["image"]
    assert cluster["spec"]["rayVersion"] == ray_pin
    groups = [cluster["spec"]["headGroupSpec"], *cluster["spec"]["workerGroupSpecs"]]
    images = [c["image"] for g in groups for c in g["template"]["spec"]["containers"]]
    assert images
    for image in images:
        ray_image = re.fullmatch(r"(?:docker\.io/)?rayproject/ray(?:-ml)?:(\d+\.\d+\.\d+)(?:-py(\d)(\d+))?\S*", image)
        if ray_image:
            assert ray_image.group(1) == ray_pin, f"{image}: Ray {ray_image.group(1)}, the driver's is {ray_pin}"
            assert ray_image.group(2) and f"{ray_image.group(2)}.{ray_image.group(3)}" == image_python, (
                f"{image}: the driver runs Python {image_python}")
        else:
            assert image == worker_image, f"Ray node image {image} is neither the worker's ({worker_image}) nor Ray's"
