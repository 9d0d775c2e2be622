# parsim for GPU clusters: CUDA PyTorch base, parsim installed, `parsim` as the entrypoint.
#   docker build -t parsim . && docker run --gpus all --rm parsim search --model llama3-70b --gpus 64
FROM pytorch/pytorch:2.9.1-cuda12.8-cudnn9-runtime
WORKDIR /opt/parsim
COPY pyproject.toml README.md ./
COPY parsim ./parsim
COPY cli ./cli
COPY profiles ./profiles
# torch comes from the base image; the core's own dependencies are small
RUN pip install --no-cache-dir -e .
ENTRYPOINT ["parsim"]
CMD ["--help"]
