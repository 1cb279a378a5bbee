# The pipeline's worker image: this project and its pinned dependencies (torch from PyPI is the CUDA build,
# which the transformers hidden-state backend uses on GPU workers). Build from the repository root:
#   docker build -f infra/worker.Dockerfile -t ghcr.io/example/eagle3-datagen-worker:0.1.0 .
# The Prefect worker (the Ray driver) and every Ray node (infra/k8s/) run this image, so they share one Python
# and the Ray of pyproject.toml's pin, as Ray requires; tests/integration/test_packaging.py checks both, and
# installs a wheel built from exactly what the COPY lines below bring in.
ARG PYTHON_VERSION=3.11
FROM python:${PYTHON_VERSION}-slim

# What the package is built from, installed as a wheel (not editable) so that a package missing from it fails
# here rather than on a worker; the sources are removed so nothing imports them in place of the installed ones.
WORKDIR /src
COPY pyproject.toml README.md ./
COPY eagle3_datagen eagle3_datagen
COPY flows flows
COPY tasks tasks
COPY cli cli
RUN pip install --no-cache-dir . && rm -rf /src

# The worker's folder: prefect.yaml only (`prefect deploy`, its pull step), no checkout. Prefect imports an
# entrypoint with the working directory on sys.path, so a source folder here would hide the installed package.
WORKDIR /app
COPY prefect.yaml prefect.yaml
