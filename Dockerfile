# syntax=docker/dockerfile:1.7
# Three images from one file:  docker build --target sidecar -t kvpool-sidecar .
#                              docker build --target operator -t kvpool-operator .
#                              docker build --target vllm -t vllm-kvpool .   (vLLM with the KV connector)
# Both run as a non-root user on a pinned base. The sidecar takes torch as TORCH_SPEC says: the
# default is the CPU build; a GPU image passes its own (e.g. a CUDA build of torch and triton).
FROM python:3.11.10-slim-bookworm AS base
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN groupadd --gid 10001 kvpool && useradd --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin kvpool
WORKDIR /app
COPY pyproject.toml setup.py README.md ./
COPY sidecar sidecar
COPY operator operator

# The wheel with its two C extensions (the frequency sketch's loop, the shadow caches), built where a
# compiler is, so that the sidecar's image carries the compiled code and no compiler.
FROM base AS wheel
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev && rm -rf /var/lib/apt/lists/* \
    && pip wheel --no-deps --wheel-dir /wheels . \
    && python -c "import zipfile, glob; names = zipfile.ZipFile(glob.glob('/wheels/*.whl')[0]).namelist(); \
assert all(any(n.startswith('kvpool_sidecar/' + m) and n.endswith('.so') for n in names) for m in ('_sketch', '_shadow')), names"

FROM base AS sidecar
ARG TORCH_SPEC="torch==2.13.0"
COPY --from=wheel /wheels /wheels
# [peers]: NIXL, which peer fetches read pages with (serve --peer-port, --peers).
RUN pip install "${TORCH_SPEC}" && pip install "$(echo /wheels/*.whl)[peers]" && rm -rf /root/.cache /wheels
USER 10001:10001
EXPOSE 8000 9400
ENTRYPOINT ["kvpool-sidecar"]
CMD ["serve", "--config", "/etc/kvpool/config.yaml", "--metrics-port", "9400"]

FROM base AS operator
# The operator needs only the config contract: no torch, no triton.
RUN pip install --no-deps . && pip install "kopf>=1.37" "kubernetes>=29" "pydantic>=2.6" "pyyaml>=6" && rm -rf /root/.cache
USER 10001:10001
EXPOSE 8080
ENTRYPOINT ["kvpool-operator"]
CMD ["run", "--liveness-port", "8080"]

# vLLM's own image plus the connector (kvpool_sidecar.engines.vllm): torch and vllm come from the base.
FROM vllm/vllm-openai:v0.32.0 AS vllm
COPY pyproject.toml setup.py README.md /opt/kvpool/
COPY sidecar /opt/kvpool/sidecar
COPY operator /opt/kvpool/operator
RUN pip install --no-deps /opt/kvpool && pip install "httpx>=0.27" "pydantic>=2.6" "pyyaml>=6" && rm -rf /root/.cache
