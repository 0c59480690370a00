# The ddp-cifar training image: a PyTorch base plus this project's trainer.
#   GPU: make image       (BASE_IMAGE defaults to the pinned NGC PyTorch release below)
#   CPU: make image-cpu   (BASE_IMAGE=ddp-cifar-base:cpu, built on this machine from nothing)
# Works with the legacy builder (DOCKER_BUILDKIT=0). A base that exists locally is used as is; without
# --pull nothing is fetched. The base brings torch: nothing here installs or upgrades it.
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:26.08-py3
FROM ${BASE_IMAGE}

# The base is recorded (OCI's base-image annotations) so that `up` can have a node pull it from its own registry
# and send only the layers above it (docs/image.md). BASE_DIGEST: the base's registry digest (sha256:...), which
# `make image` reads from the local base; empty when not known (`up` then looks at the local base's RepoDigests).
ARG BASE_IMAGE
ARG BASE_DIGEST=
ARG VERSION=0.0.0
LABEL org.opencontainers.image.title="ddp-cifar" \
      org.opencontainers.image.description="Multi-node PyTorch DDP training of a ResNet on CIFAR-10" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.base.name="${BASE_IMAGE}" \
      org.opencontainers.image.base.digest="${BASE_DIGEST}"

# The trainer is plain source on PYTHONPATH (no pip install: the base's torch must stay untouched).
# PYTHONUNBUFFERED: log lines reach `docker logs` (and the orchestrator) as they are written.
ENV PYTHONPATH=/app${PYTHONPATH:+:${PYTHONPATH}} \
    PYTHONUNBUFFERED=1

# Everything that changes less often than the trainer comes first, so a change to trainer/ touches only the
# last layer (about 80 KB) and `up` sends only that layer to nodes that hold the previous build.
WORKDIR /workspace
# Rank 0 writes TensorBoard event files (torch.utils.tensorboard needs the tensorboard package). The CPU base has
# it from its wheel set; NGC's PyTorch images have shipped it, and where a base lacks it, pip adds it here (with
# a package index in reach; without one the trainer warns once and writes no event files).
RUN python -c "import tensorboard" 2>/dev/null \
 || pip install --no-cache-dir --retries 1 --timeout 30 tensorboard \
 || echo "warning: no tensorboard in this image: the trainer will write no TensorBoard event files" >&2
COPY docker/entrypoint.sh docker/nccl.env /app/docker/
COPY trainer/ /app/trainer/

# Run containers with --init (compose: init: true): tini is PID 1 and forwards SIGTERM from `docker stop`
# to the command, which the entrypoint exec()s - torchrun, or the trainer, which checkpoints and exits 143.
ENTRYPOINT ["/app/docker/entrypoint.sh"]
CMD ["python", "-m", "trainer", "--help"]
