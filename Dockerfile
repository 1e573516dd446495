# vllm-lifeguard: the sidecar proxy image. Runs next to an unmodified vLLM container (see deploy/k8s/).
#   docker build -t vllm-lifeguard:0.1.0 .
#   docker run --rm -p 8080:8080 -e LIFEGUARD_UPSTREAM=http://vllm:8000 vllm-lifeguard:0.1.0
# Settings come from LIFEGUARD_* env vars (config/lifeguard.yaml lists them all).
ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm

# ---- builder: install the package and its wheels into a self-contained venv
FROM ${PYTHON_IMAGE} AS builder
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHONDONTWRITEBYTECODE=1
# A C compiler for the compiled data plane (setup.py: mypyc); only the venv it builds reaches the final stage.
# Debian's gcc of the pinned base image: its version follows the image, as the image's Python does. The official
# image has Python's headers; make test-image's local stand-in (scripts/image/base-image.sh, Debian's python3) gets
# them from python3-dev.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && { python -c "import os, sys, sysconfig; sys.exit(not os.path.exists(sysconfig.get_paths()['include'] + '/Python.h'))" \
      || apt-get install -y --no-install-recommends python3-dev; } \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
RUN python -m venv /opt/lifeguard
COPY pyproject.toml README.md setup.py ./
COPY proxy ./proxy
# The simulator ships too (about 100 KB of Python): it lets the image be tried and black-box tested with no
# vLLM (`vllm-lifeguard sim`, `serve --upstream sim`); `serve` guards it only when told to.
COPY lifeguard_sim ./lifeguard_sim
# Every runtime dependency ships manylinux wheels for CPython 3.11: only vllm-lifeguard is compiled, and the image
# ships compiled or is not built (`--version` names the build; -P: the installed package, not /src/proxy).
RUN /opt/lifeguard/bin/pip install --no-cache-dir --only-binary=:all: --no-binary=vllm-lifeguard . \
 && /opt/lifeguard/bin/pip uninstall --yes pip setuptools \
 && /opt/lifeguard/bin/vllm-lifeguard --version \
 && /opt/lifeguard/bin/python -P -c "import sys, proxy.compiled as c; sys.exit(c.build() != 'compiled')"

# ---- final: the same base, the venv only, a non-root user
FROM ${PYTHON_IMAGE}
RUN groupadd --system --gid 10001 lifeguard \
 && useradd --system --uid 10001 --gid lifeguard --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin lifeguard
COPY --from=builder /opt/lifeguard /opt/lifeguard
ENV PATH=/opt/lifeguard/bin:${PATH} \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    LIFEGUARD_HOST=0.0.0.0 \
    LIFEGUARD_PORT=8080
USER 10001:10001
EXPOSE 8080
# Liveness only: the proxy's own loop answers, whatever vLLM is doing (python, because slim has no curl).
# It probes $LIFEGUARD_PORT: set the port with that variable, not `serve --port` (make test-image).
HEALTHCHECK --interval=10s --timeout=3s --start-period=5s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request as u; u.urlopen('http://127.0.0.1:%s/lifeguard/healthz' % os.environ.get('LIFEGUARD_PORT', '8080'), timeout=2)"]
ENTRYPOINT ["vllm-lifeguard"]
CMD ["serve"]
