# parsim for GPU clusters: CI's torch version, parsim installed from its own wheel, a non-root user.
#   docker build -t parsim . && docker run --gpus all --ipc=host --rm parsim search --model llama3-70b --gpus 64
# (--ipc=host: torchrun's workers share tensors through /dev/shm, which Docker otherwise caps at 64 MB)
FROM python:3.11-slim AS wheel
WORKDIR /src
COPY pyproject.toml README.md LICENSE ./
COPY parsim ./parsim
COPY cli ./cli
COPY profiles ./profiles
RUN pip install --no-cache-dir build && python -m build --wheel --outdir /dist

FROM python:3.11-slim
# the torch CI pins (.ci/run), installed first so that parsim's own dependencies never resolve another one; PyPI's
# Linux wheel of this version is the CUDA build (--build-arg TORCH_VERSION=... to change it)
ARG TORCH_VERSION=2.13.0
RUN pip install --no-cache-dir "torch==${TORCH_VERSION}"
COPY --from=wheel /dist/ /tmp/dist/
RUN pip install --no-cache-dir /tmp/dist/*.whl && rm -rf /tmp/dist
RUN useradd --create-home --uid 1000 parsim
USER parsim
WORKDIR /home/parsim
# profiles measured in the container (parsim profile --out NAME) land in ~/.local/share/parsim/profiles: mount a
# volume there to keep them
ENTRYPOINT ["parsim"]
CMD ["--help"]
