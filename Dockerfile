# The kvobs demo engine for docker-compose.yml: `kvobs demo --serve` with steady simulated traffic.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# CPU-only torch first (the demo needs kvobs's torch extra), so that the extra does not pull a multi-GB CUDA build.
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu \
    && pip install numpy

WORKDIR /src
COPY pyproject.toml README.md ./
COPY kvobs ./kvobs
RUN pip install ".[torch]" && rm -rf /src

RUN useradd --system --uid 10001 --no-create-home kvobs
USER kvobs
WORKDIR /tmp

EXPOSE 9464
CMD ["kvobs", "demo", "--serve", "--metrics-port", "9464", "--metrics-addr", "0.0.0.0"]
