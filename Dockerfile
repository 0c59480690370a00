# The ddp-cifar training image: a PyTorch base plus this project's trainer.
#   GPU: make image       (BASE_IMAGE defaults to the pinned NGC PyTorch release below)
#   CPU: make image-cpu   (BASE_IMAGE=ddp-cifar-base:cpu, built on this machine from nothing)
# Works with the legacy builder (DOCKER_BUILDKIT=0). A base that exists locally is used as is; without
# --pull nothing is fetched. The base brings torch: nothing here installs or upgrades it.
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:26.08-py3
FROM ${BASE_IMAGE}

ARG VERSION=0.0.0
LABEL org.opencontainers.image.title="ddp-cifar" \
      org.opencontainers.image.description="Multi-node PyTorch DDP training of a ResNet on CIFAR-10" \
      org.opencontainers.image.version="${VERSION}"

# The trainer is plain source on PYTHONPATH (no pip install: the base's torch must stay untouched).
# PYTHONUNBUFFERED: log lines reach `docker logs` (and the orchestrator) as they are written.
ENV PYTHONPATH=/app${PYTHONPATH:+:${PYTHONPATH}} \
    PYTHONUNBUFFERED=1

# Everything that changes less often than the trainer comes first, so a change to trainer/ touches only the
# last layer (about 80 KB) and `up` sends only that layer to nodes that hold the previous build.
WORKDIR /workspace
COPY docker/entrypoint.sh docker/nccl.env /app/docker/
COPY trainer/ /app/trainer/

# Run containers with --init (compose: init: true): tini is PID 1 and forwards SIGTERM from `docker stop`
# to the command, which the entrypoint exec()s - torchrun, or the trainer, which checkpoints and exits 143.
ENTRYPOINT ["/app/docker/entrypoint.sh"]
CMD ["python", "-m", "trainer", "--help"]
