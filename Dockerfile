# tokend on a GPU box: `docker build -t tokend . && docker run --gpus all -p 127.0.0.1:50051:50051 tokend`
# The daemon binds 127.0.0.1 only, so the container runs with host networking or behind a local proxy:
#   docker run --gpus all --network host tokend
FROM python:3.11-slim

WORKDIR /opt/tokend
# torch first, pinned: resolving it freely would pick a build that does not match the rest.
RUN pip install --no-cache-dir "torch==2.13.0" "grpcio-tools>=1.62"
COPY pyproject.toml README.md ./
COPY protos ./protos
COPY scripts/gen_protos.py ./scripts/
# The gRPC stubs are generated from protos/ before the install packages them (tokend.v1).
RUN python scripts/gen_protos.py
COPY gpu_runtime ./gpu_runtime
COPY daemon ./daemon
COPY frontend ./frontend
COPY common ./common
RUN pip install --no-cache-dir .

RUN useradd --system --create-home tokend
USER tokend
ENV TOKEND_CACHE_DIR=/home/tokend/.cache/tokend
EXPOSE 50051 8000 9401
# `tokend serve` drains on SIGTERM (docker stop): give it more than --drain-timeout with `docker stop -t 60`.
STOPSIGNAL SIGTERM
ENTRYPOINT ["tokend"]
CMD ["serve"]
