# tokend on a GPU box: `docker build -t tokend . && docker run --gpus all tokend generate "Hello"`
FROM python:3.11-slim

WORKDIR /opt/tokend
# torch first, pinned: resolving it freely would pick a build that does not match the rest.
RUN pip install --no-cache-dir "torch==2.13.0"
COPY pyproject.toml README.md ./
COPY gpu_runtime ./gpu_runtime
COPY daemon ./daemon
COPY frontend ./frontend
RUN pip install --no-cache-dir .

RUN useradd --system --create-home tokend
USER tokend
ENV TOKEND_CACHE_DIR=/home/tokend/.cache/tokend
ENTRYPOINT ["tokend"]
CMD ["generate", "Hello from tokend"]
