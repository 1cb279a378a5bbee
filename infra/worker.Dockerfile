# The pipeline's worker image: this project and its pinned dependencies (torch from PyPI is the CUDA build,
# which the transformers hidden-state backend uses on GPU workers).
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY eagle3_datagen eagle3_datagen
COPY flows flows
COPY tasks tasks
COPY prefect.yaml prefect.yaml
RUN pip install --no-cache-dir -e .
