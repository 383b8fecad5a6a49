# loopwatch worker image: `docker build -t loopwatch .` ; run with `loopwatch worker`.

# Builder stage: the native span path (native/, Rust + pyo3) as a wheel, with Debian's cargo.
FROM python:3.11-slim AS native
RUN apt-get update \
    && apt-get install -y --no-install-recommends cargo \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src/native
COPY native/Cargo.toml native/Cargo.lock native/pyproject.toml ./
COPY native/src ./src
RUN pip wheel --no-cache-dir --no-deps -w /wheels .

FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /src
# pyproject.toml names README.md as the readme: it must be in the build context.
COPY pyproject.toml README.md ./
COPY detectors ./detectors
COPY streams ./streams
COPY alerts ./alerts
RUN pip install . && rm -rf /src
COPY --from=native /wheels /wheels
RUN pip install /wheels/*.whl && rm -rf /wheels \
    && python -c "from streams.spanpath import native; assert native.ACTIVE == 'native', native.describe()"

# Unprivileged user; faust keeps its table state (rocksdb) under the working directory.
RUN useradd --system --uid 10001 --create-home --home-dir /var/lib/loopwatch loopwatch
USER loopwatch
WORKDIR /var/lib/loopwatch

ENV LOOPWATCH_METRICS_PORT=9464
# 6066: worker web API (loopwatch query) · 9464: Prometheus /metrics
EXPOSE 6066 9464

# Liveness: the worker's event loop answers /livez (readiness, /healthz, is for routing and
# dashboards: a broker outage makes it 503, and restarting would not help).
HEALTHCHECK --interval=15s --timeout=3s --start-period=30s --retries=3 \
    CMD python -c "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/livez' % os.environ.get('LOOPWATCH_WEB_PORT', '6066'), timeout=2)"

ENTRYPOINT ["loopwatch"]
CMD ["worker"]
